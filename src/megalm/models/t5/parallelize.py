"""T5's tensor-parallel plan: where megalm.parallel's styles go in its model, and a style of its own for
the relative-position bias (the family's only file that imports megalm.parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from megalm.models.t5.config import T5Config
from megalm.parallel.styles import (ColumnParallel, RowParallel, ScatterSequence, SequenceParallelParams, TPRandom,
                                    VocabParallel, VocabParallelLoss)


@dataclass(frozen=True)
class HeadSlice:
    """A tensor-parallel style: the relative-bias table stays whole on every tp rank, which adds the
    bias of its own heads; its gradient is partial over tp and summed there (as a sequence-parallel
    norm's)."""

    def apply(self, module, ctx) -> None:  # the RelativeBias of megalm.models.t5.model
        per = module.table.embedding_dim // ctx.size
        module.heads = (ctx.rank * per, (ctx.rank + 1) * per)
        for p in module.parameters():
            p.sequence_parallel = True


def tp_plan(cfg: T5Config, tp: int, sp: bool) -> List[Tuple[str, object]]:
    """Megatron's layout for both stacks: QKV, the cross-attention's q and [k | v] and the MLP's first
    linear column-parallel, the output projections and second linear row-parallel; the embedding,
    head and loss vocabulary-parallel; a relative-bias table sliced by heads. Under sequence
    parallelism the norms run on sequence shards, the embedding scatters both stacks' inputs, and
    the cross-attention's [k | v] gathers the encoder's shards."""
    rows = cfg.padded_vocab(tp)
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    plan: List[Tuple[str, object]] = [("embed.tok", VocabParallel(rows))]
    if sp:
        plan += [("embed", ScatterSequence())]
    plan += [
        ("blocks.*.attn.qkv", ColumnParallel(segments=(q, kv, kv))),
        ("blocks.*.attn.proj", RowParallel()),
        ("blocks.*.attn.core", TPRandom(uniform=True)),
        ("blocks.*.cross.q", ColumnParallel()),
        ("blocks.*.cross.kv", ColumnParallel(segments=(kv, kv))),
        ("blocks.*.cross.proj", RowParallel()),
        ("blocks.*.cross.core", TPRandom(uniform=True)),
        ("blocks.*.mlp.fc1", ColumnParallel(segments=(f, f) if cfg.activation == "swiglu" else None)),
        ("blocks.*.mlp.fc2", RowParallel()),
        ("enc_bias", HeadSlice()),
        ("dec_bias", HeadSlice()),
    ]
    if sp:
        plan += [(f"blocks.*.{name}", TPRandom()) for name in ("attn.dropout", "cross.dropout", "mlp.dropout")]
        plan += [(name, SequenceParallelParams())
                 for name in ("blocks.*.norm1", "blocks.*.norm2", "blocks.*.norm3", "blocks.*.norm_out", "norm")]
    plan += [("head", ColumnParallel(rows=rows)), ("criterion", VocabParallelLoss(rows))]
    return plan
