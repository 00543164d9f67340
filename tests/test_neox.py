"""The neox family (GPT-NeoX as Pythia uses it) against independent computations, through the commands.

- Hugging Face: a tiny random GPTNeoXForCausalLM (partial rotary, parallel or sequential residual, every
  tensor perturbed) imported with `python -m megalm.convert import` gives transformers' logits within 1e-4
  (fp32; measured ~2e-6), exports back bit for bit, and greedy decoding over megalm's KV cache gives
  transformers' 32 tokens. A wrong qkv regrouping, rotary share or residual form is off by far more.
- Layouts: neox_tiny (4 layers, 200 ids: 200 / 208 rows at tp 1 / 2) trained at tp2 with sequence
  parallelism, pp2, dp2 (plain and ZeRO-3 with selective recomputation) and cp2 on gloo ranks equals the
  single process within relative 1e-5 after each step. Packed examples attend and rotate as each alone.
- Commands: a trained neox_tiny run is served (OpenAI completions: greedy text as megalm's own generation,
  log-probabilities as transformers' on the exported weights), evaluated (`megalm.evaluate RUN perplexity`,
  in one process and at tp2, as transformers scores the text) and planned (`megalm.plan model=neox_tiny`).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from safetensors.torch import load_file

from megalm.convert import export_to_hf, model_config_from_hf
from megalm.convert.__main__ import main as convert_main
from megalm.convert.hf import read_model_config
from megalm.errors import ConfigError
from megalm.generate import generate_ids
from megalm.models import build_model
from megalm.training.checkpoint import load_model_weights
from megalm.validation import validate
from configs import load
from eval_reference import hf_logprobs
from layouts import losses, run_layouts
from server_process import start_server, stop_server

V, T, NEW = 99, 48, 32  # a vocabulary megalm pads (to 128), the context, tokens decoded greedily
KINDS = {  # a head of 16 channels, 4 of them rotating; a RoPE base and eps other than the defaults
    "parallel": dict(use_parallel_residual=True, hidden_act="gelu"),
    "sequential": dict(use_parallel_residual=False, hidden_act="gelu_new"),
}


def _hf_model(kind: str, folder: Path):
    """A random GPTNeoXForCausalLM saved to `folder`: every tensor drawn (norm gains about 1), so each matters."""
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=V,
        max_position_embeddings=T, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                    "partial_rotary_factor": 0.25},
        layer_norm_eps=1e-3, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, **KINDS[kind])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 and name.endswith("weight") else 0.2 * noise)
    model.save_pretrained(folder)
    return model


def _imported(kind: str, tmp_path: Path):
    """(transformers model, megalm model of its import, the import's folder)."""
    hf = _hf_model(kind, tmp_path / "hf")
    convert_main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--name", "imported"])
    cfg = read_model_config(tmp_path / "ckpt" / "config.yaml")
    model = build_model(cfg).eval()
    load_model_weights(tmp_path / "ckpt", model)
    return hf, model, tmp_path / "ckpt"


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_matches_transformers_and_export_is_bit_identical(tmp_path, kind):
    hf, model, ckpt = _imported(kind, tmp_path)
    assert (model.cfg.arch, model.cfg.rotary_dims, model.cfg.rotary_emb_base) == ("neox", 4, 500.0)
    assert model.cfg.use_parallel_residual == KINDS[kind]["use_parallel_residual"]
    tokens = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = hf(tokens).logits, model(tokens)
    assert got.shape[-1] == model.cfg.padded_vocab_size == 128
    assert (got[..., :V] - want).abs().max() < 1e-4
    assert want.std() > 0.5  # logits of size ~1: a dropped or mixed-up tensor moves them by far more than 1e-4

    back = export_to_hf(ckpt, tmp_path / "back")
    original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(back / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # The exported config.json describes the same model to transformers.
    again = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, want, atol=0, rtol=0)


def test_greedy_decoding_with_the_kv_cache_equals_transformers_generate(tmp_path):
    hf, model, _ = _imported("parallel", tmp_path)
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    hf.generation_config.eos_token_id = None  # decode all NEW tokens, as megalm does without an eod
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, 8:]
    cached = list(generate_ids(model, prompt, max_new_tokens=NEW, temperature=0, top_k=0, vocab_size=V))
    whole = list(generate_ids(model, prompt, max_new_tokens=NEW, temperature=0, top_k=0, vocab_size=V,
                              use_cache=False))
    assert cached == whole == want.tolist()
    assert len(set(cached)) > 4  # not one token repeated: the cache's positions matter


def test_pythia_config_json_imports_as_the_preset():
    """Pythia-70M's config.json as EleutherAI published it (transformers 4 names: rotary_pct, rotary_emb_base)."""
    published = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
                 "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
                 "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8,
                 "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
                 "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}
    kind, cfg = model_config_from_hf(published, "pythia_70m")
    assert kind == "gpt_neox" and cfg == load("model=pythia_70m").model


@pytest.mark.parametrize("override, message", [
    ("model.rotary_pct=0.1", "model.rotary_pct=0.1 of a head of 16 channels rotates 1"),
    ("model.activation=swiglu", "model.activation='swiglu': a NeoX MLP is ungated"),
    ("model.num_query_groups=2", "model.num_query_groups=2: NeoX gives every head its own keys and values"),
    ("model.normalization=rmsnorm", "model.normalization='rmsnorm': NeoX's norms are LayerNorms"),
])
def test_config_errors_name_the_value(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(load("model=neox_tiny", "data=mock", override), 1)


def test_packed_examples_are_each_computed_as_alone():
    """(position_ids, segment_ids) of packed examples (data=sft's packing; Family.optional_inputs): positions
    restart and attention stays inside each example."""
    model = build_model(load("model=neox_tiny").model).eval()
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    a, b = torch.randint(0, 8192, (1, 12)), torch.randint(0, 8192, (1, 20))
    positions = torch.cat([torch.arange(12), torch.arange(20)])[None]
    segments = torch.cat([torch.zeros(12), torch.ones(20)]).long()[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), positions, segments)
        alone = torch.cat([model(a), model(b)], dim=1)
    assert (packed - alone).abs().max() < 1e-5 and alone.std() > 0.5


STEPS = 4
BASE = ["model=neox_tiny", "model.num_layers=4", "model.vocab_size=200", "data=mock", "logging.curves=false",
        "trainer.micro_batch_size=2", "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}",
        "trainer.eval_steps=1", "trainer.eval_interval=0", "trainer.log_interval=1", "trainer.progress_bar=false",
        "trainer.num_threads=1", "optimizer.warmup_steps=1", "optimizer.lr=1e-2", "cluster.peak_flops=1e12",
        "checkpoint.save=false", "trainer.grad_clip=0.3", "parallel.bucket_size_mb=0.02"]
LAYOUTS = {
    "tp2_sp": ["parallel=tp2", "parallel.sequence_parallel=true"],
    "pp2_1f1b": ["parallel=pp2", "parallel.pipeline_schedule=1f1b"],
    "dp2": ["parallel=dp2"],
    "dp2_zero3_selective": ["parallel=dp2", "parallel.zero_stage=3", "parallel.recompute=selective"],
    "cp2": ["parallel.cp=2"],
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The single process's losses and each layout's run directory, the layouts on one set of 2 ranks."""
    from megalm.train import run
    single = tmp_path_factory.mktemp("neox_single")
    run(load(*BASE), single, 1)
    dirs = {name: tmp_path_factory.mktemp(f"neox_{name}") for name in LAYOUTS}
    run_layouts(2, [([*BASE, *LAYOUTS[name]], str(dirs[name])) for name in LAYOUTS], timeout=600.0 * len(LAYOUTS))
    return losses(single), dirs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_as_the_single_process(layout_runs, layout):
    (ref_train, ref_val), dirs = layout_runs
    train, val = losses(dirs[layout])
    assert len(train) == len(ref_train) == STEPS
    assert train == pytest.approx(ref_train, rel=1e-5)
    assert val == pytest.approx(ref_val, rel=1e-5)
    assert ref_val[-1] != ref_val[0]  # the steps changed the weights


@pytest.fixture(scope="module")
def neox_run(tmp_path_factory):
    """neox_tiny trained 30 steps on the stdlib with its own sentencepiece model: (run directory, transformers
    model of its exported weights in fp64, tokenizer)."""
    from megalm.data import load_tokenizer
    from megalm.train import run
    root = tmp_path_factory.mktemp("neox_run")
    run(load("model=neox_tiny", "model.vocab_size=1024", "data.max_corpus_mb=1", "data.split='90,10,0'",
             "data.tokenizer.vocab_size=1000", f"data.cache_dir={root / 'cache'}", "trainer.max_steps=30",
             "trainer.eval_interval=0", "trainer.eval_steps=1", "trainer.progress_bar=false", "optimizer.lr=3e-3",
             "cluster.peak_flops=1e12"), root / "run", 1)
    hf_dir = export_to_hf(root / "run", root / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval().double()
    return root / "run", hf, load_tokenizer(root / "run")


def test_served_completions_equal_generation_alone_and_transformers(neox_run):
    from megalm.generate import load_for_generation
    run_dir, hf, tok = neox_run
    _, model, _, _ = load_for_generation(run_dir)
    proc, url = start_server(run_dir)
    try:
        for prompt in ("import os\n", "def f(x):"):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                          "logprobs": 0}, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            context = [tok.eod] + tok.encode(prompt)
            ids = list(generate_ids(model, context, max_new_tokens=12, temperature=0, top_k=0,
                                    vocab_size=tok.vocab_size, eod=tok.eod))
            assert choice["text"] == tok.decode(context + ids)[len(tok.decode(context)):]
            ref = hf_logprobs(hf, context, ids)[0].tolist()
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref, abs=1e-4)
    finally:
        assert stop_server(proc) == 0


TEXT = ("Return the number of items in a container. The argument may be a sequence (such as a string, bytes, tuple, "
        "list, or range) or a collection.\n\ndef __init__(self, *args, **kwargs):\n    return len(self.items)\n")


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["one_process", "tp2"])
def test_evaluated_perplexity_equals_transformers(neox_run, tmp_path, layout):
    run_dir, hf, tok = neox_run
    (tmp_path / "text.txt").write_text(TEXT)
    written = run_dir / "eval" / "perplexity_text_stride16.json"
    written.unlink(missing_ok=True)  # the other layout's: this run must write its own
    r = subprocess.run([sys.executable, "-m", "megalm.evaluate", str(run_dir), "perplexity", "--data",
                        str(tmp_path / "text.txt"), "--stride", "16", *layout],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(written.read_text())
    ids = [tok.eod] + tok.encode(TEXT)
    seq = 32
    assert len(ids) > 2 * seq  # several windows, each token scored with the context the stride rule gives
    nll = -sum(float(hf_logprobs(hf, ids[max(0, math.ceil((t - seq) / 16)) * 16:t], [ids[t]])[0][0])
               for t in range(1, len(ids)))
    assert got["tokens"] == len(ids) - 1
    assert got["nll"] == pytest.approx(nll, rel=1e-5)


def test_planned():
    r = subprocess.run([sys.executable, "-m", "megalm.plan", "model=neox_tiny", "data=mock", "parallel=tp2",
                        "parallel.sequence_parallel=true", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    whole = sum(p.numel() for p in build_model(load("model=neox_tiny").model, "meta").parameters())
    h, layers = 64, 2
    replicated = layers * (4 * h + 2 * h) + 2 * h  # norms, and the row-parallel biases of attn.proj / mlp.fc2
    assert out["model"] == "neox_tiny" and [q["params"] for q in out["positions"]] == [(whole + replicated) // 2] * 2
    assert out["model_flops_per_step"] > 0
