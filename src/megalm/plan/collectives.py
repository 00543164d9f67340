"""One optimizer step's collectives on one rank, by purpose (`step_collectives`): each group's
(megalm.plan.group_collectives, megalm.plan.expert_collectives) and those issued through torch.distributed
directly, which count_comm does not see (`untracked_collectives`); `by_kind` sums them per kind."""

from __future__ import annotations

from typing import Dict, Optional

from megalm.plan.expert_collectives import _moe_passes, expert_data_parallel, expert_parallel, expert_tensor_parallel
from megalm.plan.group_collectives import (Kinds, _add, context_parallel, data_parallel, embedding, other, pipeline,
                                           tensor_parallel)
from megalm.plan.layout import RankLayout, rank_layout
from megalm.plan.shapes import FP32, INT64, encoder, microbatches

PURPOSES = ("tp", "cp", "ep", "pp", "dp", "edp", "embedding", "other")
Collectives = Dict[str, Kinds]           # {purpose: Kinds}


def model_metrics(cfg) -> int:
    """Values the model logs beside its loss (its `metric_names`): BERT's pretraining heads lm_loss and
    mlm_acc, and with the binary head sop_loss and sop_acc; a GPT language model none."""
    m = cfg.model
    return (2 + 2 * bool(m.binary_head)) if encoder(m) else 0


def _untracked(cfg, lay: RankLayout) -> Collectives:
    """`untracked_collectives` by purpose: "other", BERT's accuracy over tp under "tp", a mixture's routing
    counts over its token group under "tp" (or "cp" without tp), the all-to-all of its counts under "ep" and,
    under expert tensor parallelism, the all-gather of its per-expert counts under "tp"."""
    k = model_metrics(cfg)
    out: Collectives = {"tp": {}, "cp": {}, "ep": {}, "other": {}}
    experts = getattr(cfg.model, "num_experts", 0)
    if experts:
        passes = _moe_passes(cfg, lay)
        if lay.tp > 1 or lay.cp > 1:  # each layer's counts summed over the ranks sharing a micro-batch's tokens
            _add(out["tp" if lay.tp > 1 else "cp"], "all_reduce", passes, passes * experts * FP32)
        if lay.ep > 1:  # the counts before the rows
            _add(out["ep"], "all_to_all", passes, passes * experts * INT64)
        if lay.expert_tp > 1:  # the counts of the rank's (E / ep) experts, gathered over tp before the rows
            _add(out["tp"], "all_gather", passes, passes * experts // lay.ep * INT64)
        # the step's routing report (trainer._moe_report): float64 sums (4 + E) and the largest load, over
        # pp, tp, cp and dp, each group of more than one rank
        for size in (lay.pp, lay.tp, lay.cp, lay.dp):
            if size > 1:
                _add(out["other"], "all_reduce", 2, (4 + experts + 1) * INT64)
    if lay.pp > 1:
        _add(out["other"], "broadcast", 1, (1 + k) * FP32)
    if lay.replicas > 1:
        _add(out["other"], "all_reduce", 1, FP32)
        _add(out["other"], "all_reduce", 1 if k else 0, k * FP32)
    if cfg.trainer.precision == "fp16" and lay.tp * lay.pp * lay.replicas > 1:
        _add(out["other"], "all_reduce", 1, FP32)
    if encoder(cfg.model) and lay.tp > 1 and lay.last:
        m = microbatches(cfg, lay.dp)
        tokens = cfg.trainer.micro_batch_size * cfg.model.seq_length
        _add(out["tp"], "all_reduce", 2 * m, 2 * m * tokens * FP32)
    return out


def untracked_collectives(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0,
                          cp_rank: int = 0) -> Kinds:
    """The collectives issued through torch.distributed directly, which count_comm does not see: the
    pipeline's mean loss broadcast from the last stage (Pipeline._share: one fp32, and one for each of
    the model's metrics, `model_metrics`), the logged loss averaged over the replicas, dp or dp x cp
    (trainer: grads.mean_over, one fp32) and the metrics in another all-reduce, under fp16 the overflow
    vote over every rank (DynamicLossScaler, one fp32); and BERT's MLM accuracy under tp
    (VocabParallelLMLoss.correct: the largest logit's max and the label's logit summed over tp, (b, s)
    fp32 each, a micro-batch). A mixture of experts adds, each MoE layer's forward (and its replay under full
    recomputation): the routing counts (E fp32) summed over the ranks sharing the micro-batch's tokens (tp
    and / or cp: megalm.models.moe's token_group), under expert parallelism the counts' all-to-all (E int64;
    bytes are what a rank sends, as for the rows), under expert tensor parallelism the counts of the rank's
    E / ep experts all-gathered over tp (megalm.parallel.experts.run_experts: E / ep int64, the input); and once
    a step the trainer's routing report, two float64 all-reduces (4 + E values, and the largest load) over each
    of pp, tp, cp and dp that has more than one rank. In step_collectives they count under "tp" (the accuracy;
    the counts under tp; expert tp's gather), "cp" (the counts under cp alone), "ep" (the counts' all-to-all)
    and "other" (the rest)."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    kinds: Kinds = {}
    for entries in _untracked(cfg, lay).values():
        for kind, e in entries.items():
            _add(kinds, kind, e["calls"], e["bytes"])
    return kinds


def step_collectives(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0,
                      cp_rank: int = 0) -> Collectives:
    """The collectives one optimizer step (all its micro-batches) issues on the rank at (pp_rank,
    dp_rank, cp_rank, tp_rank), by purpose: {"tp", "cp", "ep", "pp", "dp", "edp", "embedding", "other"} ->
    {kind: {"calls", "bytes"}}, kinds all_reduce, all_gather, reduce_scatter, send, recv, broadcast, the cp
    ring's sends, ring, and a mixture's all_to_all (ep: the rows to and from the experts' ranks; tp: expert
    tensor parallelism's rows among the tp ranks; edp: the experts' buckets). dp_rank and cp_rank matter only
    for ZeRO's padding, which the last replica's shard holds (replica dp_rank x cp + cp_rank). `cfg` is the
    composed Config (megalm.plan.compose); "other" includes `untracked_collectives`."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    out = {"tp": tensor_parallel(cfg, lay), "cp": context_parallel(cfg, lay), "ep": expert_parallel(cfg, lay),
           "pp": pipeline(cfg, lay), "dp": data_parallel(cfg, lay), "edp": expert_data_parallel(cfg, lay),
           "embedding": embedding(cfg, lay), "other": other(cfg, lay)}
    for kind, e in expert_tensor_parallel(cfg, lay).items():
        _add(out["tp"], kind, e["calls"], e["bytes"])
    for purpose, entries in _untracked(cfg, lay).items():
        for kind, e in entries.items():
            _add(out[purpose], kind, e["calls"], e["bytes"])
    return out


def by_kind(collectives: Collectives, minus: Optional[Kinds] = None) -> Kinds:
    """Calls and bytes per kind over every purpose, less `minus` (e.g. untracked_collectives: what
    count_comm() then records); kinds left with no call are dropped."""
    total: Kinds = {}
    for kinds in collectives.values():
        for kind, e in kinds.items():
            _add(total, kind, e["calls"], e["bytes"])
    for kind, e in (minus or {}).items():
        left = total.get(kind, {"calls": 0, "bytes": 0})
        total[kind] = {"calls": left["calls"] - e["calls"], "bytes": left["bytes"] - e["bytes"]}
    return {k: e for k, e in total.items() if e["calls"]}
