"""A mixture of experts' collectives of one step on one rank: expert parallelism's all-to-alls of the rows
(`expert_parallel`), expert tensor parallelism's among the tp ranks (`expert_tensor_parallel`) and the experts'
buckets over the ranks holding the same experts (`expert_data_parallel`)."""

from __future__ import annotations

from megalm.plan.group_collectives import Kinds, _add, _replayed_layers
from megalm.plan.layout import RankLayout
from megalm.plan.moe import moe_rows
from megalm.plan.shapes import FP32, held_bytes, local_tokens, microbatches


def moe_row_bytes(cfg, tp: int) -> int:
    """Bytes of one all-to-all of a MoE layer's rows under expert parallelism, for one micro-batch: the `moe_rows`
    (token, expert) rows of the rank's routed tokens (b x s / tp), h each in the residual stream's dtype (fp32, or
    the weights' under main_params: `held_bytes`; the norm's output, the experts' output back). Balanced routing:
    what a rank sends out equals what it receives and sends back. Expert tensor parallelism's all-to-alls send tp
    times this (`expert_tensor_parallel`)."""
    m, t = cfg.model, cfg.trainer
    tokens = t.micro_batch_size * local_tokens(cfg) // tp
    return moe_rows(tokens, m.num_experts, m.moe_router_topk, m.moe_capacity_factor) * m.hidden_size * held_bytes(t)


def _moe_passes(cfg, lay: RankLayout) -> int:
    """Forwards of the rank's MoE layers in a step: each layer once a micro-batch, and again where full
    recomputation replays it (its routing and dispatch come before the layer's last saving op)."""
    layers = sum(lay.stage_layers)
    replayed = _replayed_layers(cfg, lay) if cfg.parallel.recompute == "full" else 0
    return microbatches(cfg, lay.dp) * (layers + replayed)


def expert_parallel(cfg, lay: RankLayout) -> Kinds:
    """The all-to-alls of expert parallelism that count_comm records (megalm.parallel.experts.dispatch, kind
    "all_to_all", bytes: the rows the rank sends): each MoE forward sends its rows to their experts' ranks and
    the experts' outputs back, two a layer and micro-batch (and again where full recomputation replays the
    layer), and its backward sends both gradients back, two more a layer and micro-batch; `moe_row_bytes`
    each. The counts sent before the rows go through torch.distributed directly (`untracked_collectives`)."""
    kinds: Kinds = {}
    if lay.ep == 1:
        return kinds
    calls = 2 * _moe_passes(cfg, lay) + 2 * microbatches(cfg, lay.dp) * sum(lay.stage_layers)
    _add(kinds, "all_to_all", calls, calls * moe_row_bytes(cfg, lay.tp))
    return kinds


def expert_tensor_parallel(cfg, lay: RankLayout) -> Kinds:
    """The all-to-alls of expert tensor parallelism (parallel.expert_tp = tp > 1; megalm.parallel.experts
    .run_experts, kind "all_to_all" over the tp group, bytes: what the rank sends), counted under "tp": in each
    MoE forward (and its replay under full recomputation) a rank sends its rows to every tp rank (tp copies of
    the R = `moe_rows` rows of its tokens, or under ep of the rows it received, as many when balanced) and
    sends each tp rank its rows' partial outputs back (the tp x R rows it ran, h fp32); backward, the two
    gradients go back the same ways; each tp x `moe_row_bytes`. The per-expert counts gathered over tp first
    go through torch.distributed directly (`untracked_collectives`)."""
    kinds: Kinds = {}
    if lay.expert_tp == 1 or not getattr(cfg.model, "num_experts", 0):
        return kinds
    calls = 2 * _moe_passes(cfg, lay) + 2 * microbatches(cfg, lay.dp) * sum(lay.stage_layers)
    _add(kinds, "all_to_all", calls, calls * lay.expert_tp * moe_row_bytes(cfg, lay.tp))
    return kinds


def expert_data_parallel(cfg, lay: RankLayout) -> Kinds:
    """The experts' buckets under expert parallelism (parallel.ep > 1; megalm.parallel.data): gradients of the
    experts a rank holds (tagged ep_shard) are bucketed apart and reduced over the expert-data-parallel group,
    the (dp / ep) x cp ranks holding the same experts (megalm.parallel.experts.expert_groups), each bucket padded
    to a multiple of that size: an all-reduce (ZeRO-0) or a reduce-scatter (ZeRO-1/2/3) of the whole bucket, fp32,
    and ZeRO-1/2's all-gather of each bucket's updated shard after the optimizer step. ZeRO-3 (megalm.parallel.zero3)
    keeps the experts in buckets of their own in each layer's unit, sharded over that group, and gathers them
    over it as `data_parallel` gathers the rest: every micro-batch, in the layer's forward and again in its
    backward. A group of one rank (dp = ep) still issues ZeRO's; ZeRO-0's all-reduce over one rank is skipped
    (megalm.parallel.data). Without expert parallelism experts are ordinary parameters in the dp buckets (under
    expert tensor parallelism, their tp slices). The parameters are gathered in the weights' dtype (`held_bytes`)."""
    kinds: Kinds = {}
    if not lay.expert_buckets:
        return kinds
    z, n = cfg.parallel.zero_stage, len(lay.expert_buckets)
    shards = sum(c for _, c in lay.expert_buckets) * held_bytes(cfg.trainer)
    alone = all(size == shard for size, shard in lay.expert_buckets)  # a group of one rank
    if z > 0 or not alone:
        _add(kinds, "all_reduce" if z == 0 else "reduce_scatter", n, sum(b for b, _ in lay.expert_buckets) * FP32)
    if z in (1, 2):
        _add(kinds, "all_gather", n, shards)
    elif z == 3:
        m = microbatches(cfg, lay.dp)
        _add(kinds, "all_gather", m * (lay.zero3_expert_unit_calls + n),
             m * (sum(lay.zero3_expert_unit_buckets) * held_bytes(cfg.trainer) + shards))
    return kinds
