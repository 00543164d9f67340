"""The GPT family's Hugging Face mapping (Family.hf): GPT2LMHeadModel, LlamaForCausalLM and
MixtralForCausalLM.

Three Hugging Face architectures are exactly what megalm's GPT computes:

    GPT2LMHeadModel     learned positions + LayerNorm (with bias) + GELU (tanh) + biases everywhere
    LlamaForCausalLM    RoPE (rotate-half) + RMSNorm + SwiGLU + GQA, biases optional
    MixtralForCausalLM  Llama's layers without biases, each MLP a mixture of SwiGLU experts with a
                        softmax top-k router, dropless (model.num_experts)

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
    Mixtral (as its checkpoints keep it)
      block_sparse_moe.gate (E, h) is megalm's mlp.router; expert e's w1 (gate) and w3 (up), each
      (f, h), and w2 (h, f). megalm stacks the experts: mlp.experts.fc1.weight (E, h, 2 f) with
      columns [gate | up], i.e. [w1^T | w3^T] per expert, and mlp.experts.fc2.weight (E, f, h), w2^T.

Which rules apply is decided by the megalm model built from the config: its parameters are
what must be filled (no bias rules when bias=false, no position table for rope, no head when tied).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Dict, List, Optional

import torch

from megalm.models.hf_rules import CONV1D, QKV, Rule, Transform, UnsupportedArchitecture, rows
from megalm.models.hf_rules import check as _check, get as _get, unsupported as _unsupported
from megalm.errors import ConfigError
from megalm.models.gpt.config import GPTConfig

log = logging.getLogger("megalm.convert")

ARCHS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
"""Hugging Face model_type -> the class this mapping reads and writes."""
SUMMARY = ("GPT-2 style models (learned positions, layernorm, gelu, biases) map to GPT2LMHeadModel, Llama style (rope, "
           "rmsnorm, swiglu, optional GQA) to LlamaForCausalLM, a Llama-style mixture of experts (softmax routing, no "
           "capacity limit) to MixtralForCausalLM")
"""What configs map to which class, for `python -m megalm.convert --help`."""
GATE_UP = rows(lambda c: [c.ffn_size, c.ffn_size])


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


def _experts_fc1():
    """[w1^T | w3^T] of each expert, stacked: (E, h, 2 f) from 2 E tensors (w1, w3 of expert 0, then 1, ...)."""
    def split(t, c):
        return [part.t().contiguous() for e in range(t.shape[0]) for part in t[e].chunk(2, dim=1)]

    def join(ts, c):
        return torch.stack([torch.cat([ts[2 * e].t(), ts[2 * e + 1].t()], dim=1) for e in range(len(ts) // 2)])
    return Transform(split, join)


STACKED_T = Transform(lambda t, c: [m.t().contiguous() for m in t], lambda ts, c: torch.stack([m.t() for m in ts]))
"""Each expert's matrix, transposed, stacked along a new first dim (fc2: (E, f, h) from E (h, f))."""


def _mixtral_rules(cfg) -> List[Rule]:
    h = "model.layers.{i}."
    moe = h + "block_sparse_moe."
    E = cfg.num_experts if cfg is not None else 0
    dense = [r for r in _llama_rules() if ".mlp." not in r.megalm and not r.megalm.endswith(".bias")]
    return dense + [
        Rule("blocks.{i}.mlp.router.weight", (moe + "gate.weight",)),
        Rule("blocks.{i}.mlp.experts.fc1.weight",
             tuple(moe + f"experts.{e}.{w}.weight" for e in range(E) for w in ("w1", "w3")), _experts_fc1()),
        Rule("blocks.{i}.mlp.experts.fc2.weight", tuple(moe + f"experts.{e}.w2.weight" for e in range(E)), STACKED_T),
    ]


RULES = {"gpt2": _gpt2_rules(), "llama": _llama_rules()}
# HF tensors that are not weights: GPT-2's causal-mask buffers, old Llama rotary tables.
IGNORED = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


def rules(arch: str, cfg=None) -> List[Rule]:
    """The rules of `arch` ("{i}" stands for each layer; Mixtral's name each of cfg's experts)."""
    return _mixtral_rules(cfg) if arch == "mixtral" else RULES[arch]


def tied_copies(cfg: GPTConfig) -> Dict[str, str]:
    """HF tensors some checkpoints store although they are a tied weight: HF name -> megalm name."""
    return {"lm_head.weight": "embed.tok.weight"} if cfg.tie_embeddings else {}


def export_arch(cfg: GPTConfig) -> str:
    """The HF architecture ("gpt2" | "llama") that computes exactly what cfg does; else an error."""
    if cfg.position_embedding == "learned":
        arch, target = "gpt2", "GPT2LMHeadModel"
        why = " (chosen by model.position_embedding='learned')"
        need = {"model.normalization": (cfg.normalization, ("layernorm",)),
                "model.activation": (cfg.activation, ("gelu",)),
                "model.bias": (cfg.bias, (True,))}
    elif cfg.position_embedding == "rope" and cfg.num_experts:
        arch, target = "mixtral", "MixtralForCausalLM"
        why = " (chosen by model.position_embedding='rope' and model.num_experts)"
        need = {"model.normalization": (cfg.normalization, ("rmsnorm",)),
                "model.activation": (cfg.activation, ("swiglu",)), "model.bias": (cfg.bias, (False,)),
                "model.moe_router_score_function": (cfg.moe_router_score_function, ("softmax",)),
                "model.moe_capacity_factor": (cfg.moe_capacity_factor, (None,))}
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
    if arch == "gpt2" and cfg.num_experts:
        raise _unsupported("model.num_experts", cfg.num_experts, target, "0",
                           ": Hugging Face's mixture of experts is Mixtral (model.position_embedding='rope')")
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise _unsupported("model.hidden_size", cfg.hidden_size, target,
                           f"a multiple of num_attention_heads={cfg.num_attention_heads}")
    return arch


def hf_config(cfg: GPTConfig, arch: str, dtype: str = "float32", eod: Optional[int] = None) -> Dict[str, Any]:
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
    if arch == "mixtral":
        common.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                      router_aux_loss_coef=cfg.moe_aux_loss_coeff, router_jitter_noise=0.0, output_router_logits=False,
                      sliding_window=None)
    # rope_theta + rope_scaling for transformers 4.x, rope_parameters for 5.x.
    return dict(common, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                rope_scaling=None, rope_parameters=rope, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                attention_dropout=cfg.attention_dropout, pretraining_tp=1)


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> GPTConfig:
    """The GPTConfig of a gpt2 or llama config.json dict; an error for what megalm cannot compute."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        _check(hf, "activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh"),
               " (megalm's gelu is the tanh approximation)")
        _check(hf, "scale_attn_weights", True, (True,))
        _check(hf, "scale_attn_by_inverse_layer_idx", False, (False,))
        _check(hf, "add_cross_attention", False, (False,))
        h = _get(hf, "n_embd")
        cfg = GPTConfig(
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
        if kind == "mixtral":
            _check(hf, "router_jitter_noise", 0.0, (0, 0.0), " (megalm's router adds no noise)")
            window = hf.get("sliding_window")
            if window is not None and window < (seq_length or _get(hf, "max_position_embeddings")):
                raise UnsupportedArchitecture(f"config.json: sliding_window={window} is shorter than the sequence, and "
                                              "megalm attends to every earlier token: allowed: null, or at least "
                                              "the sequence length")
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
        _check(dict(hf, head_dim=hf.get("head_dim") or h // heads), "head_dim", h // heads, (h // heads,),
               " (megalm's head dim is hidden_size / num_attention_heads)")  # null: that default
        kv = _get(hf, "num_key_value_heads", heads)
        cfg = GPTConfig(
            name=name, num_layers=_get(hf, "num_hidden_layers"), hidden_size=h, num_attention_heads=heads,
            num_query_groups=kv if kv != heads else None, ffn_hidden_size=_get(hf, "intermediate_size"),
            seq_length=seq_length or _get(hf, "max_position_embeddings"), vocab_size=_get(hf, "vocab_size"),
            position_embedding="rope", rope_theta=theta, normalization="rmsnorm",
            norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)), activation="swiglu", bias=attn_bias,
            tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
            attention_dropout=float(_get(hf, "attention_dropout", 0.0)),
            init_std=float(_get(hf, "initializer_range", 0.02)))
        if kind == "mixtral":
            cfg = dataclasses.replace(cfg, num_experts=_get(hf, "num_local_experts"),
                                      moe_router_topk=_get(hf, "num_experts_per_tok"),
                                      moe_aux_loss_coeff=float(_get(hf, "router_aux_loss_coef", 0.0)))
    return cfg
