"""Collectives a caller overlaps with its own compute: data parallelism's flat-buffer ones (gradient buckets, ZeRO
shards; `bucket_*`, asynchronous on request) and the pieces of parallel.tp_comm_overlap (`start_all_gather`,
`start_reduce_scatter`, always in the background). No autograd; counted and timed as megalm.distributed.comm's
(`count_comm`, `time_comm`: a handle's wait() is blocked time, its transfer time in flight until it completes).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megalm.distributed.comm import (CommStats, _all_gather_single, _handle, _nbytes, _record, _reduce_scatter_single,
                                     group_size)


class Pending:
    """A collective started in the background (`start_all_gather`, `start_reduce_scatter`): wait() returns its
    result, after which the caller may read it (under `time_comm` the wait counts as blocked time)."""

    def __init__(self, work, result: Callable[[], Tensor]):
        self._work, self._result = work, result

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result()


def start_all_gather(x: Tensor, group, dim: int, stats: Optional[CommStats] = None) -> Pending:
    """`all_gather_dim` started in the background: the caller computes while it moves, then waits for it."""
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((group_size(group) * xt.shape[0],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    with _record("all_gather", _nbytes(xt), stats, async_op=True) as span:
        work = _all_gather_single(out, xt, group=group, async_op=True)
    return Pending(_handle(work, span, True, "all_gather"), lambda: out.movedim(0, dim).contiguous())


def start_reduce_scatter(x: Tensor, group, dim: int, stats: Optional[CommStats] = None) -> Pending:
    """`reduce_scatter_dim` started in the background: the caller computes while it moves, then waits for it."""
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((xt.shape[0] // group_size(group),) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    with _record("reduce_scatter", _nbytes(xt), stats, async_op=True) as span:
        work = _reduce_scatter_single(out, xt, group=group, async_op=True)
    return Pending(_handle(work, span, True, "reduce_scatter"), lambda: out.movedim(0, dim).contiguous())


# Flat-buffer collectives of data parallelism (gradient buckets, ZeRO shards). With async_op the
# work handle is returned; its time is then not inside `seconds` (the caller waits for it), and
# under `time_comm` the handle's wait() counts as blocked time.

def bucket_all_reduce(x: Tensor, group, async_op: bool = False):
    """Sum x over the group in place."""
    with _record("all_reduce", _nbytes(x), async_op=async_op) as span:
        work = dist.all_reduce(x, group=group, async_op=async_op)
    return _handle(work, span, async_op, "all_reduce")


def bucket_reduce_scatter(out: Tensor, x: Tensor, group, async_op: bool = False):
    """Sum the flat x over the group; this rank keeps chunk `rank` of it in out (x.numel() / world)."""
    with _record("reduce_scatter", _nbytes(x), async_op=async_op) as span:
        work = _reduce_scatter_single(out, x, group=group, async_op=async_op)
    return _handle(work, span, async_op, "reduce_scatter")


def bucket_all_gather(out: Tensor, x: Tensor, group, async_op: bool = False):
    """Concatenate every rank's flat x into out, in rank order."""
    with _record("all_gather", _nbytes(x), async_op=async_op) as span:
        work = _all_gather_single(out, x, group=group, async_op=async_op)
    return _handle(work, span, async_op, "all_gather")
