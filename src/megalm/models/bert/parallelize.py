"""BERT's tensor-parallel plan: where megalm.parallel's styles go in its model (the family's only file
that imports megalm.parallel)."""

from __future__ import annotations

from typing import List, Tuple

from megalm.models.bert.config import BertConfig
from megalm.parallel.styles import (ColumnParallel, GatherSequence, RowParallel, ScatterSequence, SequenceParallelParams,
                                    TPRandom, VocabParallel, VocabParallelLoss)


def tp_plan(cfg: BertConfig, tp: int, sp: bool) -> List[Tuple[str, object]]:
    """Megatron's layout for BERT: the blocks as GPT's (column-parallel QKV and first MLP linear,
    row-parallel output and second linear), the embedding, MLM output and loss vocabulary-parallel;
    pooler, MLM dense / norm and binary head replicated. Under sequence parallelism the MLM dense
    and norm run on sequence shards (their gradients are partial), and the pooler gathers the
    sequence to read token 0, as Megatron's BertModel does."""
    rows = cfg.padded_vocab(tp)
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    plan: List[Tuple[str, object]] = [("embed.tok", VocabParallel(rows))]
    if sp:  # positions, token types, dropout on the full (replicated) sequence, then this rank's part
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
        plan += [(name, SequenceParallelParams())
                 for name in ("blocks.*.norm1", "blocks.*.norm2", "norm", "lm_head.dense", "lm_head.norm")]
        plan += [("pooler", GatherSequence()), ("qa_head", GatherSequence())]
    plan += [("lm_head.out", ColumnParallel(rows=rows)), ("criterion", VocabParallelLoss(rows))]
    return plan
