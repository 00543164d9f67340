"""The BERT family's Hugging Face mapping (Family.hf): BertForPreTraining.

Hugging Face's BERT is the post-LN layout (`model.norm_position=post`: a norm after the
embeddings and after each residual sum, no final norm) with LayerNorm, biases, learned absolute
positions and token types; its MLM head ties the output to the word embeddings and has a bias
of its own (`cls.predictions.bias`); the sentence-order head is `cls.seq_relationship`.
hidden_act "gelu" is megalm's gelu_exact, "gelu_new" / "gelu_pytorch_tanh" its gelu. Query, key
and value are separate (h, h) linears there, rows [q | k | v] of megalm's fused qkv here.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from megalm.models.hf_rules import QKV, Rule, UnsupportedArchitecture, check, get, unsupported
from megalm.errors import ConfigError
from megalm.models.bert.config import BertConfig

ARCHS = {"bert": "BertForPreTraining"}
"""Hugging Face model_type -> the class this mapping reads and writes."""
SUMMARY = "post-LN BERT maps to BertForPreTraining"
"""What configs map to which class, for `python -m megalm.convert --help`."""
IGNORED = re.compile(r"\.(position_ids|token_type_ids)$")  # buffers some checkpoints store
ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}


def _rules() -> List[Rule]:
    e, h = "bert.embeddings.", "bert.encoder.layer.{i}."
    a = h + "attention."
    rules = [
        Rule("embed.tok.weight", (e + "word_embeddings.weight",)),
        Rule("embed.pos.weight", (e + "position_embeddings.weight",)),
        Rule("embed.types.weight", (e + "token_type_embeddings.weight",)),
        Rule("embed.norm.weight", (e + "LayerNorm.weight",)),
        Rule("embed.norm.bias", (e + "LayerNorm.bias",)),
    ]
    for kind in ("weight", "bias"):
        rules += [
            Rule(f"blocks.{{i}}.attn.qkv.{kind}", tuple(f"{a}self.{n}.{kind}" for n in ("query", "key", "value")), QKV),
            Rule(f"blocks.{{i}}.attn.proj.{kind}", (f"{a}output.dense.{kind}",)),
            Rule(f"blocks.{{i}}.norm1.{kind}", (f"{a}output.LayerNorm.{kind}",)),
            Rule(f"blocks.{{i}}.mlp.fc1.{kind}", (f"{h}intermediate.dense.{kind}",)),
            Rule(f"blocks.{{i}}.mlp.fc2.{kind}", (f"{h}output.dense.{kind}",)),
            Rule(f"blocks.{{i}}.norm2.{kind}", (f"{h}output.LayerNorm.{kind}",)),
            Rule(f"pooler.dense.{kind}", (f"bert.pooler.dense.{kind}",)),
            Rule(f"lm_head.dense.{kind}", (f"cls.predictions.transform.dense.{kind}",)),
            Rule(f"lm_head.norm.{kind}", (f"cls.predictions.transform.LayerNorm.{kind}",)),
            Rule(f"binary_head.{kind}", (f"cls.seq_relationship.{kind}",)),
        ]
    rules.append(Rule("lm_head.out.bias", ("cls.predictions.bias",)))
    return rules


RULES = {"bert": _rules()}


def rules(arch: str, cfg=None) -> List[Rule]:
    """The rules of `arch` (the same for every config: "{i}" stands for each layer)."""
    return RULES[arch]


def tied_copies(cfg: BertConfig) -> Dict[str, str]:
    """HF tensors some checkpoints store although they repeat another: HF name -> megalm name."""
    return {"cls.predictions.decoder.weight": "embed.tok.weight", "cls.predictions.decoder.bias": "lm_head.out.bias"}


def export_arch(cfg: BertConfig) -> str:
    """"bert" when BertForPreTraining computes exactly what cfg does; else an error naming the field."""
    target = "BertForPreTraining"
    need = {"model.norm_position": (cfg.norm_position, ("post",)),
            "model.normalization": (cfg.normalization, ("layernorm",)),
            "model.activation": (cfg.activation, ("gelu_exact", "gelu")),
            "model.bias": (cfg.bias, (True,)),
            "model.binary_head": (cfg.binary_head, (True,))}
    for field, (value, allowed) in need.items():
        if value not in allowed:
            raise unsupported(field, value, target, " or ".join(repr(a) for a in allowed),
                              "; Hugging Face's BERT is post-LN with layernorm, gelu, biases and the "
                              "sentence-order head")
    if cfg.num_tokentypes < 1:
        raise unsupported("model.num_tokentypes", cfg.num_tokentypes, target, "1 or more (type_vocab_size)")
    if cfg.kv_heads != cfg.num_attention_heads:
        raise unsupported("model.num_query_groups", cfg.num_query_groups, target,
                          f"null or {cfg.num_attention_heads} (= num_attention_heads)", ": BERT has no grouped-query attention")
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise unsupported("model.hidden_size", cfg.hidden_size, target,
                          f"a multiple of num_attention_heads={cfg.num_attention_heads}")
    return "bert"


def hf_config(cfg: BertConfig, arch: str, dtype: str = "float32", eod: Optional[int] = None) -> Dict[str, Any]:
    """BertForPreTraining's config.json for cfg (`eod` is not a BERT notion and is not written)."""
    return {"architectures": [ARCHS[arch]], "model_type": "bert", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.ffn_size,
            "hidden_act": "gelu" if cfg.activation == "gelu_exact" else "gelu_new",
            "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
            "max_position_embeddings": cfg.seq_length, "type_vocab_size": cfg.num_tokentypes,
            "initializer_range": cfg.init_std, "layer_norm_eps": cfg.norm_eps, "position_embedding_type": "absolute",
            "tie_word_embeddings": True, "dtype": dtype}


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> BertConfig:
    """The BertConfig (post-LN) of a bert config.json dict; an error for what megalm cannot compute."""
    act = check(hf, "hidden_act", "gelu", tuple(ACTIVATIONS))
    check(hf, "position_embedding_type", "absolute", ("absolute",), " (megalm's BERT has learned absolute positions)")
    check(hf, "is_decoder", False, (False,))
    check(hf, "add_cross_attention", False, (False,))
    check(hf, "tie_word_embeddings", True, (True,), " (megalm's MLM output is the word embedding)")
    h, heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    if h % heads:
        raise UnsupportedArchitecture(f"config.json: hidden_size={h} is not divisible by num_attention_heads={heads}")
    cfg = BertConfig(
        name=name, num_layers=get(hf, "num_hidden_layers"), hidden_size=h, num_attention_heads=heads,
        ffn_hidden_size=get(hf, "intermediate_size"), seq_length=get(hf, "max_position_embeddings"),
        vocab_size=get(hf, "vocab_size"), normalization="layernorm", norm_eps=float(get(hf, "layer_norm_eps", 1e-12)),
        activation=ACTIVATIONS[act], bias=True, dropout=float(get(hf, "hidden_dropout_prob", 0.0)),
        attention_dropout=float(get(hf, "attention_probs_dropout_prob", 0.0)),
        init_std=float(get(hf, "initializer_range", 0.02)), num_tokentypes=int(get(hf, "type_vocab_size", 2)),
        binary_head=True, norm_position="post")
    if seq_length is not None and seq_length != cfg.seq_length:
        raise ConfigError(f"--seq-length={seq_length}: BERT has learned positions, so seq_length is "
                          f"max_position_embeddings={cfg.seq_length} from config.json; allowed: {cfg.seq_length}")
    return cfg
