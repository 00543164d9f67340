"""model.attention_backend: the unfused attention gives SDPA's results, and auto picks it where it should.

Equality is checked in fp32 against torch's scaled_dot_product_attention (an independent
implementation) on every mask the models pass, through whole GPT, BERT and T5 models, forward and
backward; the multi-rank run is in test_parallel_model's layouts.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megalm.models.layers import AttentionCore, KVCache
from megalm.models import build_model, init_weights
from megalm.models.gpt.config import GPTConfig
from megalm.ops.attention import CAUSAL_SPLIT_MIN, attention_backend, unfused_attention


def _qkv(B=2, H=4, T=6, S=6, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, hd, generator=g, requires_grad=True) for n in (T, S, S)]


def _close_in_fp32(ours, ref, reduced: int):
    """Equal up to the rounding of two fp32 implementations: each element is a few chained sums of `reduced` terms
    (QK^T over the head dim, the softmax and AV over the keys; backward the same again), which round to within about
    n u of the largest magnitudes summed (u = 2^-24, fp32's unit roundoff); the gradients' chain of four such sums
    gives 4 n u times the tensor's largest element, which an element near zero (a sum that cancels) is held to."""
    eps = torch.finfo(torch.float32).eps / 2
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=4 * reduced * eps * ref.abs().max().item())


def _masks(B, T, S):
    g = torch.Generator().manual_seed(1)
    keys = torch.ones(B, 1, 1, S, dtype=torch.bool)
    keys[0, ..., S - 2:] = False  # padding at the end of the first sequence
    packed = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for lo, hi in ((0, 2), (2, T)):  # two examples in one row, each causal inside itself
        packed[..., lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    bias = torch.randn(1, 4, T, S, generator=g).masked_fill(~keys, float("-inf"))  # T5: relative bias + key mask
    return {"keys": keys, "packed": packed, "additive": bias}


@pytest.mark.parametrize("case", ["causal", "causal_after_prefix", "keys", "packed", "additive", "none"])
def test_unfused_equals_sdpa_forward_and_backward(case):
    T, S = (3, 7) if case == "causal_after_prefix" else (6, 6)
    q, k, v = _qkv(T=T, S=S)
    mask = _masks(2, T, S).get(case)
    causal = case.startswith("causal")
    ours = unfused_attention(q, k, v, mask, causal)
    if case == "causal_after_prefix":  # query t sees the prefix and the chunk up to itself
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(T, S, dtype=torch.bool).tril(S - T))
    else:
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    reduced = max(S, q.shape[-1])  # the longest sum: over the keys, or over the head dim
    _close_in_fp32(ours, ref, reduced)
    grad = torch.randn_like(ref)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours_grads, ref_grads):
        _close_in_fp32(a, b, reduced)


@pytest.mark.parametrize("T", [CAUSAL_SPLIT_MIN, 2 * CAUSAL_SPLIT_MIN])
def test_long_causal_unfused_attention_skips_the_masked_quarter_and_equals_sdpa(T):
    """From CAUSAL_SPLIT_MIN tokens the causal unfused attention runs as two query halves, the first half against
    the first half of the keys (at 2x that, the first half splits again): SDPA's values and gradients, with the
    matmul FLOPs 3/4 (11/16 at 2x) of the whole score matrix's; what is skipped lies under the mask."""
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = _qkv(B=1, H=2, T=T, S=T, hd=8)
    with FlopCounterMode(display=False) as counter:
        ours = unfused_attention(q, k, v, causal=True)
    whole = 2 * (2 * 1 * 2 * T * T * 8)  # q k^T and probs v over every (query, key) pair
    assert counter.get_total_flops() == whole * (3 / 4 if T == CAUSAL_SPLIT_MIN else 11 / 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unfused_dropout_drops_in_training_only():
    q, k, v = _qkv()
    core = AttentionCore(0.5, causal=True, backend="unfused")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(core.eval()(q, k, v), ref, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    dropped = core.train()(q, k, v)
    assert (dropped - ref).abs().max() > 0.1


def test_unfused_in_bf16_returns_bf16_near_fp32():
    q, k, v = (x.detach().bfloat16() for x in _qkv())
    out = unfused_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)  # bf16 scores and probabilities


@pytest.mark.parametrize("choice,device,dtype,compiling,expected", [
    ("auto", "cpu", torch.bfloat16, True, "unfused"),
    ("auto", "cpu", torch.float16, True, "unfused"),
    ("auto", "cpu", torch.float32, True, "sdpa"),      # fp32: measured no faster (docs/PERFORMANCE.md)
    ("auto", "cpu", torch.bfloat16, False, "sdpa"),    # eager: nothing fuses the separate ops
    ("auto", "cuda", torch.bfloat16, True, "sdpa"),    # GPUs: the flash kernels
    ("sdpa", "cpu", torch.bfloat16, True, "sdpa"),
    ("unfused", "cuda", torch.float32, False, "unfused"),
])
def test_auto_picks_unfused_only_compiled_on_cpu_in_low_precision(choice, device, dtype, compiling, expected):
    assert attention_backend(choice, device, dtype, compiling) == expected


def _compiled_ops(core, *inputs, bf16):
    """The aten ops of the forward graph torch.compile traces for `core` (AOT autograd, no code generation)."""
    from torch._dynamo.backends.common import aot_autograd
    seen = set()

    def forward_compiler(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    torch._dynamo.reset()
    compiled = torch.compile(core, backend=aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        compiled(*inputs)
    torch._dynamo.reset()
    return seen


def test_auto_under_torch_compile_on_cpu():
    """Inside a compiled graph, bf16 takes the unfused matmuls and fp32 stays on SDPA's flash kernel."""
    q, k, v = _qkv()
    core = AttentionCore(0.0, causal=True, backend="auto")
    low = _compiled_ops(core, q.detach().bfloat16(), k.detach().bfloat16(), v.detach().bfloat16(), bf16=True)
    full = _compiled_ops(core, q, k, v, bf16=False)
    flash = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert flash not in low and "aten.bmm.default" in low, low
    assert flash in full and "aten.bmm.default" not in full, full


def _tiny_gpt(**kw):
    return GPTConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                     make_vocab_size_divisible_by=8, **kw)


def _pair(cfg):
    """The same weights built with sdpa and with unfused attention."""
    models = []
    for backend in ("sdpa", "unfused"):
        c = dataclasses.replace(cfg, attention_backend=backend)
        m = build_model(c)
        init_weights(m, c, 0)
        models.append(m)
    return models


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _outputs(models, *inputs, **kw):
    """Each model's output on `inputs`; sdpa's ran SDPA's kernels, unfused's never did."""
    outs, used = [], []
    for m in models:
        with _Ops() as ops:
            outs.append(m(*inputs, **kw))
        used.append(any("scaled_dot_product" in op for op in ops.seen))
    assert used == [True, False], used
    return outs


def _assert_same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", [dict(), dict(position_embedding="rope", num_query_groups=2, activation="swiglu")])
def test_gpt_trains_and_decodes_alike(variant):
    cfg = _tiny_gpt(**variant)
    sdpa, unfused = _pair(cfg)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = _outputs((sdpa, unfused), x[:, :-1], labels=x[:, 1:])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for loss in losses:
        loss.backward()
    _assert_same_grads(sdpa, unfused)
    with torch.no_grad():  # a prompt, then one token at a time through the KV cache
        outs = []
        for m in (sdpa.eval(), unfused.eval()):
            cache = KVCache(cfg.num_layers, 2, cfg.kv_heads, 16, cfg.head_dim)
            outs.append(torch.cat([m(x[:, :5], cache=cache, start=0)[:, -1:]]
                                  + [m(x[:, t:t + 1], cache=cache, start=t) for t in range(5, 9)], dim=1))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_bert_and_t5_alike():
    from megalm.models.bert.config import BertConfig
    from tiny_t5 import batch, tiny
    bert_cfg = BertConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                          vocab_size=64, make_vocab_size_divisible_by=8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 64, (2, 16), generator=g)
    padding = torch.ones_like(tokens)
    padding[0, 10:] = 0
    for cfg, inputs in ((bert_cfg, (tokens, torch.zeros_like(tokens), padding)),
                        (tiny(position_embedding="relative"), None)):
        if inputs is None:
            inputs = batch(cfg)
        sdpa, unfused = _pair(cfg)
        outs = _outputs((sdpa, unfused), *inputs)
        outs = [o if isinstance(o, tuple) else (o,) for o in outs]
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for o in outs:
            sum(t.float().square().mean() for t in o).backward()
        _assert_same_grads(sdpa, unfused)


def test_context_parallel_refuses_unfused():
    from megalm.errors import ConfigError
    from megalm.validation import validate
    from configs import load
    cfg = load("model=gpt_tiny", "data=mock", "parallel.cp=2", "model.attention_backend=unfused")
    with pytest.raises(ConfigError, match="model.attention_backend=unfused"):
        validate(cfg, 2)
    validate(load("model=gpt_tiny", "data=mock", "parallel.cp=2"), 2)  # auto: the ring's own kernel
