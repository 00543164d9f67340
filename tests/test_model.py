import dataclasses
import math

import pytest
import torch

from megalm.models.gpt.config import GPTConfig
from megalm.models.layers import KVCache
from megalm.models import build_model, flops_per_token, init_weights
from megalm.models.flops import matmul_params
from megalm.parallel import materialize

VARIANTS = {
    "gpt2": dict(),
    "llama": dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", bias=False,
                  tie_embeddings=False),
    "gqa": dict(position_embedding="rope", num_query_groups=2, activation="swiglu"),
    "mqa_dropout": dict(num_query_groups=1, dropout=0.1, attention_dropout=0.1),
}


def make(cfg: GPTConfig, seed=0):
    m = build_model(cfg)
    init_weights(m, cfg, seed)
    return m


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_causality(tiny_model_cfg, variant):
    cfg = dataclasses.replace(tiny_model_cfg, **VARIANTS[variant])
    m = make(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    logits = m(x)
    assert logits.shape == (2, cfg.seq_length, cfg.padded_vocab_size)
    # Changing a future token must not change any earlier logit.
    t = 9
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % cfg.vocab_size
    logits2 = m(y)
    torch.testing.assert_close(logits[:, :t], logits2[:, :t], rtol=0, atol=0)
    assert not torch.allclose(logits[:, t:], logits2[:, t:])


def test_loss_at_init_near_log_vocab(tiny_model_cfg):
    cfg = dataclasses.replace(tiny_model_cfg, vocab_size=512, make_vocab_size_divisible_by=128)
    m = make(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))
    labels = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))
    loss = m(x, labels=labels).item()
    # Small init → near-uniform logits over the padded vocabulary.
    assert abs(loss - math.log(cfg.padded_vocab_size)) < 0.1


def test_tied_and_untied(tiny_model_cfg):
    tied = make(tiny_model_cfg)
    assert tied.head.weight is tied.embed.tok.weight
    untied = make(dataclasses.replace(tiny_model_cfg, tie_embeddings=False))
    assert untied.head.weight is not untied.embed.tok.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == tiny_model_cfg.padded_vocab_size * tiny_model_cfg.hidden_size


def test_meta_build_then_materialise_keeps_tie_and_init(tiny_model_cfg):
    eager = make(tiny_model_cfg, seed=3)
    meta = build_model(tiny_model_cfg, device="meta")
    materialize(meta, "cpu")  # to_empty unties: materialize shares the weights again
    init_weights(meta, tiny_model_cfg, 3)
    assert meta.head.weight is meta.embed.tok.weight
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), meta.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def test_a_meta_build_runs_no_initialiser_and_a_cpu_build_runs_them_all():
    """On the meta device torch.nn.init's initialisers are skipped: they compute nothing there, cost most of a
    meta build, and torch._refs' normal_ imports torch's compiler (1-2 s of a process's start) on the way.
    Counted in a fresh process, which has not imported the compiler yet."""
    import subprocess
    import sys
    script = (
        "import sys, torch\n"
        "from torch.overrides import TorchFunctionMode\n"
        "from megalm.models import build_model\n"
        "from megalm.models.gpt import GPTConfig\n"
        "class Count(TorchFunctionMode):  # the in-place random and fill kernels the initialisers end in\n"
        "    n = 0\n"
        "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
        "        Count.n += getattr(func, '__name__', '') in ('normal_', 'uniform_', 'fill_', 'zero_')\n"
        "        return func(*args, **(kwargs or {}))\n"
        "cfg = GPTConfig(name='t', num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)\n"
        "with Count():\n"
        "    meta = build_model(cfg, 'meta')\n"
        "print(Count.n, 'torch._dynamo' in sys.modules, all(p.is_meta for p in meta.parameters()))\n"
        "with Count():\n"
        "    build_model(cfg, 'cpu')\n"
        "print(Count.n)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    meta_line, cpu_line = out.stdout.split("\n")[:2]
    assert meta_line == "0 False True"
    assert int(cpu_line) > 0  # the same build on the CPU initialises as torch's modules do


def test_init_keyed_by_global_name(tiny_model_cfg):
    a, b = make(tiny_model_cfg, 1), make(tiny_model_cfg, 2)
    assert not torch.equal(a.blocks["0"].attn.qkv.weight, b.blocks["0"].attn.qkv.weight)
    # Two layers of the same shape get different weights (the name is in the key) ...
    assert not torch.equal(a.blocks["0"].mlp.fc1.weight, a.blocks["1"].mlp.fc1.weight)
    # ... and a deeper model shares the shallower one's layers by name.
    deep = make(dataclasses.replace(tiny_model_cfg, num_layers=3), 1)
    torch.testing.assert_close(deep.blocks["1"].mlp.fc1.weight, a.blocks["1"].mlp.fc1.weight, rtol=0, atol=0)
    std = a.blocks["0"].mlp.fc2.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * tiny_model_cfg.num_layers)) < 0.003
    assert torch.all(a.blocks["0"].norm1.weight == 1) and torch.all(a.blocks["0"].attn.qkv.bias == 0)


@pytest.mark.parametrize("variant", ["gpt2", "gqa"])
def test_kv_cache_matches_full_forward(tiny_model_cfg, variant):
    cfg = dataclasses.replace(tiny_model_cfg, **VARIANTS[variant])
    m = make(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    full = m(x)
    cache = KVCache(cfg.num_layers, 1, cfg.kv_heads, cfg.seq_length, cfg.head_dim)
    pieces = [m(x[:, :5], cache=cache, start=0)]
    pieces.append(m(x[:, 5:8], cache=cache, start=5))  # a chunk after a prefix
    for t in range(8, 12):
        pieces.append(m(x[:, t:t + 1], cache=cache, start=t))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_flops_formula_hand_count():
    # A hand count for a small config, written out term by term (not from the code):
    # h=64, heads=4 (hd=16), kv groups=2, swiglu ffn=128, L=3, V=1000 padded to 1024, s=32.
    cfg = GPTConfig(name="f", num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=128, seq_length=32, vocab_size=1000, make_vocab_size_divisible_by=128,
                      activation="swiglu")
    qkv = 64 * (4 * 16 + 2 * 2 * 16)     # 64 x 128
    proj = 64 * 64
    mlp = 64 * 2 * 128 + 128 * 64        # [gate | up] then down
    head = 64 * 1024
    n = 3 * (qkv + proj + mlp) + head
    assert matmul_params(cfg) == n == 3 * (8192 + 4096 + 24576) + 65536
    attention = 3 * 2 * 2 * 32 * 64 * 3  # layers x (QK^T + AV) x 2 FLOPs/MAC x s x h x (fwd + 2 bwd)
    assert flops_per_token(cfg) == 6 * n + attention


def test_flops_gpt3_175b_matches_paper_scale():
    # GPT-3 175B: 6N with N ~ 174.6e9 non-embedding parameters (+ head) → ~1.05e12 FLOPs/token.
    cfg = GPTConfig(name="175b", num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                      vocab_size=50257)
    n_blocks = 96 * 12 * 12288 ** 2
    assert abs(matmul_params(cfg) - n_blocks) / n_blocks < 0.01
    assert 1.0e12 < flops_per_token(cfg) < 1.2e12


def test_ignored_labels_take_no_part_in_the_loss(tiny_model_cfg):
    from megalm.ops.losses import IGNORE
    m = make(tiny_model_cfg)
    x = torch.randint(0, tiny_model_cfg.vocab_size, (2, 8))
    y = torch.randint(0, tiny_model_cfg.vocab_size, (2, 8))
    logits = m(x)
    per_token = m.criterion.per_token(logits, y)
    y_masked = y.clone()
    y_masked[0, :3] = IGNORE
    keep = torch.ones_like(y, dtype=torch.bool)
    keep[0, :3] = False
    torch.testing.assert_close(m.criterion(logits, y_masked), per_token[keep].mean())
    # The model's batch loss: the same through the labels, and through a loss mask alone.
    torch.testing.assert_close(m.loss(logits, {"labels": y_masked}), per_token[keep].mean())
    torch.testing.assert_close(m.loss(logits, {"labels": y, "loss_mask": keep.float()}), per_token[keep].mean())
