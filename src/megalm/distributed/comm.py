"""Autograd-aware collectives for tensor and sequence parallelism, each over an explicit group.

Megatron-LM (arXiv:1909.08053, sec. 3) builds every tensor-parallel layer from two conjugate
operators: `f` (identity forward, all-reduce backward) in front of a column-parallel region and
`g` (all-reduce forward, identity backward) behind a row-parallel one. Sequence parallelism
(arXiv:2205.05198, sec. 4.2.2) replaces each all-reduce by a reduce-scatter plus an all-gather
along the sequence, which move the same bytes but leave the activations between the regions
sharded by sequence. The conjugate pairs here:

    copy_to_tp         identity      | all-reduce          (f)
    reduce_from_tp     all-reduce    | identity            (g)
    gather_last_dim    all-gather    | split               (column output → replicated)
    scatter_last_dim   split         | all-gather
    gather_seq         all-gather    | reduce-scatter      (SP: g-bar of the paper)
    reduce_scatter_seq reduce-scatter| all-gather          (SP: g of the paper)
    scatter_seq        split         | all-gather

A group of size 1, or None, makes every one of them the identity (the input object returned),
so tp=1 runs the serial code exactly. `count_comm()` records what goes over the wire;
`time_comm(clock)` times it for the step-time breakdown (megalm.training.step_time).

Inside a graph torch.compile traces (trainer.compile), the tensor-parallel operators issue PyTorch's
functional collectives instead, which dynamo records in the graph rather than breaking it around each
call; there nothing is counted or timed (a trace runs once, its graph many times).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

# Newer torch renamed the *_tensor collectives; use whichever this build has, without warnings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------
# Communication accounting
# ---------------------------------------------------------------------------------------------

@dataclass
class CommStats:
    """Collectives issued through this module while a `count_comm()` block is open.

    bytes[kind] is the message each rank contributes, the figure an algorithm's cost is quoted in:
    all_reduce → the full tensor, all_gather → the local input, reduce_scatter → the full input;
    send / recv (the pipeline's point-to-point messages, `record_p2p`) → the tensor sent or received.
    """
    calls: Dict[str, int] = field(default_factory=dict)
    bytes: Dict[str, int] = field(default_factory=dict)
    events: List[Tuple[str, int]] = field(default_factory=list)  # (kind, bytes) in issue order
    seconds: float = 0.0  # wall time inside the collectives (blocking on CPU/gloo)
    active: bool = True

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.events.append((kind, nbytes))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


_STATS: contextvars.ContextVar[Optional[CommStats]] = contextvars.ContextVar("megalm_comm_stats", default=None)


def _open_stats() -> Optional[CommStats]:
    """The open count_comm() block's stats; None inside a compiled trace (dynamo cannot read contextvars)."""
    return None if torch.compiler.is_compiling() else _STATS.get()


@contextlib.contextmanager
def count_comm() -> Iterator[CommStats]:
    """with count_comm() as stats: ... — record every collective of this module inside the block."""
    stats = CommStats()
    token = _STATS.set(stats)
    try:
        yield stats
    finally:
        stats.active = False
        _STATS.reset(token)


P2P_KINDS = ("send", "recv")


def record_p2p(kind: str, tensor: Tensor) -> None:
    """Count one point-to-point message of `tensor` ("send" or "recv") in the open count_comm()
    block, if any; nothing otherwise. For messages another library issues (the pipeline schedules
    of torch.distributed.pipelining post their own isend / irecv), so no time is recorded."""
    if kind not in P2P_KINDS:
        raise ValueError(f"record_p2p kind {kind!r}: use one of {P2P_KINDS}")
    stats = _STATS.get()
    if stats is not None:
        stats.record(kind, _nbytes(tensor))


class CommClock:
    """Wall time of this process's collectives while `time_comm(clock)` is open (one training step).

    `blocked`: seconds the calling thread spent inside collective calls and waiting on the handles
    of asynchronous ones (communication not overlapped with compute); `blocked_by`: the same by kind
    (all_reduce, all_gather, reduce_scatter, all_to_all), summing to `blocked`. `spans`: each collective's
    [start, end] in flight: a synchronous call's own interval; an asynchronous one from its launch
    until it completed (gloo: its future's callback; otherwise when its wait returned; None while
    unknown). On CUDA both are host times (NCCL returns at once): the breakdown leaves them out there.
    """

    def __init__(self):
        self.blocked = 0.0
        self.blocked_by: Dict[str, float] = {}
        self.spans: List[List[Optional[float]]] = []

    def reset(self) -> None:
        self.blocked, self.blocked_by, self.spans = 0.0, {}, []

    def add_blocked(self, kind: str, seconds: float) -> None:
        self.blocked += seconds
        self.blocked_by[kind] = self.blocked_by.get(kind, 0.0) + seconds

    def in_flight(self, start: float, stop: float) -> float:
        """Seconds in [start, stop] during which at least one collective was in flight (spans
        that overlap, such as two gradient buckets on the wire at once, count once)."""
        total, reach = 0.0, start
        for lo, hi in sorted((max(lo, start), min(stop if hi is None else hi, stop)) for lo, hi in self.spans):
            if hi > reach and hi > lo:
                total += hi - max(lo, reach)
                reach = hi
        return total


_CLOCK: Optional[CommClock] = None  # per process, so autograd's worker threads see it too


@contextlib.contextmanager
def time_comm(clock: CommClock) -> Iterator[CommClock]:
    """with time_comm(clock): ... — add the wall time of every collective of this module to clock."""
    global _CLOCK
    previous, _CLOCK = _CLOCK, clock
    try:
        yield clock
    finally:
        _CLOCK = previous


def _ended(span: List[Optional[float]]) -> None:
    if span[1] is None:
        span[1] = time.perf_counter()


class _TimedWork:
    """An asynchronous collective's handle whose wait() counts as blocked time on its CommClock."""

    def __init__(self, work, span: List[Optional[float]], clock: CommClock, kind: str):
        self.work, self.span, self.clock, self.kind = work, span, clock, kind
        try:  # gloo completes the future on its own thread: the true end of the transfer
            work.get_future().add_done_callback(lambda _future: _ended(span))
        except (AttributeError, RuntimeError):
            pass  # no future on this backend: the span ends when the wait returns

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock.add_blocked(self.kind, time.perf_counter() - t0)
            _ended(self.span)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def _record(kind: str, nbytes: int, fallback: Optional[CommStats] = None, async_op: bool = False):
    """Count the collective issued inside the block, and the time it takes (on CUDA the time
    is only the launch, since NCCL is asynchronous: use a profiler there). Yields the span an
    open `time_comm` clock got for it (None when none is open)."""
    # Backward may run on an autograd worker thread (CUDA graphs) that does not see the caller's
    # contextvars; then the block that was open at forward time, if still open, gets the record.
    stats = _STATS.get()
    if stats is None and fallback is not None and fallback.active:
        stats = fallback
    clock = _CLOCK
    if stats is None and clock is None:
        yield None
        return
    if stats is not None:
        stats.record(kind, nbytes)
    t0 = time.perf_counter()
    span = [t0, None] if clock is not None else None
    try:
        yield span
    finally:
        t1 = time.perf_counter()
        if stats is not None:
            stats.seconds += t1 - t0
        if clock is not None:
            clock.add_blocked(kind, t1 - t0)
            if not async_op:
                span[1] = t1
            clock.spans.append(span)


def _handle(work, span, async_op: bool, kind: str):
    """An asynchronous collective's handle, timed (as `kind`) when a `time_comm` clock is open."""
    return _TimedWork(work, span, _CLOCK, kind) if async_op and span is not None and _CLOCK is not None else work


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


# ---------------------------------------------------------------------------------------------
# Raw collectives (no autograd)
# ---------------------------------------------------------------------------------------------

def group_size(group) -> int:
    """Ranks in `group`; None means "no tensor parallelism" (1), not the world."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: Tensor, dim: int, world: int, what: str) -> None:
    if x.shape[dim] % world:
        raise ValueError(f"{what}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) is not "
                         f"divisible by the tensor-parallel group size {world}")


def _all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM, stats=None) -> Tensor:
    # Out of place: the input may be saved by another node or be a gradient autograd hands to
    # several consumers, so it must not change under them.
    if torch.compiler.is_compiling():
        if op != dist.ReduceOp.SUM and op != dist.ReduceOp.MAX:
            raise ValueError(f"_all_reduce in a compiled graph takes ReduceOp SUM or MAX, not {op}")
        return funcol.all_reduce(x, "sum" if op == dist.ReduceOp.SUM else "max", group)
    out = x.clone(memory_format=torch.contiguous_format)
    with _record("all_reduce", _nbytes(out), stats):
        dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather(x: Tensor, group, dim: int, stats=None) -> Tensor:
    world = group_size(group)
    # all_gather_single concatenates along dim 0; move `dim` there and back.
    xt = x.movedim(dim, 0).contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(xt, 0, group).movedim(0, dim).contiguous()
    out = torch.empty((world * xt.shape[0],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    with _record("all_gather", _nbytes(xt), stats):
        _all_gather_single(out, xt, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_via_all_reduce(xt: Tensor, group) -> Tensor:
    """Reduce-scatter along dim 0 as all-reduce + own chunk, for backends without the native op.

    This moves ~2x the bytes of a real reduce-scatter (ring: (p-1)/p of the input vs 2(p-1)/p),
    but the accounting records it as the reduce-scatter it stands for, so volumes stay comparable
    with what NCCL would do.
    """
    full = xt.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(full, group=group)
    return full.chunk(group_size(group), dim=0)[group_rank(group)].contiguous()


def _reduce_scatter(x: Tensor, group, dim: int, stats=None) -> Tensor:
    world = group_size(group)
    xt = x.movedim(dim, 0).contiguous()
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(xt, "sum", 0, group).movedim(0, dim).contiguous()
    out = torch.empty((xt.shape[0] // world,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    with _record("reduce_scatter", _nbytes(xt), stats):
        try:
            _reduce_scatter_single(out, xt, group=group)
        except (RuntimeError, NotImplementedError) as e:
            # Older gloo builds on CPU have no reduce_scatter; anything else is a real failure.
            if "support" not in str(e).lower():
                raise
            out = _reduce_scatter_via_all_reduce(xt, group)
    return out.movedim(0, dim).contiguous()


def _own_chunk(x: Tensor, group, dim: int) -> Tensor:
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def open_stats() -> Optional[CommStats]:
    """The count_comm() record open now (None outside one, or inside a compiled graph): an autograd function keeps
    it to count its backward's collectives there."""
    return _open_stats()


def all_gather_dim(x: Tensor, group, dim: int, stats: Optional[CommStats] = None) -> Tensor:
    """Every rank's x concatenated along `dim` in rank order (no autograd): the building block of an autograd
    function that gathers in its own forward or backward (counted in `stats`, else the open record)."""
    return _all_gather(x, group, dim, stats)


def reduce_scatter_dim(x: Tensor, group, dim: int, stats: Optional[CommStats] = None) -> Tensor:
    """x summed over the group, this rank's chunk of `dim` kept (no autograd); see `all_gather_dim`."""
    return _reduce_scatter(x, group, dim, stats)


def all_reduce_max(x: Tensor, group) -> Tensor:
    """Element-wise max over the group, in place on x (no autograd); returns x."""
    if group_size(group) > 1:
        if torch.compiler.is_compiling():
            return x.copy_(funcol.all_reduce(x, "max", group))
        with _record("all_reduce", _nbytes(x)):
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """Element-wise sum over the group, in place on x (no autograd); returns x."""
    if group_size(group) > 1:
        if torch.compiler.is_compiling():
            return x.copy_(funcol.all_reduce(x, "sum", group))
        with _record("all_reduce", _nbytes(x)):
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


# ---------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    # f: every rank consumes the same x through its own weight shard, so dL/dx is the sum of the
    # ranks' partial gradients.
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.stats = group, _open_stats()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, stats=ctx.stats), None


class _ReduceFromTP(torch.autograd.Function):
    # g: the ranks' partial sums add up to the output; each partial gets the whole gradient.
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherDim(torch.autograd.Function):
    # All-gather forward; the consumer is replicated, so each rank's gradient slice is its own.
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.group, ctx.dim), None, None


class _ScatterDim(torch.autograd.Function):
    # Take this rank's chunk (no comm); the gradient of the whole is the gathered chunk grads.
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.stats = group, dim, _open_stats()
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim, stats=ctx.stats), None, None


class _GatherSeq(torch.autograd.Function):
    # SP entry to a column-parallel region: gather the sequence; every rank's weight shard
    # produces a partial dL/dx for the whole sequence, which is summed and re-split by sequence.
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.stats = group, dim, _open_stats()
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim, stats=ctx.stats), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    # SP exit of a row-parallel region: sum the partial outputs, keep this rank's sequence chunk;
    # the gradient of the full partial output is the gathered gradient of the chunks.
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.stats = group, dim, _open_stats()
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim, stats=ctx.stats), None, None


# ---------------------------------------------------------------------------------------------
# Public operators
# ---------------------------------------------------------------------------------------------

def copy_to_tp(x: Tensor, group) -> Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group) -> Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_last_dim(x: Tensor, group) -> Tensor:
    """(..., n) shards → (..., n * tp) in rank order; backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherDim.apply(x, group, x.dim() - 1)


def scatter_last_dim(x: Tensor, group) -> Tensor:
    """(..., n) → this rank's (..., n / tp); backward all-gathers."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, x.dim() - 1, world, "scatter_last_dim")
    return _ScatterDim.apply(x, group, x.dim() - 1)


def gather_seq(x: Tensor, group, dim: int = 1) -> Tensor:
    """SP: (B, T/tp, h) → (B, T, h) by all-gather; backward reduce-scatters the gradient."""
    return x if group_size(group) == 1 else _GatherSeq.apply(x, group, dim % x.dim())


def gather_seq_replicated(x: Tensor, group, dim: int = 1) -> Tensor:
    """SP exit to a replicated consumer (a pooler reading token 0): (B, T/tp, h) → (B, T, h) by
    all-gather; every rank then computes the same gradient, so backward keeps this rank's chunk."""
    return x if group_size(group) == 1 else _GatherDim.apply(x, group, dim % x.dim())


def reduce_scatter_seq(x: Tensor, group, dim: int = 1) -> Tensor:
    """SP: partial (B, T, h) → summed (B, T/tp, h) chunk; backward all-gathers the gradient."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "reduce_scatter_seq")
    return _ReduceScatterSeq.apply(x, group, dim % x.dim())


def scatter_seq(x: Tensor, group, dim: int = 1) -> Tensor:
    """SP: replicated (B, T, h) → this rank's (B, T/tp, h) (no comm); backward all-gathers."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "scatter_seq")
    return _ScatterDim.apply(x, group, dim % x.dim())
