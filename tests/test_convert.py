"""Hugging Face import / export (megalm.convert) gives the logits transformers computes.

Tiny random GPT2LMHeadModel / LlamaForCausalLM models are built from config objects here (no
downloads). Every weight, norm gains and biases included, is drawn at random so a mapping that
drops or mixes up a tensor changes the logits.

Tolerance: fp32 on both sides, the same math in a different order (one fused qkv matmul against
three, SDPA kernels, RMSNorm/rope written differently), so logits of size ~1 agree to ~1e-6;
we allow atol 1e-5, rtol 1e-5. A wrong mapping is off by more than 1 (measured on llama_gqa with
k/v, gate/up or a block's two norm gains swapped: 1.2 to 6 at logits of std 1.1).
"""

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file

from megalm.config import CheckpointConfig, ModelConfig, OptimizerConfig
from megalm.errors import ConfigError, DataError, MissingFileError
from megalm.convert import UnsupportedArchitecture, export_arch, export_to_hf, import_from_hf
from megalm.convert import locate_checkpoint, model_config_from_hf
from megalm.convert.__main__ import main
from megalm.convert.hf import read_model_config
from megalm.models import build_model, init_weights
from megalm.training.checkpoint import Checkpointer, load_model_weights
from megalm.training.optim import build_optimizer

TOL = dict(atol=1e-5, rtol=1e-5)
V, T = 99, 16  # a vocabulary megalm pads (to 104 or 128), and the context length


def _hf_config(kind):
    common = dict(vocab_size=V, bos_token_id=0, eos_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=T, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if kind == "gpt2_untied":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=T, n_inner=48,
                                       layer_norm_epsilon=1e-3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       tie_word_embeddings=False, **common)
    if kind == "llama_gqa":  # grouped-query attention, untied head, a non-default rope theta and eps
        return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=T,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                        rms_norm_eps=1e-5, tie_word_embeddings=False, **common)
    if kind == "mixtral":  # 4 experts, 2 a token, grouped-query attention
        return transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=24, max_position_embeddings=T,
                                          num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if kind == "llama_mqa_bias_tied":
        return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=1, intermediate_size=40, max_position_embeddings=T,
                                        attention_bias=True, mlp_bias=True, tie_word_embeddings=True, **common)
    raise KeyError(kind)


@torch.no_grad()
def _randomize(model, seed=0):
    """Every tensor random (norm gains around 1), so each one matters to the logits."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        gain = p.ndim == 1 and name.endswith("weight")
        p.copy_(1.0 + 0.1 * noise if gain else (0.1 if p.ndim == 1 else 0.2) * noise)


def _hf_model(kind, folder: Path, **save):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind), attn_implementation="eager").eval()
    _randomize(model)
    model.save_pretrained(folder, **save)
    return model


def _tokens(vocab=V, seed=1):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def _megalm_from(ckpt: Path, cfg: ModelConfig):
    model = build_model(cfg).eval()
    load_model_weights(ckpt, model)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "gpt2_untied", "llama_gqa", "llama_mqa_bias_tied", "mixtral"])
def test_import_matches_transformers_and_round_trips(tmp_path, kind):
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    sharded = kind == "llama_gqa"  # several files and an index json, as large models come
    hf = _hf_model(kind, hf_dir, **(dict(max_shard_size="20KB") if sharded else {}))
    assert (hf_dir / "model.safetensors.index.json").is_file() == sharded
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits

    out, cfg = import_from_hf(hf_dir, ckpt, name="imported")
    assert (ckpt / "latest").read_text().strip() == "step_00000000"
    # The model yaml the user passes to training describes the same model.
    assert read_model_config(ckpt / "conf" / "model" / "imported.yaml") == cfg
    assert read_model_config(ckpt / "config.yaml") == cfg
    if kind == "llama_gqa":
        assert (cfg.num_query_groups, cfg.rope_theta, cfg.tie_embeddings) == (2, 500000.0, False)
    if kind == "mixtral":
        assert (cfg.num_experts, cfg.moe_router_topk, cfg.rope_theta) == (4, 2, 1e6)
    model = _megalm_from(ckpt, cfg)
    with torch.no_grad():
        got = model(tokens)
    assert got.shape[-1] == cfg.padded_vocab_size > V
    torch.testing.assert_close(got[..., :V], want, **TOL)

    # Round trip: exporting the import gives back the same tensors, bit for bit, and config fields.
    export_to_hf(ckpt, back)
    original = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    again = load_file(back / "model.safetensors")
    assert sorted(again) == sorted(k for k in original if not k.endswith((".attn.bias", ".attn.masked_bias")))
    for key, value in again.items():
        assert torch.equal(value, original[key]), key
    a, b = json.loads((hf_dir / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("model_type", "vocab_size", "tie_word_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
                "layer_norm_epsilon", "hidden_size", "num_hidden_layers", "num_key_value_heads", "intermediate_size",
                "rms_norm_eps", "attention_bias", "mlp_bias", "max_position_embeddings"):
        if key in a:
            assert b[key] == a[key], key


def test_imported_optimizer_state_is_fresh(tmp_path):
    """checkpoint.load restores optimizer state too; the import's is exactly a new optimizer's."""
    _hf_model("llama_gqa", tmp_path / "hf")
    _, cfg = import_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = build_model(cfg)
    optim = build_optimizer(OptimizerConfig(), model)
    state = Checkpointer(CheckpointConfig(), tmp_path).load(tmp_path / "ckpt", model, optim)
    assert state["step"] == 0 and state["consumed_samples"] == 0
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
               for s in optim.state.values())


MEGALM_VARIANTS = {
    "gpt2": dict(),
    "gpt2_untied": dict(tie_embeddings=False, ffn_hidden_size=40, norm_eps=1e-3),
    "llama_gqa": dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", bias=False,
                      tie_embeddings=False, num_query_groups=2, rope_theta=5e5, norm_eps=1e-6),
    "llama_bias_tied": dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                            num_query_groups=1),
    "mixtral": dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", bias=False,
                    tie_embeddings=False, num_query_groups=2, num_experts=4, moe_router_topk=2, ffn_hidden_size=24),
}
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "gpt2_untied": "GPT2LMHeadModel", "llama_gqa": "LlamaForCausalLM",
              "llama_bias_tied": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def _save_run(run_dir: Path, cfg: ModelConfig, seed=3) -> Path:
    """A run directory as megalm.train leaves it: config.yaml and checkpoints/step_*/."""
    model = build_model(cfg)
    init_weights(model, cfg, seed)
    with torch.no_grad():  # init_weights sets norms to 1 and biases to 0: make them matter too
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    run_dir.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"model": OmegaConf.structured(cfg), "checkpoint": {"dir": "checkpoints"}}),
                   run_dir / "config.yaml")
    Checkpointer(CheckpointConfig(dir="checkpoints"), run_dir).save(
        5, model, build_optimizer(OptimizerConfig(), model), {"consumed_samples": 40})
    return model.eval()


@pytest.mark.parametrize("variant", MEGALM_VARIANTS)
def test_export_loads_in_transformers(tmp_path, tiny_model_cfg, variant):
    cfg = dataclasses.replace(tiny_model_cfg, name="exported", **MEGALM_VARIANTS[variant])
    model = _save_run(tmp_path / "run", cfg)
    out = export_to_hf(tmp_path / "run", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == HF_CLASSES[variant]
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens)[..., :cfg.vocab_size], **TOL)


def test_locate_run_dir_checkpoint_dir_and_step_folder(tmp_path, tiny_model_cfg):
    _save_run(tmp_path / "run", tiny_model_cfg)
    step = tmp_path / "run" / "checkpoints" / "step_00000005"
    for src in (tmp_path / "run", tmp_path / "run" / "checkpoints", step):
        found, cfg, run_dir = locate_checkpoint(src)
        assert (found, cfg, run_dir) == (step, tiny_model_cfg, tmp_path / "run")
    # A step folder moved away from its run needs --config.
    lone = tmp_path / "lone" / "a" / "step_00000005"
    lone.parent.mkdir(parents=True)
    step.rename(lone)
    with pytest.raises(MissingFileError, match="--config"):
        locate_checkpoint(lone)
    assert locate_checkpoint(lone, config=tmp_path / "run" / "config.yaml")[1] == tiny_model_cfg


@pytest.mark.parametrize("change,match", [
    (dict(position_embedding="rope"), r"model.normalization='layernorm'.*LlamaForCausalLM.*'rmsnorm'"),
    (dict(position_embedding="rope", normalization="rmsnorm"), r"model.activation='gelu'.*'swiglu'"),
    (dict(activation="swiglu"), r"model.activation='swiglu'.*GPT2LMHeadModel.*'gelu'"),
    (dict(bias=False), r"model.bias=False.*GPT2LMHeadModel.*True"),
    (dict(normalization="rmsnorm"), r"model.normalization='rmsnorm'.*'layernorm'"),
    (dict(num_query_groups=2), r"model.num_query_groups=2.*grouped-query.*null or 4"),
    (dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", bias=False, num_experts=4,
          moe_capacity_factor=1.0), r"model.moe_capacity_factor=1.0.*MixtralForCausalLM.*None"),
    (dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", bias=False, num_experts=4,
          moe_router_score_function="sigmoid"), r"model.moe_router_score_function='sigmoid'.*'softmax'"),
    (dict(num_experts=4), r"model.num_experts=4.*GPT2LMHeadModel.*Mixtral"),
])
def test_export_refuses_what_hf_cannot_represent(tiny_model_cfg, change, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        export_arch(dataclasses.replace(tiny_model_cfg, **change))


LLAMA_HF = dict(model_type="llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=48, vocab_size=V, max_position_embeddings=T)


@pytest.mark.parametrize("hf,match", [
    (dict(model_type="bart"), r"model_type='bart'.*allowed: 'gpt2'.*'llama'.*'bert' \(BertForPreTraining\).*'t5'"),
    (dict(model_type="bert", position_embedding_type="relative_key"), r"position_embedding_type='relative_key'"),
    (dict(LLAMA_HF, hidden_act="gelu"), r"hidden_act='gelu'.*allowed: 'silu'"),
    (dict(LLAMA_HF, rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope_type='llama3'.*'default'"),
    (dict(LLAMA_HF, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), r"rope_type='yarn'.*'default'"),
    (dict(LLAMA_HF, attention_bias=True), r"attention_bias=True with mlp_bias=False"),
    (dict(LLAMA_HF, head_dim=16), r"head_dim=16.*allowed: 8"),
    (dict(model_type="gpt2", n_embd=32, n_head=4, n_layer=2, n_positions=T, vocab_size=V, activation_function="gelu"),
     r"activation_function='gelu'.*'gelu_new'"),
])
def test_import_refuses_what_megalm_cannot_compute(hf, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        model_config_from_hf(hf, "x")
    assert issubclass(UnsupportedArchitecture, ConfigError) and issubclass(UnsupportedArchitecture, ValueError)


def test_missing_files_are_named(tmp_path, capsys):
    with pytest.raises(MissingFileError, match=r"config.json does not exist"):
        import_from_hf(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_HF))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(MissingFileError, match=r"no safetensors weights.*pytorch_model.bin are pickle files"):
        import_from_hf(tmp_path, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*empty"):
        export_to_hf(tmp_path / "empty", tmp_path / "hf")
    # The CLI turns these into one line on stderr naming the path, and exit code 1.
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path / "nowhere"), str(tmp_path / "hf")])
    assert e.value.code == 1
    assert capsys.readouterr().err.startswith(f"megalm.convert: not found: {tmp_path / 'nowhere'} does not exist")
    with pytest.raises(SystemExit) as e:
        main(["import", "--help"])
    assert e.value.code == 0 and "safetensors" in capsys.readouterr().out


@pytest.mark.parametrize("keep", [0.5, 8])  # the data cut short; the header itself cut short
def test_a_truncated_safetensors_file_is_named_by_the_cli(tmp_path, keep):
    import subprocess
    import sys
    _hf_model("gpt2", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])  # as an interrupted download
    r = subprocess.run([sys.executable, "-m", "megalm.convert", "import", str(tmp_path / "hf"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"megalm.convert: data: {weights} is not a readable safetensors file: "), first
    assert "truncated or damaged" in first and "download or save it again" in first
    assert not (tmp_path / "out" / "latest").exists()  # nothing half-written to start from


def test_cli_import_then_export(tmp_path, capsys):
    hf = _hf_model("llama_gqa", tmp_path / "hf")
    main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--name", "tiny"])
    printed = capsys.readouterr().out
    assert "model=tiny" in printed and "checkpoint.load=" in printed
    with pytest.raises(SystemExit) as e:  # never overwrites without --force
        main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    assert e.value.code == 1
    assert capsys.readouterr().err.startswith(f"megalm.convert: output exists: {tmp_path / 'ckpt'} is not empty")
    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "bfloat16"])
    (tmp_path / "back" / "tokenizer.model").write_bytes(b"an earlier export's tokenizer")
    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "bfloat16", "--force"])
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["config.json", "model.safetensors"]  # none stale
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tokens = _tokens()
    with torch.no_grad():
        got, want, want_rounded = again(tokens).logits, hf(tokens).logits, rounded(tokens).logits
    # The bf16 export is each weight rounded to bf16, nothing else: it computes what the original
    # computes with every weight rounded the same way, to fp32 tolerance (measured 3e-6).
    torch.testing.assert_close(got, want_rounded, **TOL)
    # Against the original fp32 logits: bf16 keeps 8 significant bits, so rounding moves each
    # weight by at most u = 2^-9 relative; through 2 blocks of these random (untrained) weights,
    # about 20 rounded matrices compound that to ~5 u of the logits' norm (measured 0.96%, max
    # 0.06 at logits of std 1.1). We allow 8 u = 1.6%. A wrong mapping (k/v or gate/up swapped,
    # the two norm gains of a block exchanged, q heads permuted) is off by 16% to 140%.
    assert ((got - want).norm() / want.norm()).item() < 8 * 2.0 ** -9


def _compose(overrides, model_yaml):
    """The run config, with the model the import wrote (as --config-dir DIR model=NAME gives)."""
    from hydra import compose, initialize_config_dir

    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=list(overrides)))
    cfg.model = read_model_config(Path(model_yaml))
    return cfg


def _train(rank, world, overrides, run_dir, model_yaml):
    """megalm.train.run on one rank."""
    from megalm.train import run
    from megalm.validation import validate
    cfg = _compose(overrides, model_yaml)
    validate(cfg, world)
    return run(cfg, Path(run_dir), world)


def _val_losses(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in recs if "val_loss" in r]


def test_train_from_import_at_tp2_then_export_that_checkpoint(tmp_path):
    """checkpoint.load of an import at tp2 starts from the Hugging Face model itself (its loss on
    the run's validation tokens), trains as one process does, and the checkpoint written by the
    2-rank run exports to the model that megalm loads from it."""
    import torch.nn.functional as F

    from distributed import run_ranks
    from megalm.data import build_data
    hf = _hf_model("llama_gqa", tmp_path / "hf")
    ckpt, _ = import_from_hf(tmp_path / "hf", tmp_path / "ckpt", name="tiny")
    overrides = ["data=mock", "trainer.max_steps=1", "trainer.micro_batch_size=2", "trainer.global_batch_size=2",
                 "trainer.eval_steps=1", "trainer.eval_interval=0", "trainer.progress_bar=false",
                 "trainer.num_threads=1", "cluster.peak_flops=1e12", f"data.tokenizer.vocab_size={V}",
                 f"checkpoint.load={ckpt}"]
    yaml = str(ckpt / "conf" / "model" / "tiny.yaml")
    _train(0, 1, overrides, tmp_path / "single", yaml)
    run_ranks(2, _train, [*overrides, "parallel=tp2"], str(tmp_path / "tp2"), yaml)
    single, tp2 = _val_losses(tmp_path / "single"), _val_losses(tmp_path / "tp2")
    assert tp2 == pytest.approx(single, rel=1e-5) and len(tp2) == 2  # before and after the step
    # The loss before the step is the original HF model's on the same validation micro-batch:
    # the import was loaded (a fresh init would give about log V = 4.6, this model ~5.5).
    cfg = _compose(overrides, yaml)
    valid = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=cfg.trainer.seed).valid
    batch = torch.from_numpy(np.stack([valid[i] for i in range(2)]))
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert tp2[0] == pytest.approx(hf_loss, rel=1e-5) and single[0] == pytest.approx(hf_loss, rel=1e-5)

    out = export_to_hf(tmp_path / "tp2", tmp_path / "hf_after")
    step, cfg, _ = locate_checkpoint(tmp_path / "tp2")
    assert step.name == "step_00000001"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, _megalm_from(step, cfg)(tokens)[..., :V], **TOL)


def test_export_copies_a_hugging_face_tokenizer(tmp_path, tiny_model_cfg):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megalm.data.tokenizers.huggingface import HuggingFaceTokenizer
    words = ["<|endoftext|>", "[UNK]", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    _save_run(tmp_path / "run", tiny_model_cfg)
    HuggingFaceTokenizer(tmp_path / "tok.json").save_to(tmp_path / "run")
    out = export_to_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("hello world")["input_ids"] == [2, 3] and hf_tok.eos_token == "<|endoftext|>"


def test_import_refuses_weights_that_do_not_fit_the_config(tmp_path):
    _hf_model("gpt2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_layer=1)))
    with pytest.raises(DataError, match=r"tensors have no megalm counterpart.*transformer\.h\.1\."):
        import_from_hf(tmp_path, tmp_path / "a")
    (tmp_path / "config.json").write_text(json.dumps(dict(config, vocab_size=V + 1)))
    with pytest.raises(DataError, match=r"transformer.wte.weight gives shape \(99, 32\).*implies \(100, 32\)"):
        import_from_hf(tmp_path, tmp_path / "b")
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_layer=3)))
    with pytest.raises(DataError, match=r"lack transformer.h.2.ln_1.weight"):
        import_from_hf(tmp_path, tmp_path / "c")


# -- BERT: BertForPreTraining, post-LN ----------------------------------------------------------

def _bert_batch(seed=2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, T), generator=g)
    types = torch.randint(0, 2, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 11:] = 0  # padding in the second sample: the key mask matters
    return tokens, types, mask


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_bert_import_matches_transformers_and_round_trips(tmp_path, hidden_act):
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=T, type_vocab_size=2,
                                     hidden_act=hidden_act, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    hf = transformers.BertForPreTraining(config).eval()
    _randomize(hf)
    hf.save_pretrained(hf_dir)
    tokens, types, mask = _bert_batch()
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask)

    out, cfg = import_from_hf(hf_dir, ckpt, name="bert_imported")
    assert (cfg.arch, cfg.norm_position, cfg.activation) == ("bert", "post", {"gelu": "gelu_exact"}.get(hidden_act, "gelu"))
    model = _megalm_from(ckpt / "step_00000000", cfg)
    with torch.no_grad():
        logits, order = model(tokens, types, mask)
    real = mask.bool()  # HF computes the padded positions too; they mean nothing
    torch.testing.assert_close(logits[..., :V][real], want.prediction_logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(order, want.seq_relationship_logits, rtol=1e-4, atol=1e-4)

    # And back: the export loads in transformers and gives the same logits.
    export_to_hf(ckpt, back, config=ckpt / "config.yaml")
    again = transformers.BertForPreTraining.from_pretrained(back).eval()
    with torch.no_grad():
        got = again(input_ids=tokens, token_type_ids=types, attention_mask=mask)
    torch.testing.assert_close(got.prediction_logits[real], want.prediction_logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.seq_relationship_logits, want.seq_relationship_logits, rtol=1e-5, atol=1e-5)


def test_bert_export_refuses_the_pre_ln_layout():
    from megalm.models.bert.config import BertConfig
    cfg = BertConfig(name="b", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=T, vocab_size=V)
    with pytest.raises(UnsupportedArchitecture, match=r"model.norm_position='pre' cannot be represented as "
                                                      r"BertForPreTraining.*allowed: 'post'"):
        export_arch(cfg)


# -- T5: T5ForConditionalGeneration ----------------------------------------------------------------
def _t5_batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 9:] = 0  # padding in the second sample: the encoder's key mask matters
    decoder = torch.randint(0, V, (2, 7), generator=g)
    return tokens, mask, decoder


@pytest.mark.parametrize("proj,tied", [("relu", True), ("gated-silu", False), ("gelu", True)])
def test_t5_import_matches_transformers_and_round_trips(tmp_path, proj, tied):
    """Random weights (every tensor matters); tie_word_embeddings true is the original T5's scaled
    output (imported as an untied megalm head), false v1.1's unscaled one."""
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, feed_forward_proj=proj, tie_word_embeddings=tied)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    _randomize(hf)
    hf.save_pretrained(hf_dir)
    tokens, mask, decoder = _t5_batch()
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=mask, decoder_input_ids=decoder).logits

    out, cfg = import_from_hf(hf_dir, ckpt, name="t5_imported", seq_length=T)
    assert (cfg.arch, cfg.encoder_layers, cfg.decoder_layers, cfg.tie_embeddings) == ("t5", 2, 3, not tied)
    model = _megalm_from(ckpt / "step_00000000", cfg)
    with torch.no_grad():
        logits = model(tokens, mask, decoder)
    torch.testing.assert_close(logits[..., :V], want, rtol=1e-4, atol=1e-4)

    if tied:  # an untied megalm head (the scaled output) is what transformers cannot hold: refused, named
        with pytest.raises(UnsupportedArchitecture, match="model.tie_embeddings=False"):
            export_to_hf(ckpt, back, config=ckpt / "config.yaml")
        return
    export_to_hf(ckpt, back, config=ckpt / "config.yaml")
    again = transformers.T5ForConditionalGeneration.from_pretrained(back).eval()
    with torch.no_grad():
        got = again(input_ids=tokens, attention_mask=mask, decoder_input_ids=decoder).logits
    # Not bitwise: the queries went through x sqrt(d_kv) and back (sqrt(8) rounds in float32).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_t5_trained_by_megalm_exports_with_its_logits(tmp_path):
    """A megalm T5 in Hugging Face's layout (relative buckets, RMSNorm, no biases), its weights drawn by
    megalm: the export gives transformers the same logits."""
    from megalm.models.t5.config import T5Config
    cfg = T5Config(name="t5_hf", num_layers=5, encoder_num_layers=3, hidden_size=32, num_attention_heads=4,
                   seq_length=T, decoder_seq_length=8, vocab_size=V, make_vocab_size_divisible_by=8,
                   position_embedding="relative", normalization="rmsnorm", bias=False, head_bias=False,
                   activation="swiglu", relative_attention_num_buckets=8, relative_attention_max_distance=20)
    model = build_model(cfg)
    init_weights(model, cfg, seed=4)
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1.0 + 0.2 * torch.rand(p.shape))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"model": OmegaConf.structured(cfg)})))
    Checkpointer(CheckpointConfig(dir=str(run / "checkpoints")), run).save(0, model, build_optimizer(OptimizerConfig(), model), {})
    out = export_to_hf(run, tmp_path / "hf", copy_tokenizer=False)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    tokens, mask, decoder = _t5_batch()
    with torch.no_grad():
        want = model.eval()(tokens, mask, decoder)[..., :V]
        got = hf(input_ids=tokens, attention_mask=mask, decoder_input_ids=decoder).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_t5_export_refuses_megatrons_layout():
    from megalm.models.t5.config import T5Config
    cfg = T5Config(name="t", num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=T, vocab_size=V)
    with pytest.raises(UnsupportedArchitecture, match=r"model.position_embedding='learned' cannot be represented as "
                                                      r"T5ForConditionalGeneration.*allowed: 'relative'"):
        export_arch(cfg)
