"""megalm checkpoints <-> Hugging Face folders (config.json + safetensors).

Two Hugging Face architectures are exactly what megalm's model computes:

    GPT2LMHeadModel   learned positions + LayerNorm (with bias) + GELU (tanh) + biases everywhere
    LlamaForCausalLM  RoPE (rotate-half) + RMSNorm + SwiGLU + GQA, biases optional

Anything else (a mix such as rope + layernorm, GQA in GPT-2, rope scaling, a head_dim that is
not hidden / heads, ...) is refused with an error naming the field, its value and what is
allowed, because the converted model would compute something else.

Weight layouts (an nn.Linear weight is (out, in); h hidden, nh / nkv query / key-value heads,
hd head dim, f MLP width, V vocabulary):

    megalm (models/layers.py)
      blocks.{i}.attn.qkv.weight  ((nh + 2 nkv) hd, h)  rows [q | k | v], each head's hd rows together
      blocks.{i}.mlp.fc1.weight   gelu: (f, h); swiglu: (2 f, h) rows [gate | up]
      embed.tok.weight, head.weight  (V, h); a checkpoint holds the real vocab_size rows, a model
                                     in memory is padded (padded_vocab) with rows that are never used
    GPT-2
      Conv1D layers store their weight as (in, out), the transpose of nn.Linear; c_attn's output
      columns are [q | k | v] with nkv = nh, the megalm layout once transposed.
    Llama
      separate q_proj (nh hd, h), k_proj / v_proj (nkv hd, h), o_proj; gate_proj, up_proj,
      down_proj. HF's q/k rows are already in the rotate-half order of megalm's apply_rope
      (channel pairs (j, j + hd/2)), so no permutation: qkv is q, k, v stacked; fc1 is gate, up.

The mapping is one table per architecture (GPT2_RULES, LLAMA_RULES): each Rule joins some HF
tensors into one megalm tensor (import) and splits it back (export). Which rules apply is
decided by the megalm model built from the config: its parameters are what must be filled
(no bias rules when bias=false, no position table for rope, no head when tied), and every HF
tensor must be used by some rule or be a known buffer, so nothing is silently dropped.

Import writes a checkpoint through megalm's own Checkpointer (single process), so training can
start from it with `checkpoint.load=PATH` at any parallel layout; checkpoints hold full tensors.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from megalm.config import ModelConfig
from megalm.errors import ConfigError, DataError, MegalmError, MissingFileError

log = logging.getLogger("megalm.convert")

Tensor = torch.Tensor
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARCHS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
OPTIMIZER_STATE_NOTE = ("The checkpoint holds a fresh optimizer state (zero moments, step 0), which "
                        "checkpoint.load needs: training starts exactly as from these weights. checkpoint.load "
                        "also restores the optimizer's hyperparameters other than lr (weight_decay, betas, eps, "
                        "momentum) from it, so import with the optimizer preset you will train with")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise MissingPackage("megalm.convert reads and writes Hugging Face weights with the `safetensors` "
                             "package: pip install safetensors") from None
    return safetensors


class UnsupportedArchitecture(ConfigError):
    """A megalm config or HF config.json that the other side cannot represent exactly."""


class OutputExistsError(MegalmError, FileExistsError):
    """The folder to write already holds files (or is a file), and --force was not given."""

    kind = "output exists"


class MissingPackage(MegalmError, ImportError):
    """An optional package that this conversion needs is not installed."""

    kind = "missing package"


# -- transforms: megalm tensor <-> HF tensors ----------------------------------------------------

@dataclass(frozen=True)
class Transform:
    """split: megalm tensor → the HF tensors of a rule; join: the inverse."""
    split: Callable[[Tensor, ModelConfig], List[Tensor]]
    join: Callable[[List[Tensor], ModelConfig], Tensor]


SAME = Transform(lambda t, c: [t], lambda ts, c: ts[0])
# GPT-2's Conv1D keeps (in, out); nn.Linear keeps (out, in).
CONV1D = Transform(lambda t, c: [t.t()], lambda ts, c: ts[0].t())


def _rows(sizes: Callable[[ModelConfig], List[int]]) -> Transform:
    """Stacked along dim 0 (weights and biases alike): split into / concatenate from parts of `sizes`."""
    return Transform(lambda t, c: list(torch.split(t, sizes(c), dim=0)), lambda ts, c: torch.cat(ts, dim=0))


QKV = _rows(lambda c: [c.num_attention_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim])
GATE_UP = _rows(lambda c: [c.ffn_size, c.ffn_size])


@dataclass(frozen=True)
class Rule:
    megalm: str  # parameter name, "{i}" = layer index
    hf: Tuple[str, ...]  # HF tensor names, in the order the transform splits / joins them
    transform: Transform = SAME


def _gpt2_rules() -> List[Rule]:
    h = "transformer.h.{i}."
    return [
        Rule("embed.tok.weight", ("transformer.wte.weight",)),
        Rule("embed.pos.weight", ("transformer.wpe.weight",)),
        Rule("blocks.{i}.norm1.weight", (h + "ln_1.weight",)),
        Rule("blocks.{i}.norm1.bias", (h + "ln_1.bias",)),
        Rule("blocks.{i}.attn.qkv.weight", (h + "attn.c_attn.weight",), CONV1D),
        Rule("blocks.{i}.attn.qkv.bias", (h + "attn.c_attn.bias",)),
        Rule("blocks.{i}.attn.proj.weight", (h + "attn.c_proj.weight",), CONV1D),
        Rule("blocks.{i}.attn.proj.bias", (h + "attn.c_proj.bias",)),
        Rule("blocks.{i}.norm2.weight", (h + "ln_2.weight",)),
        Rule("blocks.{i}.norm2.bias", (h + "ln_2.bias",)),
        Rule("blocks.{i}.mlp.fc1.weight", (h + "mlp.c_fc.weight",), CONV1D),
        Rule("blocks.{i}.mlp.fc1.bias", (h + "mlp.c_fc.bias",)),
        Rule("blocks.{i}.mlp.fc2.weight", (h + "mlp.c_proj.weight",), CONV1D),
        Rule("blocks.{i}.mlp.fc2.bias", (h + "mlp.c_proj.bias",)),
        Rule("norm.weight", ("transformer.ln_f.weight",)),
        Rule("norm.bias", ("transformer.ln_f.bias",)),
        Rule("head.weight", ("lm_head.weight",)),  # only when untied
    ]


def _llama_rules() -> List[Rule]:
    h = "model.layers.{i}."
    a, m = h + "self_attn.", h + "mlp."
    return [
        Rule("embed.tok.weight", ("model.embed_tokens.weight",)),
        Rule("blocks.{i}.norm1.weight", (h + "input_layernorm.weight",)),
        Rule("blocks.{i}.attn.qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), QKV),
        Rule("blocks.{i}.attn.qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), QKV),
        Rule("blocks.{i}.attn.proj.weight", (a + "o_proj.weight",)),
        Rule("blocks.{i}.attn.proj.bias", (a + "o_proj.bias",)),
        Rule("blocks.{i}.norm2.weight", (h + "post_attention_layernorm.weight",)),
        Rule("blocks.{i}.mlp.fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), GATE_UP),
        Rule("blocks.{i}.mlp.fc1.bias", (m + "gate_proj.bias", m + "up_proj.bias"), GATE_UP),
        Rule("blocks.{i}.mlp.fc2.weight", (m + "down_proj.weight",)),
        Rule("blocks.{i}.mlp.fc2.bias", (m + "down_proj.bias",)),
        Rule("norm.weight", ("model.norm.weight",)),
        Rule("head.weight", ("lm_head.weight",)),  # only when untied
    ]


GPT2_RULES = _gpt2_rules()
LLAMA_RULES = _llama_rules()
RULES = {"gpt2": GPT2_RULES, "llama": LLAMA_RULES}
# HF tensors that are not weights: GPT-2's causal-mask buffers, old Llama rotary tables.
IGNORED_HF = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


def expand_rules(arch: str, cfg: ModelConfig) -> Dict[str, Rule]:
    """megalm parameter name → its rule with "{i}" filled in, for every layer of cfg."""
    out: Dict[str, Rule] = {}
    for rule in RULES[arch]:
        for i in range(cfg.num_layers) if "{i}" in rule.megalm else [0]:
            name = rule.megalm.format(i=i)
            out[name] = Rule(name, tuple(n.format(i=i) for n in rule.hf), rule.transform)
    return out


# -- configs ---------------------------------------------------------------------------------------

def _unsupported(field: str, value: Any, target: str, allowed: str, why: str = "") -> UnsupportedArchitecture:
    return UnsupportedArchitecture(f"{field}={value!r} cannot be represented as {target}{why}: allowed: {allowed}")


def export_arch(cfg: ModelConfig) -> str:
    """The HF architecture ("gpt2" | "llama") that computes exactly what cfg does; else an error."""
    if cfg.position_embedding == "learned":
        arch, target = "gpt2", "GPT2LMHeadModel"
        why = " (chosen by model.position_embedding='learned')"
        need = {"model.normalization": (cfg.normalization, ("layernorm",)),
                "model.activation": (cfg.activation, ("gelu",)),
                "model.bias": (cfg.bias, (True,))}
    elif cfg.position_embedding == "rope":
        arch, target = "llama", "LlamaForCausalLM"
        why = " (chosen by model.position_embedding='rope')"
        need = {"model.normalization": (cfg.normalization, ("rmsnorm",)),
                "model.activation": (cfg.activation, ("swiglu",))}
    else:
        raise _unsupported("model.position_embedding", cfg.position_embedding, "a Hugging Face model",
                           "'learned' (GPT-2) or 'rope' (Llama)")
    for field, (value, allowed) in need.items():
        if value not in allowed:
            raise _unsupported(field, value, target, " or ".join(repr(a) for a in allowed),
                               why + "; Hugging Face has GPT-2 = learned + layernorm + gelu + bias and "
                               "Llama = rope + rmsnorm + swiglu")
    if arch == "gpt2" and cfg.kv_heads != cfg.num_attention_heads:
        raise _unsupported("model.num_query_groups", cfg.num_query_groups, target,
                           f"null or {cfg.num_attention_heads} (= num_attention_heads)",
                           ": GPT-2 has no grouped-query attention")
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise _unsupported("model.hidden_size", cfg.hidden_size, target,
                           f"a multiple of num_attention_heads={cfg.num_attention_heads}")
    return arch


def hf_config(cfg: ModelConfig, arch: str, dtype: str = "float32", eod: Optional[int] = None) -> Dict[str, Any]:
    """The config.json of cfg as HF architecture `arch` (from export_arch)."""
    common = {"architectures": [ARCHS[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
              "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
              "bos_token_id": eod, "eos_token_id": eod, "use_cache": True, "dtype": dtype}
    if arch == "gpt2":
        return dict(common, n_positions=cfg.seq_length, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                    n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size, activation_function="gelu_new",
                    resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout,
                    layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    if cfg.dropout:
        log.warning("model.dropout=%g has no LlamaForCausalLM field (it only has attention_dropout); "
                    "the exported config has no hidden dropout (inference is unaffected)", cfg.dropout)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    # rope_theta + rope_scaling for transformers 4.x, rope_parameters for 5.x.
    return dict(common, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                rope_scaling=None, rope_parameters=rope, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                attention_dropout=cfg.attention_dropout, pretraining_tp=1)


def _get(hf: Dict[str, Any], key: str, default: Any = ..., *, source: str = "config.json") -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise DataError(f"{source} has no {key!r}, which a {hf.get('model_type')} config needs")
    return default


def _check(hf: Dict[str, Any], key: str, default: Any, allowed: Sequence[Any], why: str = "") -> Any:
    value = hf.get(key, default)
    if value not in allowed:
        arch = hf.get("model_type")
        raise UnsupportedArchitecture(
            f"config.json: {key}={value!r} ({arch}) has no exact megalm equivalent{why}: allowed: "
            + ", ".join(repr(a) for a in allowed))
    return value


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> Tuple[str, ModelConfig]:
    """(arch, ModelConfig) of an HF config.json dict; an error for what megalm cannot compute."""
    kind = hf.get("model_type")
    if kind not in ARCHS:
        raise UnsupportedArchitecture(f"config.json: model_type={kind!r} is not supported: allowed: "
                                      + ", ".join(f"{k!r} ({v})" for k, v in ARCHS.items()))
    if kind == "gpt2":
        _check(hf, "activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh"),
               " (megalm's gelu is the tanh approximation)")
        _check(hf, "scale_attn_weights", True, (True,))
        _check(hf, "scale_attn_by_inverse_layer_idx", False, (False,))
        _check(hf, "add_cross_attention", False, (False,))
        h = _get(hf, "n_embd")
        cfg = ModelConfig(
            name=name, num_layers=_get(hf, "n_layer"), hidden_size=h, num_attention_heads=_get(hf, "n_head"),
            ffn_hidden_size=_get(hf, "n_inner", None), seq_length=_get(hf, "n_positions"),
            vocab_size=_get(hf, "vocab_size"), position_embedding="learned", normalization="layernorm",
            norm_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)), activation="gelu", bias=True,
            tie_embeddings=bool(_get(hf, "tie_word_embeddings", True)), dropout=float(_get(hf, "resid_pdrop", 0.0)),
            attention_dropout=float(_get(hf, "attn_pdrop", 0.0)), init_std=float(_get(hf, "initializer_range", 0.02)))
        if seq_length is not None and seq_length != cfg.seq_length:
            raise ConfigError(f"--seq-length={seq_length}: GPT-2 has learned positions, so seq_length is "
                              f"n_positions={cfg.seq_length} from config.json; allowed: {cfg.seq_length}")
    else:
        _check(hf, "hidden_act", "silu", ("silu",), " (megalm's swiglu gates with silu)")
        # transformers 5 keeps rope settings in rope_parameters, 4.x in rope_theta + rope_scaling.
        for key in ("rope_parameters", "rope_scaling"):
            rope = hf.get(key) or {}
            rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
            if rope_type != "default":
                raise UnsupportedArchitecture(f"config.json: {key} has rope_type={rope_type!r} (rope scaling), which "
                                              "has no megalm equivalent: allowed: 'default' (plain RoPE)")
        theta = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
        attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise UnsupportedArchitecture(
                f"config.json: attention_bias={attn_bias} with mlp_bias={mlp_bias}: megalm has one model.bias "
                "for every linear layer: allowed: both true or both false")
        h, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
        if h % heads:
            raise UnsupportedArchitecture(f"config.json: hidden_size={h} is not divisible by num_attention_heads={heads}")
        _check(hf, "head_dim", h // heads, (h // heads,), " (megalm's head dim is hidden_size / num_attention_heads)")
        kv = _get(hf, "num_key_value_heads", heads)
        cfg = ModelConfig(
            name=name, num_layers=_get(hf, "num_hidden_layers"), hidden_size=h, num_attention_heads=heads,
            num_query_groups=kv if kv != heads else None, ffn_hidden_size=_get(hf, "intermediate_size"),
            seq_length=seq_length or _get(hf, "max_position_embeddings"), vocab_size=_get(hf, "vocab_size"),
            position_embedding="rope", rope_theta=theta, normalization="rmsnorm",
            norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)), activation="swiglu", bias=attn_bias,
            tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
            attention_dropout=float(_get(hf, "attention_dropout", 0.0)),
            init_std=float(_get(hf, "initializer_range", 0.02)))
    return kind, cfg


def read_model_config(path: Path) -> ModelConfig:
    """A ModelConfig from a run's config.yaml (its `model:` section) or from a model yaml."""
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in several types
        raise ConfigError(f"{path} is not a YAML config: {e}") from None
    section = raw.get("model") if isinstance(raw, DictConfig) and isinstance(raw.get("model"), DictConfig) else raw
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), section)
        return OmegaConf.to_object(merged)
    except Exception as e:  # unknown keys, wrong types, missing values
        raise ConfigError(f"{path}: not a megalm model config (a run's config.yaml or a conf/model yaml): "
                          f"{e}") from None


def model_yaml(cfg: ModelConfig, header: str) -> str:
    body = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


# -- export ---------------------------------------------------------------------------------------

def locate_checkpoint(path: Path, config: Optional[Path] = None) -> Tuple[Path, ModelConfig, Optional[Path]]:
    """(step folder, model config, directory holding config.yaml) for a run dir, checkpoint dir or step folder."""
    from megalm.training.checkpoint import resolve
    path = Path(path).expanduser()
    what = "a megalm run directory (config.yaml + checkpoints/), a checkpoint dir (with `latest`) or a step folder"
    if not path.exists():
        raise MissingFileError(f"{path} does not exist: expected {what}")
    is_ckpt = (path / ".metadata").exists() or (path / "latest").exists()
    if (path / "config.yaml").is_file() and not is_ckpt:  # a run directory
        raw = OmegaConf.load(path / "config.yaml")
        ckpt = Path(str(OmegaConf.select(raw, "checkpoint.dir", default="checkpoints"))).expanduser()
        ckpt = ckpt if ckpt.is_absolute() else path / ckpt
        try:
            step_dir = resolve(ckpt)
        except FileNotFoundError as e:
            raise MissingFileError(f"run directory {path} has no complete checkpoint: {e}") from None
        config_file: Optional[Path] = path / "config.yaml"
    else:
        try:
            step_dir = resolve(path)
        except FileNotFoundError as e:
            raise MissingFileError(f"{e}; expected {what}") from None
        # The run directory's first (its tokenizer lies next to it), then the step folder's own copy.
        looked = [step_dir.parent / "config.yaml", step_dir.parent.parent / "config.yaml", step_dir / "config.yaml"]
        config_file = next((c for c in looked if c.is_file()), None)
        if config_file is None and config is None:
            raise MissingFileError(f"no config.yaml for checkpoint {step_dir} (looked for "
                                   f"{', '.join(map(str, looked))}): pass --config with the run's config.yaml or a model yaml")
    if config is not None:
        config = Path(config).expanduser()
        if not config.is_file():
            raise MissingFileError(f"--config {config} does not exist: expected a run's config.yaml or a model yaml")
        return step_dir, read_model_config(config), config_file.parent if config_file else None
    return step_dir, read_model_config(config_file), config_file.parent


def _run_tokenizer(run_dir: Optional[Path]):
    if run_dir is None or not (run_dir / "tokenizer.json").is_file():
        return None
    try:
        from megalm.data import load_tokenizer
        return load_tokenizer(run_dir)
    except Exception as e:  # a tokenizer is a nice-to-have: the weights do not depend on it
        log.warning("not copying the tokenizer of %s: %s", run_dir, e)
        return None


def _copy_tokenizer(tok, run_dir: Path, out: Path) -> Optional[str]:
    """Put the run's tokenizer next to the HF weights; return what was written."""
    eod_token = getattr(tok, "eod_token", None)
    if eod_token is not None:  # a Hugging Face tokenizer.json: loadable with AutoTokenizer
        shutil.copyfile(run_dir / "tokenizer.json", out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token, "bos_token": eod_token,
             "model_max_length": None, "add_bos_token": False}, indent=1) + "\n")
        return "tokenizer.json, tokenizer_config.json"
    if (run_dir / "tokenizer.model").is_file():  # sentencepiece: the model file, for the user to wrap
        shutil.copyfile(run_dir / "tokenizer.model", out / "tokenizer.model")
        return "tokenizer.model (sentencepiece)"
    return None


def _check_out_dir(out: Path, force: bool, marker: Iterable[str]) -> None:
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory: name a folder to write")
    if not force and out.is_dir() and any(out.iterdir()):
        present = [m for m in marker if (out / m).exists()] or sorted(p.name for p in out.iterdir())[:3]
        raise OutputExistsError(f"{out} is not empty (it has {', '.join(present)}): pass --force to write into it")


@torch.no_grad()
def export_to_hf(src: Path, out_dir: Path, *, config: Optional[Path] = None, dtype: str = "float32",
                 force: bool = False, copy_tokenizer: bool = True) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors) for a megalm checkpoint."""
    save_file = _safetensors().torch.save_file
    from megalm.models import build_model, family_of
    from megalm.training.checkpoint import STATE_FILE, load_model_weights
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    step_dir, cfg, run_dir = locate_checkpoint(src, config)
    arch = export_arch(cfg)
    out = Path(out_dir).expanduser()
    _check_out_dir(out, force, ("config.json", "model.safetensors"))
    model = build_model(cfg)
    load_model_weights(step_dir, model)
    params = dict(model.named_parameters())  # tied weights appear once, as embed.tok.weight
    rules = expand_rules(arch, cfg)
    tensors: Dict[str, Tensor] = {}
    for name, p in params.items():
        if name not in rules:
            raise RuntimeError(f"no {arch} rule for megalm parameter {name}")  # a bug in the tables
        rule = rules[name]
        t = p.detach()[:cfg.vocab_size] if name in family_of(cfg.arch).vocab_params else p.detach()
        for hf_name, part in zip(rule.hf, rule.transform.split(t, cfg), strict=True):
            # A copy of its own: safetensors refuses tensors that share storage (split views).
            tensors[hf_name] = part.to(dtype=DTYPES[dtype], copy=True).contiguous()
    tok = _run_tokenizer(run_dir) if copy_tokenizer else None
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_config(cfg, arch, dtype, eod=tok.eod if tok is not None and tok.eod < cfg.vocab_size else None)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    copied = _copy_tokenizer(tok, run_dir, out) if tok is not None else None
    step = json.loads((step_dir / STATE_FILE).read_text()).get("step") if (step_dir / STATE_FILE).is_file() else None
    log.info("exported %s (step %s) as %s to %s%s", step_dir, step, ARCHS[arch], out,
             f" with {copied}" if copied else "")
    return out


# -- import ---------------------------------------------------------------------------------------

class SafetensorsFolder:
    """The tensors of an HF folder: model.safetensors, a sharded index, or every *.safetensors.

    Reads with safetensors only (never torch.load / pickle); tensors are read one at a time.
    """

    def __init__(self, folder: Path):
        safe_open = _safetensors().safe_open
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise DataError(f"{index} is not a JSON object: {e}") from None
            if not isinstance(weight_map, dict):
                raise DataError(f"{index} has no weight_map object")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (folder / f).is_file():
                    raise MissingFileError(f"{folder / f} is listed in {index.name} but does not exist")
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            hint = (f" ({', '.join(pickles)} are pickle files, which megalm does not read: re-save the model with "
                    "save_pretrained(..., safe_serialization=True))" if pickles else "")
            raise MissingFileError(f"no safetensors weights in {folder}: expected model.safetensors, "
                                   f"model.safetensors.index.json + shards, or *.safetensors{hint}")
        self.folder = folder
        self.handles = {f: self._open(safe_open, folder / f) for f in files}
        self.where: Dict[str, str] = {}
        for f, h in self.handles.items():
            for key in h.keys():
                self.where[key] = f

    @staticmethod
    def _open(safe_open, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors' own SafetensorError, or an OSError reading it
            raise _unreadable(path, e) from None

    def keys(self) -> List[str]:
        return list(self.where)

    def get(self, name: str) -> Tensor:
        path = self.folder / self.where[name]
        try:
            return self.handles[self.where[name]].get_tensor(name)
        except Exception as e:  # the header was whole but the data behind it is not
            raise _unreadable(path, e, name) from None


def _unreadable(path: Path, error: Exception, tensor: Optional[str] = None) -> DataError:
    size = path.stat().st_size if path.exists() else 0
    what = f" (reading {tensor})" if tensor else ""
    return DataError(f"{path} is not a readable safetensors file{what}: {error} ({size} bytes); it is probably "
                     "truncated or damaged (an interrupted download or save): download or save it again")


def _fresh_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state (a zero-lr step on zero gradients), then zero all of it.

    Zero moments with step 0 (AdamW) and a zero momentum buffer (SGD) update exactly as a
    fresh optimizer does, so training from the import is training from these weights.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value.zero_()


def _optimizer_config(preset: str):
    from megalm.config import OptimizerConfig, conf_dir
    path = Path(conf_dir()) / "optimizer" / f"{preset}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"--optimizer {preset!r}: no {path.name} in conf/optimizer: allowed: {', '.join(have)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimizerConfig), OmegaConf.load(path)))


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "hf_model"


@torch.no_grad()
def import_from_hf(hf_dir: Path, out_dir: Path, *, name: Optional[str] = None, seq_length: Optional[int] = None,
                   optimizer: str = "adamw", force: bool = False) -> Tuple[Path, ModelConfig]:
    """Write a megalm checkpoint dir (step_00000000 + latest, config.yaml, conf/model/NAME.yaml) for an HF folder."""
    from megalm.config import CheckpointConfig
    from megalm.models import build_model, family_of
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.optim import build_optimizer
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise MissingFileError(f"{hf_dir} is not a directory: expected a Hugging Face model folder "
                               "(config.json + *.safetensors)")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"{config_path} does not exist: expected a Hugging Face model folder "
                               "(config.json + *.safetensors)")
    try:
        hf = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{config_path} is not JSON: {e}") from None
    if seq_length is not None and seq_length < 1:
        raise ConfigError(f"--seq-length={seq_length} must be at least 1")
    name = _safe_name(name or f"hf_{hf_dir.resolve().name}")
    arch, cfg = model_config_from_hf(hf, name, seq_length)
    opt_cfg = _optimizer_config(optimizer)
    out = Path(out_dir).expanduser().resolve()
    _check_out_dir(out, force, ("latest", "config.yaml"))
    weights = SafetensorsFolder(hf_dir)

    model = build_model(cfg)
    rules = expand_rules(arch, cfg)
    used = set()
    for pname, p in model.named_parameters():  # what this config's model needs, tied weights once
        rule = rules.get(pname)
        if rule is None:
            raise RuntimeError(f"no {arch} rule for megalm parameter {pname}")  # a bug in the tables
        missing = [n for n in rule.hf if n not in weights.where]
        if missing:
            raise DataError(f"{hf_dir}: the weights lack {', '.join(missing)}, which {ARCHS[arch]} with this "
                            f"config.json needs (for megalm's {pname})")
        t = rule.transform.join([weights.get(n).float() for n in rule.hf], cfg)
        used.update(rule.hf)
        want = tuple(p.shape)
        if pname in family_of(cfg.arch).vocab_params:  # real rows; the model's padding rows stay 0
            want = (cfg.vocab_size,) + want[1:]
        if tuple(t.shape) != want:
            raise DataError(f"{hf_dir}: {' + '.join(rule.hf)} gives shape {tuple(t.shape)} for megalm's {pname}; "
                            f"config.json implies {want}")
        p.zero_()
        p[:t.shape[0]].copy_(t)
    leftover = [k for k in weights.keys() if k not in used and not IGNORED_HF.search(k)]
    if cfg.tie_embeddings and "lm_head.weight" in leftover:  # some tied checkpoints store the copy too
        embed = model.embed.tok.weight[:cfg.vocab_size]
        if not torch.equal(weights.get("lm_head.weight").float(), embed):
            raise DataError(f"{hf_dir}: config.json says tie_word_embeddings=true but lm_head.weight differs "
                            "from the input embedding")
        leftover.remove("lm_head.weight")
    if leftover:
        raise DataError(f"{hf_dir}: {len(leftover)} tensors have no megalm counterpart under this config.json "
                        f"({', '.join(leftover[:5])}{', ...' if len(leftover) > 5 else ''})")

    optim = build_optimizer(opt_cfg, model)
    _fresh_optimizer_state(optim)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{cfg.name}: imported from Hugging Face {ARCHS[arch]} ({hf_dir.name}) by python -m megalm.convert.\n"
              f"Train from it: python -m megalm.train --config-dir DIR/conf model={cfg.name} checkpoint.load=DIR\n"
              "where DIR is the folder with the step_00000000 checkpoint.")
    (out / "config.yaml").write_text(_run_style_yaml(cfg, header))
    (out / "conf" / "model").mkdir(parents=True, exist_ok=True)
    (out / "conf" / "model" / f"{cfg.name}.yaml").write_text(model_yaml(cfg, header))
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", out / "tokenizer.json")
    state = {"consumed_samples": 0, "val_loss": None, "skipped_steps": 0,
             "imported_from": {"format": "huggingface", "architecture": ARCHS[arch], "folder": hf_dir.name,
                               "optimizer": opt_cfg.name}}
    with torch.random.fork_rng(devices=[]):  # the saved RNG state is the same on every import
        torch.manual_seed(0)
        Checkpointer(CheckpointConfig(dir=str(out), keep_last=0), out).save(0, model, optim, state)
    n = sum(p.numel() for p in model.parameters())
    log.info("imported %s (%s, %.2fM parameters) into %s", hf_dir, ARCHS[arch], n / 1e6, out)
    return out, cfg


def _run_style_yaml(cfg: ModelConfig, header: str) -> str:
    """config.yaml as a run directory has it (a `model:` section), so export and tools find the model."""
    body = OmegaConf.to_yaml(OmegaConf.create({"model": OmegaConf.structured(cfg)}))
    return "".join(f"# {line}\n" for line in header.splitlines()) + body
