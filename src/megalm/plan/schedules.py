"""Pipeline schedules: the order each rank runs its actions in (`schedule_order`: torch's own `pipeline_order` for
the multi-stage schedules; `schedule_actions`, in a rank's own stage numbering), the stages each rank runs, and
an event simulation of that order with per-action times (`simulate`), which gives the bubble (`compute_bubble`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megalm.errors import ConfigError
from megalm.parallel.stages import MULTI_STAGE, stage_layer_ranges, virtual_stages_of
from megalm.plan.flops import StageWork, stage_work
from megalm.plan.traffic import Traffic, stage_traffic


Action = Tuple[str, int, int]  # (kind: F forward | B backward | I input gradient | W weight gradient, stage, micro-batch)


@functools.lru_cache(maxsize=256)
def schedule_order(schedule: str, pp: int, vpp: int, m: int) -> Dict[int, List[Action]]:
    """The actions each pipeline rank runs in one step, in its order.

    GPipe (Huang et al. 2019): every forward, then every backward. 1F1B (PipeDream-Flush, Narayanan et al.
    2021, arXiv:2104.04473 sec. 2.2.1): rank r runs min(m, pp - r) forwards, then alternates one backward
    and one forward, then the remaining backwards; torch.distributed.pipelining runs these two the same
    way. The multi-stage schedules (interleaved 1F1B, interleaved zero bubble, ZBV) take the order torch's
    own classes compute (their `pipeline_order`), built over a fake process group, so the plan follows
    the schedule a run executes.
    """
    if schedule == "gpipe":
        return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)}
    if schedule == "1f1b":
        order = {}
        for r in range(pp):
            warm = min(m, pp - r)
            acts: List[Action] = [("F", r, i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                acts.append(("B", r, b))
                b += 1
                if f < m:
                    acts.append(("F", r, f))
                    f += 1
            order[r] = acts
        return order
    if schedule in MULTI_STAGE:
        return _torch_order(schedule, pp, vpp, m)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _torch_order(schedule: str, pp: int, vpp: int, m: int) -> Dict[int, List[Action]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining as pl
    from torch.testing._internal.distributed.fake_pg import FakeStore
    cls = {"interleaved_1f1b": pl.ScheduleInterleaved1F1B, "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
           "zbv": pl.ScheduleZBVZeroBubble}[schedule]
    v = 2 if schedule == "zbv" else vpp
    if dist.is_initialized():
        raise RuntimeError("schedule_order builds the schedule over a fake process group of its own: "
                           "call it where no process group is initialised (megalm.plan, not inside a run)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [pl.PipelineStage(nn.Identity(), s, pp * v, torch.device("cpu"), group=dist.group.WORLD)
                  for s in virtual_stages_of(0, pp, v, schedule)]
        sched = cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())
        order = sched.pipeline_order
    finally:
        dist.destroy_process_group()
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
             "BACKWARD_WEIGHT": "W", "FORWARD": "F"}
    out: Dict[int, List[Action]] = {}
    for rank, acts in order.items():
        seq = []
        for a in acts:
            if a is None:
                continue
            kind = kinds.get(str(a.computation_type).split(".")[-1])
            if kind is None:
                kind = kinds.get(str(a.computation_type))
            if kind is None:
                continue  # communication or gradient-reduction markers
            seq.append((kind, int(a.stage_index), int(a.microbatch_index)))
        out[int(rank)] = seq
    return out


def schedule_actions(schedule: str, pp: int, rank: int, v: int, m: int) -> List[Tuple[str, int, int]]:
    """The compute actions pipeline rank `rank` runs in one step, in order, each as (kind, local
    stage k, micro-batch): `schedule_order`'s actions of that rank, its stages numbered in its own order.

    With stages of equal size the forwards alive at the peak (in virtual-stage units; divide by v for
    whole-rank micro-batches) come out as: gpipe m; 1f1b min(pp - rank, m); interleaved_1f1b
    min((v - 1) * R + 2 * (pp - 1 - rank) + 1, m * v) with R = m / max(1, m // pp) micro-batches a
    round (Megatron's (pp - rank - 1) * 2 + (v - 1) * pp warm-up plus the forward of the first 1F1B
    step, arXiv:2104.04473 sec. 2.2); interleaved_zb min((v - 1) * R + pp, m * v), the same for every
    rank (its warm-up is shorter by pp - 1 - rank, its weight passes trail by rank); zbv
    min(2 * pp, m + 1 + rank). A zero-bubble forward stays alive until its weight pass."""
    if schedule not in ("gpipe", "1f1b", *MULTI_STAGE):
        raise ConfigError(f"parallel.pipeline_schedule={schedule} is not one of gpipe, 1f1b, "
                          f"{', '.join(MULTI_STAGE)}")
    local = {s: k for k, s in enumerate(virtual_stages_of(rank, pp, v, schedule))}
    return [(kind, local[s], i) for kind, s, i in schedule_order(schedule, pp, v, m)[rank]]


@dataclasses.dataclass
class Simulation:
    step_seconds: float
    """From the first forward to the last action of any rank."""
    busy: Dict[int, float]
    """Seconds each pipeline rank computes."""

    def idle_share(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.step_seconds if self.step_seconds > 0 else 0.0


def simulate(order: Dict[int, List[Action]], seconds: Callable[[str, int], float],
             transfer: Callable[[int, int], float], owner: Callable[[int], int], num_stages: int) -> Simulation:
    """Run the schedule as events: each rank takes its actions in order, an action starting when its rank
    is free and its inputs have arrived. F(s, i) needs F(s - 1, i); B or I (s, i) needs F(s, i) and the
    input gradient of (s + 1, i); W(s, i) needs I(s, i). An input crossing to another rank arrives
    transfer(from_stage, to_stage) seconds after it is produced. `seconds(kind, stage)` is one action's
    time. Raises if the order can never finish (a schedule that waits on itself)."""
    done: Dict[Tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}

    def ready(kind: str, s: int, i: int) -> Optional[float]:
        def arrived(dep_kind: str, ds: int) -> Optional[float]:
            key = (dep_kind, ds, i)
            alt = ("I", ds, i) if dep_kind == "B" else None
            t = done.get(key, done.get(alt) if alt else None)
            if t is None:
                return None
            return t + (transfer(ds, s) if owner(ds) != owner(s) else 0.0)
        if kind == "F":
            return 0.0 if s == 0 else arrived("F", s - 1)
        if kind in ("B", "I"):
            own = done.get(("F", s, i))
            if own is None:
                return None
            if s == num_stages - 1:
                return own
            later = arrived("B", s + 1)
            return None if later is None else max(own, later)
        if kind == "W":
            return done.get(("I", s, i))
        raise ValueError(f"unknown action {kind!r}")

    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                kind, s, i = acts[pos[r]]
                t = ready(kind, s, i)
                if t is None:
                    break
                start = max(free[r], t)
                d = seconds(kind, s)
                free[r] = start + d
                busy[r] += d
                done[(kind, s, i)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pos[r]] for r, acts in order.items() if pos[r] < len(acts)}
            raise RuntimeError(f"the schedule cannot proceed: next actions {stuck}")
    return Simulation(max(free.values()), busy)


def virtual_stages_per_rank(cfg, pp: int) -> int:
    """The (virtual) stages each pipeline rank runs: 2 for ZBV's V, virtual_pipeline_size for the
    interleaved schedules, else 1 (and 1 without a pipeline)."""
    p = cfg.parallel
    if pp == 1:
        return 1
    return 2 if p.pipeline_schedule == "zbv" else (p.virtual_pipeline_size if p.pipeline_schedule in MULTI_STAGE else 1)


def stage_layers(cfg, pp: int) -> List[int]:
    """Layers of every (virtual) stage, as the run splits them (megalm.parallel.stages)."""
    v = virtual_stages_per_rank(cfg, pp)
    split = cfg.parallel.layers_per_stage if pp > 1 else None
    return [len(r) for r in stage_layer_ranges(cfg.model.num_layers, pp * v, split)]


def stage_owner(schedule: str, pp: int, num_stages: int) -> List[int]:
    """The pipeline rank that runs each (virtual) stage."""
    v = num_stages // pp
    return [next(r for r in range(pp) if s in virtual_stages_of(r, pp, v, schedule)) for s in range(num_stages)]


def action_seconds(work: StageWork, kind: str, rate: float, traffic: Optional[Traffic] = None,
                   bandwidth: Optional[float] = None) -> float:
    """Seconds of one pipeline action (F, B, or zero-bubble's I / W) of a stage: its FLOPs at `rate`, plus,
    with a memory `bandwidth`, its bytes outside the matmuls (`stage_traffic`) over that bandwidth."""
    flops = {"F": work.forward, "B": work.backward, "I": work.input_grad, "W": work.weight_grad}[kind]
    moved = traffic.of(kind) if traffic is not None and bandwidth else 0.0
    return flops / rate + (moved / bandwidth if moved else 0.0)


def crossings(kind: str, s: int, owner: Sequence[int]) -> int:
    """The boundary messages pipeline action (kind, s) sends or receives across ranks: a forward takes its
    input from stage s - 1 and hands its output to s + 1; a backward (or its input-gradient half) takes
    the output gradient from s + 1 and hands the input gradient to s - 1; the weight-gradient half none."""
    if kind == "W":
        return 0
    return sum(1 for t in (s - 1, s + 1) if 0 <= t < len(owner) and owner[t] != owner[s])


def compute_bubble(cfg, pp: int, m: int, flops_per_second: Optional[float] = None,
                   bytes_per_second: Optional[float] = None, message_seconds: float = 0.0,
                   message_cpu_seconds: float = 0.0) -> Dict[int, float]:
    """Each pipeline rank's share of the step spent not computing: the schedule's order simulated with
    each stage's time, so unequal stages (the head on the last) count. With no figures a stage's time is
    its FLOPs (`stage_work`); given a device's matmul FLOP/s and memory bandwidth (bytes/s), each stage's
    memory traffic outside the matmuls (`stage_traffic`: its layers, the embedding on the first, the heads
    and the loss on the last) is added as bytes over bandwidth.

    Boundary messages (one activation or its gradient, `crossings`) are free unless given: one arrives
    `message_seconds` after it is sent, and where the ranks handle messages on the cores that compute
    (gloo on CPU), each takes `message_cpu_seconds` from the rank at either end, time that lengthens the
    action and counts as not computing."""
    layers = stage_layers(cfg, pp)
    S = len(layers)
    owner = stage_owner(cfg.parallel.pipeline_schedule, pp, S)
    work = [stage_work(cfg, n, s == S - 1, 1) for s, n in enumerate(layers)]
    rate = flops_per_second or 1.0
    moves = flops_per_second and bytes_per_second
    traffic = [stage_traffic(cfg, n, s == 0, s == S - 1, 1, m) if moves else None for s, n in enumerate(layers)]
    order = schedule_order(cfg.parallel.pipeline_schedule, pp, S // pp, m)

    def seconds(kind: str, s: int) -> float:
        compute = action_seconds(work[s], kind, rate, traffic[s], bytes_per_second if moves else None)
        return compute + message_cpu_seconds * crossings(kind, s, owner)
    sim = simulate(order, seconds, lambda a, b: message_seconds, lambda s: owner[s], S)
    handling = {r: message_cpu_seconds * sum(crossings(k, s, owner) for k, s, _ in acts) for r, acts in order.items()}
    return {r: 1.0 - (sim.busy[r] - handling[r]) / sim.step_seconds for r in range(pp)}


def bubble_equal_stages(pp: int, m: int, v: int = 1) -> float:
    """The bubble as a share of the step with equal stages and no communication time: (p - 1) / (m v + p - 1)
    (Narayanan et al. 2021, arXiv:2104.04473 sec. 2.2: bubble time over ideal time is (p - 1) / (m v))."""
    return (pp - 1) / (m * v + pp - 1)
