"""The T5 family's Hugging Face mapping (Family.hf): T5ForConditionalGeneration.

Hugging Face's T5 is megalm's T5 with relative position buckets, RMSNorm, no biases and no LM
head bias; `feed_forward_proj` "relu" is megalm's relu, "gelu" its gelu_exact, "gated-silu" its
swiglu ([wi_0 | wi_1] stacked as megalm's fused [gate | up]). Two differences are weights, not
structure, and are converted exactly:
- T5 does not scale attention scores by 1/sqrt(d_kv) (its initialisation absorbs it); megalm does,
  so megalm's query weights are Hugging Face's times sqrt(d_kv).
- transformers ties lm_head to the shared embedding, and with `scale_decoder_outputs` (older configs:
  `tie_word_embeddings`; the original T5's) scales the decoder's output by d_model^-0.5 before it. Such a model imports with an
  untied megalm head holding the embedding times d_model^-0.5; a megalm model exports with its head
  tied and no scaling.
Layers: megalm's blocks 0..Le-1 are `encoder.block.*`, blocks Le.. are `decoder.block.*`; the
encoder's final norm is the last encoder block's `norm_out`; each stack's relative-bias table
(`enc_bias`, `dec_bias`) is its first block's `relative_attention_bias`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional

import torch

from megalm.data.samples.t5 import t5_specials
from megalm.models.hf_rules import SAME, Rule, Transform, UnsupportedArchitecture, check, get, rows, unsupported
from megalm.errors import ConfigError
from megalm.models.t5.config import T5Config

ARCHS = {"t5": "T5ForConditionalGeneration"}
"""Hugging Face model_type -> the class this mapping reads and writes."""
SUMMARY = "T5 (relative buckets, rmsnorm, no biases, model.head_bias=false) maps to T5ForConditionalGeneration"
"""What configs map to which class, for `python -m megalm.convert --help`."""
IGNORED = re.compile(r"$^")  # T5 checkpoints store no buffers
FEED_FORWARD = {"relu": "relu", "gelu": "gelu_exact", "gated-silu": "swiglu"}


def _scaled_qkv(sizes) -> Transform:
    """[q | k | v] (or a lone q) with q times sqrt(d_kv): megalm's scaled scores equal T5's unscaled ones."""
    def split(t, c):
        parts = list(torch.split(t, sizes(c), dim=0))
        parts[0] = parts[0] / math.sqrt(c.head_dim)
        return parts

    def join(ts, c):
        return torch.cat([ts[0] * math.sqrt(c.head_dim), *ts[1:]], dim=0)
    return Transform(split, join)


QKV = _scaled_qkv(lambda c: [c.num_attention_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim])
Q = _scaled_qkv(lambda c: [c.num_attention_heads * c.head_dim])
KV = rows(lambda c: [c.kv_heads * c.head_dim, c.kv_heads * c.head_dim])
GATE_UP = rows(lambda c: [c.ffn_size, c.ffn_size])
SCALED_HEAD = Transform(lambda t, c: [t * math.sqrt(c.hidden_size)], lambda ts, c: ts[0] / math.sqrt(c.hidden_size))


def rules(arch: str, cfg: T5Config) -> List[Rule]:
    Le = cfg.encoder_layers
    gated = cfg.activation == "swiglu"
    wi = ("DenseReluDense.wi_0.weight", "DenseReluDense.wi_1.weight") if gated else ("DenseReluDense.wi.weight",)
    out = [Rule("embed.tok.weight", ("shared.weight",)),
           Rule("enc_bias.table.weight", ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
           Rule("dec_bias.table.weight", ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
           Rule(f"blocks.{Le - 1}.norm_out.weight", ("encoder.final_layer_norm.weight",)),
           Rule("norm.weight", ("decoder.final_layer_norm.weight",))]
    if not cfg.tie_embeddings:  # the original T5's scaled output, imported (export needs a tied head)
        out.append(Rule("head.weight", ("shared.weight",), SCALED_HEAD))
    for i in range(cfg.num_layers):
        stack, j = ("encoder", i) if i < Le else ("decoder", i - Le)
        b, m = f"{stack}.block.{j}.layer.", f"blocks.{i}."
        attn = b + "0.SelfAttention."
        ff = b + ("1." if stack == "encoder" else "2.")
        out += [Rule(m + "attn.qkv.weight", tuple(attn + f"{n}.weight" for n in "qkv"), QKV),
                Rule(m + "attn.proj.weight", (attn + "o.weight",)),
                Rule(m + "norm1.weight", (b + "0.layer_norm.weight",)),
                Rule(m + "mlp.fc1.weight", tuple(ff + n for n in wi), GATE_UP if gated else SAME),
                Rule(m + "mlp.fc2.weight", (ff + "DenseReluDense.wo.weight",)),
                Rule(m + "norm2.weight", (b + "1.layer_norm.weight",))]
        if stack == "decoder":
            cross = b + "1.EncDecAttention."
            out += [Rule(m + "cross.q.weight", (cross + "q.weight",), Q),
                    Rule(m + "cross.kv.weight", (cross + "k.weight", cross + "v.weight"), KV),
                    Rule(m + "cross.proj.weight", (cross + "o.weight",)),
                    Rule(m + "norm3.weight", (b + "2.layer_norm.weight",))]
    return out


def tied_copies(cfg: T5Config) -> Dict[str, str]:
    """HF tensors some checkpoints store although they repeat the shared embedding."""
    return {"encoder.embed_tokens.weight": "embed.tok.weight", "decoder.embed_tokens.weight": "embed.tok.weight",
            "lm_head.weight": "embed.tok.weight"}


def export_arch(cfg: T5Config) -> str:
    """"t5" when T5ForConditionalGeneration computes exactly what cfg does; else an error naming the field."""
    target = ARCHS["t5"]
    need = {"model.position_embedding": (cfg.position_embedding, ("relative",)),
            "model.normalization": (cfg.normalization, ("rmsnorm",)),
            "model.bias": (cfg.bias, (False,)),
            "model.head_bias": (cfg.head_bias, (False,)),
            "model.tie_embeddings": (cfg.tie_embeddings, (True,)),
            "model.activation": (cfg.activation, tuple(FEED_FORWARD.values()))}
    for field, (value, allowed) in need.items():
        if value not in allowed:
            raise unsupported(field, value, target, " or ".join(repr(a) for a in allowed),
                              "; Hugging Face's T5 has relative position buckets, RMSNorm, no biases and its LM "
                              "head tied to the embedding")
    if cfg.kv_heads != cfg.num_attention_heads:
        raise unsupported("model.num_query_groups", cfg.num_query_groups, target,
                          f"null or {cfg.num_attention_heads} (= num_attention_heads)", ": T5 has no grouped-query attention")
    return "t5"


def hf_config(cfg: T5Config, arch: str, dtype: str = "float32", eod: Optional[int] = None) -> Dict[str, Any]:
    """T5ForConditionalGeneration's config.json for cfg (`eod`, when the tokenizer has one, as its EOS)."""
    out = {"architectures": [ARCHS[arch]], "model_type": "t5", "vocab_size": cfg.vocab_size,
           "d_model": cfg.hidden_size, "d_kv": cfg.head_dim, "d_ff": cfg.ffn_size, "num_layers": cfg.encoder_layers,
           "num_decoder_layers": cfg.decoder_layers, "num_heads": cfg.num_attention_heads,
           "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
           "relative_attention_max_distance": cfg.relative_attention_max_distance,
           "dropout_rate": cfg.dropout, "layer_norm_epsilon": cfg.norm_eps,
           "initializer_factor": 1.0,
           "feed_forward_proj": {v: k for k, v in FEED_FORWARD.items()}[cfg.activation],
           "is_encoder_decoder": True, "tie_word_embeddings": False, "scale_decoder_outputs": False, "dtype": dtype}
    if eod is not None:
        out["eos_token_id"] = eod
    return out


def generation_ids(tokenizer) -> Dict[str, int]:
    """The ids megalm's T5 generation uses (megalm.data.samples.t5.t5_specials of the run's tokenizer), as
    transformers' generate() reads them from config.json: the decoder starts at BOS, stops at EOS, pads with PAD."""
    specials = t5_specials(tokenizer)
    return {"decoder_start_token_id": specials.bos, "eos_token_id": specials.eos, "pad_token_id": specials.pad}


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> T5Config:
    """The T5Config of a t5 config.json dict; an error for what megalm cannot compute."""
    proj = check(hf, "feed_forward_proj", "relu", tuple(FEED_FORWARD))
    check(hf, "is_encoder_decoder", True, (True,))
    h, heads, d_kv = get(hf, "d_model"), get(hf, "num_heads"), get(hf, "d_kv")
    if h % heads:
        raise UnsupportedArchitecture(f"config.json: d_model={h} is not divisible by num_heads={heads}")
    layers = int(get(hf, "num_layers"))
    decoder_layers = int(get(hf, "num_decoder_layers", layers))
    dropout = float(get(hf, "dropout_rate", 0.1))
    if seq_length is not None and seq_length < 2:
        raise ConfigError(f"--seq-length={seq_length} must be at least 2")
    return T5Config(
        name=name, num_layers=layers + decoder_layers, encoder_num_layers=layers, hidden_size=h,
        num_attention_heads=heads, kv_channels=None if d_kv * heads == h else d_kv, ffn_hidden_size=get(hf, "d_ff"),
        # Relative positions have no length limit: the encoder's seq_length is the training length chosen.
        seq_length=seq_length or 512, decoder_seq_length=min(seq_length or 512, 128),
        vocab_size=get(hf, "vocab_size"), normalization="rmsnorm",
        norm_eps=float(get(hf, "layer_norm_epsilon", 1e-6)), activation=FEED_FORWARD[proj], bias=False,
        dropout=dropout, attention_dropout=dropout, position_embedding="relative",
        relative_attention_num_buckets=int(get(hf, "relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(get(hf, "relative_attention_max_distance", 128)),
        # A scaled decoder output (transformers' scale_decoder_outputs; older configs: tie_word_embeddings not
        # false) is an untied head here.
        tie_embeddings=not _scales_output(hf), head_bias=False)


def _scales_output(hf: Dict[str, Any]) -> bool:
    if "scale_decoder_outputs" in hf:
        return bool(hf["scale_decoder_outputs"])
    return hf.get("tie_word_embeddings", True) is not False
