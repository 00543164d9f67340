"""GPT's parallel plans: where megalm.parallel's styles go in its model (the family's only file that
imports megalm.parallel)."""

from __future__ import annotations

from typing import List, Tuple

from megalm.config import ModelConfig
from megalm.parallel.context import ContextPositions, RingAttention
from megalm.parallel.experts import ExpertParallel, OwnSequenceShard, PartialOverTP, TokenGroupLoad
from megalm.parallel.styles import (ColumnParallel, GatherSequence, RowParallel, ScatterSequence, SequenceParallelParams,
                                    TPRandom, VocabParallel, VocabParallelLoss)


def tp_plan(cfg: ModelConfig, tp: int, sp: bool) -> List[Tuple[str, object]]:
    """Megatron's tensor-parallel layout of GPT (arXiv:1909.08053, sec. 3; sequence parallel:
    arXiv:2205.05198): in each block the fused QKV and the MLP's first linear are column-parallel
    (whole heads, a slice of the ffn), the attention output and the second linear row-parallel;
    the embedding, head and loss are vocabulary-parallel."""
    rows = cfg.padded_vocab(tp)
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    learned_pos = cfg.position_embedding == "learned"
    plan: List[Tuple[str, object]] = []
    if sp and getattr(cfg, "fine_tuning_head", False):
        plan += [("score", GatherSequence())]  # it reads each sequence's last real token: the whole sequence
    if sp and not learned_pos:
        # No position table to add after the lookup: reduce-scatter the partial sums straight
        # into sequence shards (half the bytes of an all-reduce) and drop out on the shard.
        plan += [("embed.tok", VocabParallel(rows, reduce="reduce_scatter")), ("embed.drop", TPRandom())]
    else:
        plan += [("embed.tok", VocabParallel(rows))]
        if sp:  # positions and dropout on the full (replicated) sequence, then keep this rank's part
            plan += [("embed", ScatterSequence())]
    plan += [
        ("blocks.*.attn.qkv", ColumnParallel(segments=(q, kv, kv))),
        ("blocks.*.attn.proj", RowParallel()),
        ("blocks.*.attn.core", TPRandom(uniform=True)),  # attention dropout over this rank's heads
        ("blocks.*.mlp.fc1", ColumnParallel(segments=(f, f) if cfg.activation == "swiglu" else None)),
        ("blocks.*.mlp.fc2", RowParallel()),
    ]
    if sp:
        plan += [(f"blocks.*.{name}", TPRandom()) for name in ("attn.dropout", "mlp.dropout")]
        plan += [(name, SequenceParallelParams()) for name in ("blocks.*.norm1", "blocks.*.norm2", "norm")]
    plan += [("head", ColumnParallel(rows=rows)), ("criterion", VocabParallelLoss(rows))]
    return plan


def cp_plan(cfg: ModelConfig) -> List[Tuple[str, object]]:
    """Context parallelism (arXiv:2310.01889's ring, Megatron-Core's layout): each layer's causal attention
    core attends around the cp ring, and the positions its RoPE (in `attn`, whose input is a sequence
    shard under sp) and the learned position embedding read are this rank's chunks of the sequence."""
    plan: List[Tuple[str, object]] = [("blocks.*.attn.core", RingAttention()),
                                      ("blocks.*.attn", ContextPositions(arg=5, sequence_sharded=True))]
    if cfg.position_embedding == "learned":
        plan += [("embed", ContextPositions(arg=2))]
    return plan


def expert_plan(cfg: ModelConfig) -> List[Tuple[str, object]]:
    """A mixture of experts in place of each MLP (megalm.models.moe): the experts split over ep and expert tp
    (SwiGLU's [gate | up] columns alike), the expert load summed over the ranks splitting a micro-batch, each
    rank routing its own shard of a replicated sequence (tp without sp), and the router's (and replicated
    experts') gradients partial over tp. Each style applies only where its parallelism is on."""
    if not getattr(cfg, "num_experts", 0):
        return []
    f = cfg.ffn_size
    return [("blocks.*.mlp.experts", ExpertParallel(fc1_segments=(f, f) if cfg.activation == "swiglu" else None)),
            ("blocks.*.mlp.load", TokenGroupLoad()),
            ("blocks.*.mlp", OwnSequenceShard()),
            ("blocks.*.mlp", PartialOverTP())]
