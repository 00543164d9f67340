"""GPT-NeoX's parallel plans: where megalm.parallel's styles go in its model (the family's only file that
imports megalm.parallel)."""

from __future__ import annotations

from typing import List, Tuple

from megalm.models.neox.config import NeoXConfig
from megalm.parallel.context import ContextPositions, RingAttention
from megalm.parallel.styles import (ColumnParallel, RowParallel, SequenceParallelParams, TPRandom, VocabParallel,
                                    VocabParallelLoss)


def tp_plan(cfg: NeoXConfig, tp: int, sp: bool) -> List[Tuple[str, object]]:
    """Megatron's tensor-parallel layout (arXiv:1909.08053, sec. 3), which GPT-NeoX itself trains with: the
    fused QKV column-parallel by whole heads of each of q, k and v, the attention output row-parallel, the
    MLP column then row; embedding, head and loss vocabulary-parallel. Under the parallel residual attention
    and MLP each end in their own row-parallel reduction (two per layer, as the sequential form).

    Sequence parallel (arXiv:2205.05198): with no position table to add after the lookup, the embedding's
    partial sums are reduce-scattered straight into sequence shards and dropped out there; norms and the
    residual dropouts run on shards (their gains and biases get partial gradients, summed over tp)."""
    rows = cfg.padded_vocab(tp)
    width = cfg.num_attention_heads * cfg.head_dim
    plan: List[Tuple[str, object]] = []
    if sp:
        plan += [("embed.tok", VocabParallel(rows, reduce="reduce_scatter")), ("embed.drop", TPRandom())]
    else:
        plan += [("embed.tok", VocabParallel(rows))]
    plan += [
        ("blocks.*.attn.qkv", ColumnParallel(segments=(width, width, width))),
        ("blocks.*.attn.proj", RowParallel()),
        ("blocks.*.attn.core", TPRandom(uniform=True)),  # attention dropout over this rank's heads
        ("blocks.*.mlp.fc1", ColumnParallel()),
        ("blocks.*.mlp.fc2", RowParallel()),
    ]
    if sp:
        plan += [(f"blocks.*.{name}", TPRandom()) for name in ("attn.dropout", "mlp.dropout")]
        plan += [(name, SequenceParallelParams()) for name in ("blocks.*.norm1", "blocks.*.norm2", "norm")]
    plan += [("head", ColumnParallel(rows=rows)), ("criterion", VocabParallelLoss(rows))]
    return plan


def cp_plan(cfg: NeoXConfig) -> List[Tuple[str, object]]:
    """Context parallelism (arXiv:2310.01889's ring, Megatron-Core's layout): each layer's causal attention
    core attends around the cp ring, and the positions each attention rotates by (its argument 5, a sequence
    shard's under sp) are this rank's chunks' places in the whole sequence."""
    return [("blocks.*.attn.core", RingAttention()),
            ("blocks.*.attn", ContextPositions(arg=5, sequence_sharded=True))]
