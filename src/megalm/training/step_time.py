"""Where a training step's time goes: data wait, forward, backward, optimizer, collectives, pipeline idle.

The trainer marks where each phase of a step begins (`StepTimer.phase`); the time up to the next
mark goes to that phase. A record is the mean per step over the steps since the last one, in
seconds, of this rank (rank 0 writes metrics.jsonl):

    time_step_s            the whole train_step: from fetching the batch to the logged loss
    time_data_s            getting the step's micro-batches from the loader onto the device
    time_forward_s         the micro-batches' forward passes and losses        (no pipeline)
    time_backward_s        their backward passes, which launch the dp buckets   (no pipeline)
    time_compute_s         the stages' forward / backward / weight-gradient chunks and the loss
                           inside the pipeline schedule: they interleave, so one figure   (pp > 1)
    time_pipeline_idle_s   the rest of the schedule's step: waiting on sends and receives (the
                           bubble), the schedule's own work, the loss broadcast            (pp > 1)
    time_optimizer_s       finishing the gradient reduction, loss-scale check, clipping, the
                           update (with ZeRO's parameter all-gather), zeroing gradients
    time_other_s           the remainder: time_step_s minus the parts above, which never overlap
    time_comm_s            time with a collective of megalm.distributed.comm in flight (async
                           gradient buckets from launch to completion; overlapping ones once; an
                           async one without a completion callback, as gloo's reduce-scatter,
                           until its wait returns: an upper bound)
    time_comm_exposed_s    the part of it this rank was blocked: synchronous collectives and
                           waits on async handles (on CPU / gloo, without dp, it equals time_comm_s)
    time_comm_exposed_KIND_s  time_comm_exposed_s by kind of collective (all_reduce, all_gather,
                           reduce_scatter, all_to_all), for each kind the steps waited on; they sum
                           to time_comm_exposed_s. Data parallelism's are its gradient buckets'
                           (all_reduce at ZeRO-0, reduce_scatter at ZeRO 1-3) and ZeRO's parameter
                           all_gather; tensor parallelism's sit in the same kinds

The comm figures are not parts beside the others: they lie inside the phases (tp collectives in
forward and backward, dp waits in optimizer). The pipeline schedule's own sends and receives are
posted by torch.distributed.pipelining, not through megalm.distributed.comm: their waits are in
time_pipeline_idle_s. On CUDA the device is synchronized at every phase boundary (and around each
pipeline chunk) so host clocks see the device's time; collectives return at once there, so the
comm figures are left out: use trainer.profile_steps for a trace.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, Optional

import torch

from megalm.distributed.comm import CommClock, time_comm

PARTS = ("data", "forward", "backward", "compute", "pipeline_idle", "optimizer")


class StepTimer:
    """Phase marks over training steps; `report()` gives the mean seconds per step since the last one."""

    def __init__(self, device: torch.device, pipeline=None):
        cuda = device.type == "cuda"
        self.sync: Optional[Callable[[], None]] = torch.cuda.synchronize if cuda else None
        self.comm: Optional[CommClock] = None if cuda else CommClock()
        self.pipelined = pipeline is not None
        self.totals: Dict[str, float] = {}
        self.exposed_by: Dict[str, float] = {}  # comm_exposed by kind of collective
        self.steps = 0
        self._phase: Optional[str] = None
        self._mark = 0.0
        self._chunks = 0.0   # seconds inside pipeline compute chunks, this pipeline phase
        self._depth = 0      # nesting of timed chunks (only the outermost counts)
        self._reset()
        if pipeline is not None:
            time_pipeline_compute(pipeline, self)

    def _reset(self) -> None:
        names = ("step", "data") + (("compute", "pipeline_idle") if self.pipelined else ("forward", "backward"))
        self.totals = dict.fromkeys(names + ("optimizer", "comm", "comm_exposed"), 0.0)
        self.exposed_by = {}
        self.steps = 0

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step; its time counts once the block ends without an exception."""
        start = self._mark = self._now()
        self._phase = "other"
        clock = self.comm
        if clock is not None:
            clock.reset()
        with time_comm(clock) if clock is not None else contextlib.nullcontext():
            yield
        self.phase("other")
        stop = self._mark
        self.totals["step"] += stop - start
        if clock is not None:
            self.totals["comm"] += clock.in_flight(start, stop)
            self.totals["comm_exposed"] += min(clock.blocked, stop - start)
            share = min(1.0, (stop - start) / clock.blocked) if clock.blocked > 0 else 1.0  # as the total is capped
            for kind, seconds in clock.blocked_by.items():
                self.exposed_by[kind] = self.exposed_by.get(kind, 0.0) + seconds * share
        self.steps += 1

    def phase(self, name: str) -> None:
        """From now on the step's time goes to `name` (one of PARTS, "pipeline", or "other")."""
        now = self._now()
        spent, self._mark = now - self._mark, now
        if self._phase == "pipeline":  # the schedule's step: its compute chunks, the rest idle
            compute = min(self._chunks, spent)
            self.totals["compute"] += compute
            self.totals["pipeline_idle"] += spent - compute
        elif self._phase != "other":
            self.totals[self._phase] += spent
        self._phase, self._chunks = name, 0.0

    def timed_chunk(self, fn: Callable) -> Callable:
        """fn, adding its seconds to the pipeline phase's compute (the outermost call of nested ones)."""
        def chunk(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = self._now()
            try:
                return fn(*args, **kwargs)
            finally:
                self._chunks += self._now() - t0
                self._depth -= 1
        return chunk

    def report(self) -> Dict[str, float]:
        """Mean seconds per step of each part since the last report (empty when no step ran)."""
        if not self.steps:
            return {}
        t, n = self.totals, self.steps
        out = {"time_step_s": t["step"] / n}
        parts = [k for k in t if k not in ("step", "comm", "comm_exposed")]
        for k in parts:
            out[f"time_{k}_s"] = t[k] / n
        out["time_other_s"] = max(0.0, (t["step"] - sum(t[k] for k in parts)) / n)
        if self.comm is not None:
            out["time_comm_s"], out["time_comm_exposed_s"] = t["comm"] / n, t["comm_exposed"] / n
            for kind in sorted(self.exposed_by):
                out[f"time_comm_exposed_{kind}_s"] = self.exposed_by[kind] / n
        self._reset()
        return out


class NoTimer:
    """trainer.time_breakdown=false: the same calls, doing nothing."""

    def step(self):
        return contextlib.nullcontext()

    def phase(self, name: str) -> None:
        pass

    def report(self) -> Dict[str, float]:
        return {}


def time_pipeline_compute(pipeline, timer: StepTimer) -> None:
    """Time the compute calls the schedule makes on this rank's stages, as scripts/bench_pp.py
    measures a pipeline's busy time: each stage's forward, backward and weight-gradient chunk, and
    the last stage's loss (which the schedule computes outside the forward chunk). Wrapped on the
    instances, which the schedule calls by name."""
    for stage in pipeline.stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            if hasattr(stage, name):
                setattr(stage, name, timer.timed_chunk(getattr(stage, name)))
    schedule = pipeline.schedule
    if hasattr(schedule, "_compute_loss"):
        schedule._compute_loss = timer.timed_chunk(schedule._compute_loss)


def describe(record: Dict[str, float]) -> str:
    """The breakdown of a metrics record as one log phrase: shares of the step's time."""
    step = record.get("time_step_s")
    if not step:
        return ""
    shown = [f"{k[5:-2].replace('_', ' ')} {100 * record[k] / step:.0f}%" for k in
             ("time_data_s", "time_forward_s", "time_backward_s", "time_compute_s", "time_pipeline_idle_s",
              "time_optimizer_s", "time_other_s") if k in record]
    text = f"{step * 1e3:.1f} ms/step: {', '.join(shown)}"
    if "time_comm_s" in record:
        kinds = [(k[len("time_comm_exposed_"):-2], v) for k, v in record.items()
                 if k.startswith("time_comm_exposed_") and k != "time_comm_exposed_s" and v > 0]
        by_kind = "".join(f", {kind} {100 * v / step:.0f}%" for kind, v in sorted(kinds, key=lambda kv: -kv[1]))
        text += (f"; collectives {100 * record['time_comm_s'] / step:.0f}% "
                 f"(exposed {100 * record['time_comm_exposed_s'] / step:.0f}%{by_kind})")
    return text
