"""A mixture of experts' rows, planned for balanced routing (`moe_rows`), and what its layer keeps for backward
(`moe_kept_bytes`, with its input, `_moe_input`). Its all-to-alls are megalm.plan.expert_collectives'."""

from __future__ import annotations

import math
from typing import Dict, Optional

from megalm.plan.shapes import FP32, INT64, _Shape


def moe_rows(tokens: int, experts: int, topk: int, capacity: Optional[float]) -> int:
    """(token, expert) assignments a mixture-of-experts layer runs for `tokens` routed tokens, planned for the
    balanced case: dropless, all tokens x k; with a capacity factor f each expert keeps at most
    ceil(f x tokens x k / E) of its tokens x k / E, so min(tokens x k, E x ceil(f x tokens x k / E)). Under
    expert parallelism each rank also receives this many rows on average (every rank sends its rows out by
    expert; balanced routing spreads them evenly). Real routing moves these figures: an expert favoured by the
    router gets more rows than the mean (the planner does not model the imbalance)."""
    assigned = tokens * topk
    if capacity is None:
        return assigned
    return min(assigned, experts * math.ceil(capacity * assigned / experts))


def _moe_tokens(d: _Shape) -> int:
    """Tokens one rank routes in each MoE layer: its b x s, or under tp its 1/tp share (megalm.parallel.experts
    .split_tokens: the SP shard, or a shard cut from the replicated sequence)."""
    return d.b * d.s // d.t


def _moe_input(d: _Shape) -> float:
    """What a MoE layer keeps of its input (the norm's output, fp32), in bytes for one micro-batch: the
    router's linear saves it (fp32 under autocast too: the router runs with autocast off). Without tp that is
    the norm's output itself; under sp the rank's shard; under tp without sp the shard the layer cuts (a
    contiguous copy, except with one sequence a micro-batch, where the shard is a view that keeps the whole
    (s, h) output alive). With low-precision weights the norm's output is in the compute dtype, and the router's
    fp32 copy of it (of the shard) is what the linear keeps."""
    if d.t > 1 and not d.sp and d.b == 1 and not d.main:
        return d.s * d.h * FP32
    return _moe_tokens(d) * d.h * FP32


def moe_kept_bytes(d: _Shape) -> Dict[str, float]:
    """What a mixture-of-experts layer (megalm.models.moe.MoE._forward, route, Experts; under expert
    parallelism megalm.parallel.experts.dispatch, under expert tensor parallelism run_experts) saves for
    backward besides its input, for one micro-batch on one rank, by part. N tokens routed by the rank
    (`_moe_tokens`), R = `moe_rows` assignments (the balanced case), E experts (E / ep on the rank), k a
    token, f the ffn width; the rows are in the residual stream's dtype (`_Shape.r`, the norm's output): fp32 under
    autocast (grouped_mm has no autocast rule, so the experts run in fp32 under bf16 / fp16 too), the compute
    dtype with low-precision weights.

    router: in fp32 (autocast off), at every precision. Kept: top-k's int64 indices (N k); with low-precision
    weights the router weight's fp32 copy (E h) its linear multiplied with; softmax scoring the
    softmax of the top k (N k); sigmoid scoring the scores (N E) and, for k > 1, the top k and their sum
    (N k + N) of the renormalisation; with the load-balancing loss the softmax probabilities (N E) and the
    expert shares it multiplies them by (E); with the z-loss logsumexp's input and output (N E + N).
    experts: the assignment order and each row's token (R int64 each: the argsort of N k assignments, whose
    first R a capacity keeps, and order // k); the cumulative counts (E int32); fc1's input rows (R h) and
    the activation's tensors (SwiGLU: fc1's output 2f, SiLU's output and the product f each; GELU: fc1's
    output and GELU's; ReLU: its output, fc2's input too); fc2's output (R h, the weighting's input), the
    gathered weights (R) and the weighted rows index_add sums (R h). Under expert parallelism the rows are
    sent to their experts' ranks: the receiver keeps its arrival-to-expert order and its inverse (R int64
    each) and the experts' tensors for the R rows it receives (balanced: as many as it sends); the rows
    come back as a new tensor (R h), which the weighting keeps in place of fc2's output.
    Under expert tensor parallelism (T = parallel.expert_tp = tp) each tp rank runs the rows of all T tp
    ranks (after the ep exchange, if any) through its 1/T slices of the experts: fc1's input is T R rows
    (T R h), the activation's tensors T R rows of width / T (as many bytes as R rows of the whole width),
    and the gathered rows' grouping by expert keeps its order and inverse (T R int64 each); fc2's output is
    not kept (the all-to-all returning each rank its rows' partial sums takes it), and the sum of the
    partials (R h) is what the weighting keeps, or under ep what goes back (the new tensor above).
    dropout: with model.dropout, the MoE output's mask (N h, noise of the rows' dtype on CPU, a bool on CUDA)."""
    N, E, k, h, f = _moe_tokens(d), d.experts, d.topk, d.h, d.f
    R = moe_rows(N, E, k, d.capacity)
    router = N * k * INT64 + (E * h * FP32 if d.main else 0)  # low-precision weights: the router's fp32 copy
    if d.sigmoid:
        router += N * E * FP32 + ((N * k + N) * FP32 if k > 1 else 0)
    else:
        router += N * k * FP32
    if d.aux:
        router += N * E * FP32 + E * FP32
    if d.z:
        router += (N * E + N) * FP32
    width = 4 * f if d.swiglu else (f if d.relu else 2 * f)
    T = d.expert_tp
    # the order and each row's token, the offsets; fc1's input rows, the activation, the weighting's input
    # (fc2's output, or the rows back), the gathered weights; the weighted rows
    experts = N * k * INT64 + R * INT64 + E // d.ep * 4 + (T * R * h + R * (width + h + 1)) * d.r + R * h * d.r
    if d.ep > 1:  # the received rows grouped by expert and back
        experts += 2 * R * INT64
    if T > 1:  # the tp ranks' rows grouped by expert and back
        experts += 2 * T * R * INT64
    dropout = N * h * d.mask(d.r) if d.dropout > 0 else 0.0
    return {"router": router, "experts": experts, "dropout": dropout}
