"""The neox family's Hugging Face mapping (Family.hf): GPTNeoXForCausalLM, the class of the Pythia
checkpoints and GPT-NeoX-20B.

GPTNeoXForCausalLM computes exactly what megalm's NeoX does when its linears and norms have biases
(attention_bias=true: its MLP always has them), its activation is erf GELU ("gelu"), a tanh GELU or
ReLU, and its RoPE is plain (no scaling) over an even number of channels a head. Anything else is
refused with an error naming the field, its value and what is allowed.

Weight layouts (nn.Linear weights are (out, in); h hidden, nh heads, hd head dim, f MLP width):

    megalm (models/neox/model.py)
      blocks.{i}.attn.qkv.weight  (3 nh hd, h)  rows [q | k | v]: every head's q, then every head's k, then v
    GPTNeoXForCausalLM
      gpt_neox.layers.{i}.attention.query_key_value.weight  (3 nh hd, h)  rows head by head, [q_h | k_h | v_h]
      (its forward views the output as (nh, 3 hd) and chunks each head in three); the bias likewise.
      Import regroups the rows [head, part, channel] -> [part, head, channel]; export the inverse.
      embed_out.weight is the untied output head (transformers 5 names the module lm_head, and renames the
      tensor embed_out on load and back on save, so every saved checkpoint has embed_out).

Both keep rotate-half RoPE on a head's first int(hd x rotary_pct) channels, pairs (j, j + r/2), so the
q and k rows need no further permutation.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

import torch

from megalm.models.hf_rules import Rule, Transform, UnsupportedArchitecture
from megalm.models.hf_rules import check as _check, get as _get, unsupported as _unsupported
from megalm.models.neox.config import NeoXConfig

ARCHS = {"gpt_neox": "GPTNeoXForCausalLM"}
"""Hugging Face model_type -> the class this mapping reads and writes."""
SUMMARY = "GPT-NeoX (Pythia: partial rotary, parallel or sequential residual, untied head) maps to GPTNeoXForCausalLM"
"""What configs map to which class, for `python -m megalm.convert --help`."""

ACT_FROM_HF = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
"""config.json hidden_act -> megalm's model.activation (HF's "gelu" is the erf form, "gelu_new" the tanh one)."""
ACT_TO_HF = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}


def _regroup(t: torch.Tensor, heads: int, source: str) -> torch.Tensor:
    """qkv rows (weight (3 nh hd, h) or bias (3 nh hd,)) from `source` order ("head": HF's [q_h | k_h | v_h]
    per head; "part": megalm's [q | k | v]) to the other: the two leading axes of (., ., hd, ...) swap."""
    rest = t.shape[1:]
    head_dim = t.shape[0] // (3 * heads)
    lead = (heads, 3) if source == "head" else (3, heads)
    return t.reshape(*lead, head_dim, *rest).transpose(0, 1).reshape(t.shape)


QKV_BY_HEAD = Transform(split=lambda t, c: [_regroup(t, c.num_attention_heads, "part").contiguous()],
                        join=lambda ts, c: _regroup(ts[0], c.num_attention_heads, "head").contiguous())
"""megalm's [q | k | v] rows <-> GPTNeoX's rows head by head."""


def _rules() -> List[Rule]:
    layer = "gpt_neox.layers.{i}."
    a, m = layer + "attention.", layer + "mlp."
    return [
        Rule("embed.tok.weight", ("gpt_neox.embed_in.weight",)),
        Rule("blocks.{i}.norm1.weight", (layer + "input_layernorm.weight",)),
        Rule("blocks.{i}.norm1.bias", (layer + "input_layernorm.bias",)),
        Rule("blocks.{i}.attn.qkv.weight", (a + "query_key_value.weight",), QKV_BY_HEAD),
        Rule("blocks.{i}.attn.qkv.bias", (a + "query_key_value.bias",), QKV_BY_HEAD),
        Rule("blocks.{i}.attn.proj.weight", (a + "dense.weight",)),
        Rule("blocks.{i}.attn.proj.bias", (a + "dense.bias",)),
        Rule("blocks.{i}.norm2.weight", (layer + "post_attention_layernorm.weight",)),
        Rule("blocks.{i}.norm2.bias", (layer + "post_attention_layernorm.bias",)),
        Rule("blocks.{i}.mlp.fc1.weight", (m + "dense_h_to_4h.weight",)),
        Rule("blocks.{i}.mlp.fc1.bias", (m + "dense_h_to_4h.bias",)),
        Rule("blocks.{i}.mlp.fc2.weight", (m + "dense_4h_to_h.weight",)),
        Rule("blocks.{i}.mlp.fc2.bias", (m + "dense_4h_to_h.bias",)),
        Rule("norm.weight", ("gpt_neox.final_layer_norm.weight",)),
        Rule("norm.bias", ("gpt_neox.final_layer_norm.bias",)),
        Rule("head.weight", ("embed_out.weight",)),  # only when untied
    ]


RULES = _rules()
# HF tensors that are not weights: older checkpoints' causal-mask buffers and rotary tables.
IGNORED = re.compile(r"(\.attention\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


def rules(arch: str, cfg=None) -> List[Rule]:
    """The rules of `arch` ("{i}" stands for each layer)."""
    return RULES


def tied_copies(cfg: NeoXConfig) -> Dict[str, str]:
    """HF tensors some checkpoints store although they are a tied weight: HF name -> megalm name."""
    return {"embed_out.weight": "embed.tok.weight", "lm_head.weight": "embed.tok.weight"} if cfg.tie_embeddings else {}


def export_arch(cfg: NeoXConfig) -> str:
    """"gpt_neox" when GPTNeoXForCausalLM computes exactly what cfg does; else an error naming the field."""
    target = "GPTNeoXForCausalLM"
    need = {"model.normalization": (cfg.normalization, ("layernorm",)), "model.bias": (cfg.bias, (True,)),
            "model.activation": (cfg.activation, tuple(ACT_TO_HF)),
            "model.num_query_groups": (cfg.num_query_groups, (None, cfg.num_attention_heads))}
    for field, (value, allowed) in need.items():
        if value not in allowed:
            raise _unsupported(field, value, target, " or ".join(repr(a) for a in allowed),
                               ": its layers are LayerNorm, biased linears, an ungated MLP and one key / value head "
                               "per query head")
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise _unsupported("model.hidden_size", cfg.hidden_size, target,
                           f"a multiple of num_attention_heads={cfg.num_attention_heads}")
    if cfg.rotary_dims < 2 or cfg.rotary_dims % 2:
        raise _unsupported("model.rotary_pct", cfg.rotary_pct, target,
                           f"a share of head_dim={cfg.head_dim} that is an even number of channels")
    return "gpt_neox"


def hf_config(cfg: NeoXConfig, arch: str, dtype: str = "float32", eod: Optional[int] = None) -> Dict[str, Any]:
    """The config.json of cfg as GPTNeoXForCausalLM. The rotary settings twice: rotary_pct / rotary_emb_base
    for transformers 4.x (and Pythia's own files), rope_parameters for 5.x."""
    return {"architectures": [ARCHS[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.ffn_size,
            "hidden_act": ACT_TO_HF[cfg.activation], "rotary_pct": cfg.rotary_pct,
            "rotary_emb_base": cfg.rotary_emb_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_emb_base,
                                "partial_rotary_factor": cfg.rotary_pct},
            "max_position_embeddings": cfg.seq_length, "layer_norm_eps": cfg.norm_eps,
            "use_parallel_residual": cfg.use_parallel_residual, "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": True, "hidden_dropout": cfg.dropout, "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std, "bos_token_id": eod, "eos_token_id": eod, "use_cache": True,
            "dtype": dtype}


def _rotary(hf: Dict[str, Any]) -> "tuple[float, float]":
    """(rotary_pct, base) of a config.json: transformers 5's rope_parameters, else 4.x's rotary_pct /
    rotary_emb_base (their defaults: 0.25, 10000); rope scaling of any kind is refused."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if kind != "default":
            raise UnsupportedArchitecture(f"config.json: {key} has rope_type={kind!r} (rope scaling), which has no "
                                          "megalm equivalent: allowed: 'default' (plain RoPE)")
    params = hf.get("rope_parameters") or {}
    pct = params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    base = params.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    return float(pct), float(base)


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> NeoXConfig:
    """The NeoXConfig of a gpt_neox config.json dict; an error for what megalm cannot compute."""
    act = _check(hf, "hidden_act", "gelu", tuple(ACT_FROM_HF))
    _check(hf, "attention_bias", True, (True,), " (megalm has one model.bias, and NeoX's MLP always has biases)")
    h, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    if h % heads:
        raise UnsupportedArchitecture(f"config.json: hidden_size={h} is not divisible by num_attention_heads={heads}")
    _check(dict(hf, head_dim=hf.get("head_dim") or h // heads), "head_dim", h // heads, (h // heads,),
           " (megalm's head dim is hidden_size / num_attention_heads)")
    pct, base = _rotary(hf)
    rotary = int(h // heads * pct)
    if not 0 < pct <= 1 or rotary < 2 or rotary % 2:
        raise UnsupportedArchitecture(f"config.json: partial_rotary_factor (rotary_pct)={pct} of a {h // heads}-channel "
                                      f"head rotates {rotary} channels: allowed: a share in (0, 1] giving an even "
                                      "number, at least 2")
    return NeoXConfig(
        name=name, num_layers=_get(hf, "num_hidden_layers"), hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=_get(hf, "intermediate_size"), seq_length=seq_length or _get(hf, "max_position_embeddings"),
        vocab_size=_get(hf, "vocab_size"), activation=ACT_FROM_HF[act], norm_eps=float(_get(hf, "layer_norm_eps", 1e-5)),
        bias=True, rotary_pct=pct, rotary_emb_base=base,
        use_parallel_residual=bool(_get(hf, "use_parallel_residual", True)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)), dropout=float(_get(hf, "hidden_dropout", 0.0)),
        attention_dropout=float(_get(hf, "attention_dropout", 0.0)), init_std=float(_get(hf, "initializer_range", 0.02)))
