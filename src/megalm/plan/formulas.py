"""Every formula megalm.plan estimates with, each with its source.

Pure arithmetic over the composed Config (no torch tensors are allocated); what is exact (the
parameters a rank holds) comes from the meta-device model in megalm.plan itself.

Sections:
- FLOPs of one pipeline stage's forward and backward, from the family's one FLOPs definition;
- time of one collective (the alpha-beta model with NCCL's ring bus-bandwidth factors);
- pipeline schedules: the order each rank runs its actions in, and an event simulation of that
  order with per-action times, which gives the step time and each rank's bubble.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megalm.parallel.stages import MULTI_STAGE, stage_layer_ranges, virtual_stages_of

# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def layer_and_head_flops_per_token(model_cfg) -> Tuple[float, float]:
    """Training FLOPs per token of one transformer layer, and of everything outside the layers.

    Both come from the family's own `flops_per_token` (megalm.models.flops: 6 x matmul weights +
    12 L s h_attn, model FLOPs, recomputation not counted), evaluated at the model's depth and at
    depth 0: the difference is the layers' share, which is the same for every layer; what is left at
    depth 0 is the head (and, for BERT, its MLM transform and pooler), all of it on the last stage.
    """
    from megalm.models import flops_per_token
    total = flops_per_token(model_cfg)
    outside = flops_per_token(dataclasses.replace(model_cfg, num_layers=0))
    return (total - outside) / model_cfg.num_layers, outside


def attention_core_flops_per_token(model_cfg) -> float:
    """Forward FLOPs per token per layer of QK^T and AV (2 x 2 s h_attn: megalm.models.flops's 12 L s h_attn
    is these times 3 for forward + backward), the part selective recomputation runs twice."""
    return 4.0 * model_cfg.seq_length * model_cfg.num_attention_heads * model_cfg.head_dim


@dataclasses.dataclass
class StageWork:
    """FLOPs one rank spends on one micro-batch in one (virtual) stage, split as the zero-bubble schedules
    split backward (Qi et al. 2023, arXiv:2401.10241): F forward, I the gradient of the stage's input
    (activations; the attention core's whole backward is here, it has no weights), W the weights'
    gradient (as many FLOPs as the forward's matmuls). B = I + W, twice F. Recomputation adds its
    forward to I: the whole forward of the recomputed layers (full), or the attention core (selective)."""
    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def stage_work(cfg, layers: int, last: bool, tp: int) -> StageWork:
    """Per-rank FLOPs of one micro-batch through a stage of `layers` layers (with the head when `last`)."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.trainer.micro_batch_size * m.seq_length
    layer, outside = layer_and_head_flops_per_token(m)
    attn = attention_core_flops_per_token(m)  # forward, per layer
    layer_fwd = layer / 3
    matmul_fwd = layer_fwd - attn
    fwd = layers * layer_fwd + (outside / 3 if last else 0.0)
    head_mm = outside / 3 if last else 0.0
    weight = layers * matmul_fwd + head_mm
    inputs = layers * (matmul_fwd + 2 * attn) + head_mm
    if p.recompute == "full":
        n = layers if p.recompute_num_layers is None else min(layers, p.recompute_num_layers)
        inputs += n * layer_fwd
    elif p.recompute == "selective":
        inputs += layers * attn
    scale = tokens / tp
    return StageWork(fwd * scale, inputs * scale, weight * scale)


# ---------------------------------------------------------------------------------------------
# Collectives: the alpha-beta model
# ---------------------------------------------------------------------------------------------

# Bytes each rank puts on its link per byte of the message CommStats records (megalm.distributed.comm:
# all_reduce counts the full tensor, all_gather the local input, reduce_scatter the full input), for
# ring algorithms over p ranks (Thakur, Rabenseifner and Gropp 2005; NCCL's nccl-tests
# doc/PERFORMANCE.md gives the same factors as its bus bandwidth: all-reduce 2(p-1)/p, all-gather and
# reduce-scatter (p-1)/p of the full buffer).
def wire_factor(kind: str, p: int) -> float:
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) / p
    if kind == "all_gather":  # the recorded size is the local input, 1/p of the full buffer
        return p - 1
    if kind == "reduce_scatter":
        return (p - 1) / p
    if kind in ("send", "recv", "broadcast"):
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}: all_reduce, all_gather, reduce_scatter, send, recv")


def latency_steps(kind: str, p: int) -> int:
    """Messages in sequence a ring needs: 2(p - 1) for all-reduce, p - 1 for the others, 1 point to point."""
    if p <= 1:
        return 0
    if kind in ("send", "recv", "broadcast"):
        return 1
    return 2 * (p - 1) if kind == "all_reduce" else p - 1


def collective_seconds(kind: str, nbytes: float, p: int, bandwidth: float, latency: float,
                       calls: int = 1) -> float:
    """Time of `calls` collectives of `kind` moving `nbytes` in all (as CommStats counts them) over p
    ranks: alpha x steps + bytes on the wire / bandwidth (Hockney's model; the ring's factors above)."""
    if p <= 1 or (nbytes <= 0 and calls <= 0):
        return 0.0
    return calls * latency_steps(kind, p) * latency + wire_factor(kind, p) * nbytes / bandwidth


# ---------------------------------------------------------------------------------------------
# Rank placement (megalm.distributed.mesh: (pp, dp, cp, tp), tp varying fastest)
# ---------------------------------------------------------------------------------------------

def group_ranks(dims, dim: str, rank: int) -> List[int]:
    """The global ranks of `rank`'s group along mesh dimension `dim`."""
    sizes = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}
    order = ["pp", "dp", "cp", "tp"]
    stride = 1
    for name in reversed(order):
        if name == dim:
            break
        stride *= sizes[name]
    index = (rank // stride) % sizes[dim]
    base = rank - index * stride
    return [base + i * stride for i in range(sizes[dim])]


def inside_one_node(ranks: Sequence[int], devices_per_node: int) -> bool:
    return len({r // devices_per_node for r in ranks}) == 1


# ---------------------------------------------------------------------------------------------
# Pipeline schedules and their simulation
# ---------------------------------------------------------------------------------------------

Action = Tuple[str, int, int]  # (kind: F forward | B backward | I input gradient | W weight gradient, stage, micro-batch)


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


def stage_layers(cfg, pp: int) -> List[int]:
    """Layers of every (virtual) stage, as the run splits them (megalm.parallel.stages)."""
    p = cfg.parallel
    v = 2 if p.pipeline_schedule == "zbv" else (p.virtual_pipeline_size if p.pipeline_schedule in MULTI_STAGE else 1)
    return [len(r) for r in stage_layer_ranges(cfg.model.num_layers, pp * v, p.layers_per_stage)]


def stage_owner(schedule: str, pp: int, num_stages: int) -> List[int]:
    """The pipeline rank that runs each (virtual) stage."""
    v = num_stages // pp
    return [next(r for r in range(pp) if s in virtual_stages_of(r, pp, v, schedule)) for s in range(num_stages)]


def bubble_equal_stages(pp: int, m: int, v: int = 1) -> float:
    """The bubble as a share of the step with equal stages and no communication time: (p - 1) / (m v + p - 1)
    (Narayanan et al. 2021, arXiv:2104.04473 sec. 2.2: bubble time over ideal time is (p - 1) / (m v))."""
    return (pp - 1) / (m * v + pp - 1)


# ---------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------

def peak_flops(cluster, precision: str) -> Optional[float]:
    """The profile's dense FLOP/s of one device in `precision` (training's MFU denominator), or None."""
    if cluster.peak_flops:
        return float(cluster.peak_flops)
    value = cluster.peak_flops_per_dtype.get(precision)
    return float(value) if value else None


def link(cluster, ranks: Sequence[int]) -> Tuple[Optional[float], float]:
    """(effective bytes/s, latency) of a group: NVLink inside one node, the network otherwise (a ring
    across nodes runs at the slowest link's pace). Bandwidth None when the profile does not give it."""
    intra = inside_one_node(ranks, cluster.devices_per_node)
    bw = cluster.intra_node_bandwidth if intra else cluster.inter_node_bandwidth
    lat = cluster.intra_node_latency if intra else cluster.inter_node_latency
    return (bw * cluster.comm_efficiency if bw else None), lat


def group_seconds(kinds: Dict[str, Dict[str, float]], p: int, bandwidth: float, latency: float) -> float:
    """Time of a group's collectives of one step, {kind: {"calls", "bytes"}} as CommStats counts them."""
    return sum(collective_seconds(k, v["bytes"], p, bandwidth, latency, int(v["calls"])) for k, v in kinds.items())


ADAM_BYTES_PER_STATE_BYTE = 28 / 16
"""The optimizer step streams what it holds: AdamW reads weights, gradients and both moments (16 bytes a
parameter in fp32) and writes weights and moments (12): 28 bytes of traffic per 16 bytes of state."""


def optimizer_seconds(model_state_bytes: float, cluster) -> float:
    """A memory-bound elementwise update: the bytes it streams over the device's memory bandwidth."""
    if not cluster.memory_bandwidth:
        return 0.0
    return model_state_bytes * ADAM_BYTES_PER_STATE_BYTE / cluster.memory_bandwidth


def estimate_step(cfg, dims, comm: Dict[int, Dict[str, Dict[str, Dict[str, float]]]],
                  state_bytes: Dict[int, float]) -> Dict[str, object]:
    """Step time, tokens/s and MFU of a layout on cfg.cluster, or {"missing": [what the profile lacks]}.

    The model, each term in seconds:
    - every pipeline action (forward, backward, or zero-bubble's input / weight halves) computes its
      FLOPs (`stage_work`) at cluster.matmul_efficiency x the peak of trainer.precision, plus its share
      (by FLOPs) of the rank's tensor-parallel collectives, which wait on the compute (Megatron's layers
      issue them between dependent matmuls, nothing to overlap them with);
    - activations cross pipeline ranks as point-to-point sends (their size from `comm`), over NVLink or
      the network by where the two ranks sit;
    - `simulate` runs the schedule's order with these times: the step's pipeline part and each rank's
      bubble;
    - data-parallel gradient reduction overlaps the backward of the step's last micro-batch (megalm
      launches each bucket as its gradients are complete) and shows only beyond it, at least its last
      bucket; ZeRO-1/2's parameter all-gather after the update, the tied-embedding sum and the
      gradient-norm scalars are exposed; ZeRO-3's gathers are prefetched and show only beyond the
      rank's compute;
    - the optimizer step streams the model state through device memory (`optimizer_seconds`).
    The step ends when the slowest pipeline rank has done all of it.
    """
    c, p, t = cfg.cluster, cfg.parallel, cfg.trainer
    missing = []
    peak = peak_flops(c, t.precision)
    if peak is None:
        missing.append(f"cluster.peak_flops_per_dtype.{t.precision} (or cluster.peak_flops)")
    multi_node = dims.world_size > c.devices_per_node
    if dims.world_size > 1 and not c.intra_node_bandwidth:
        missing.append("cluster.intra_node_bandwidth")
    if multi_node and not c.inter_node_bandwidth:
        missing.append("cluster.inter_node_bandwidth")
    if missing:
        return {"missing": missing}
    rate = peak * c.matmul_efficiency
    m = t.global_batch_size // (t.micro_batch_size * dims.dp)
    layers = stage_layers(cfg, dims.pp)
    S = len(layers)
    owner = stage_owner(p.pipeline_schedule, dims.pp, S) if dims.pp > 1 else [0] * S
    work = [stage_work(cfg, n, s == S - 1, dims.tp) for s, n in enumerate(layers)]
    rank_of = lambda pp_rank: pp_rank * dims.dp * dims.cp * dims.tp  # noqa: E731  (dp, cp, tp index 0)

    def seconds_of(group: str, pp_rank: int, kinds=None) -> float:
        r = rank_of(pp_rank)
        if group == "embedding":
            ranks = [rank_of(0), rank_of(dims.pp - 1)]
        elif group == "other":  # gradient-norm and loss scalars over the whole layout: latency-bound
            ranks = list(range(dims.world_size))
        else:
            ranks = group_ranks(dims, group, r)
        bw, lat = link(c, ranks)
        kinds = kinds if kinds is not None else comm[pp_rank].get(group, {})
        return group_seconds(kinds, len(ranks), bw, lat) if bw else 0.0

    flops_of_rank = {r: m * sum(work[s].forward + work[s].backward for s in range(S) if owner[s] == r)
                     for r in range(dims.pp)}
    tp_share = {r: seconds_of("tp", r) / flops_of_rank[r] if flops_of_rank[r] else 0.0 for r in range(dims.pp)}

    def action_seconds(kind: str, s: int) -> float:
        w = work[s]
        flops = {"F": w.forward, "B": w.backward, "I": w.input_grad, "W": w.weight_grad}[kind]
        return flops / rate + flops * tp_share[owner[s]]

    def transfer(a: int, b: int) -> float:
        send = comm[owner[a]].get("pp", {}).get("send")
        if not send or not send["calls"]:
            return 0.0
        pair = [rank_of(owner[a]), rank_of(owner[b])]
        bw, lat = link(c, pair)
        return lat + send["bytes"] / send["calls"] / bw

    order = schedule_order(p.pipeline_schedule, dims.pp, S // dims.pp, m) if dims.pp > 1 else \
        {0: [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]}
    sim = simulate(order, action_seconds, transfer, lambda s: owner[s], S)
    after = {}
    for r in range(dims.pp):
        dp = comm[r].get("dp", {})
        reduce = {k: v for k, v in dp.items() if k in ("all_reduce", "reduce_scatter")}
        gather = {k: v for k, v in dp.items() if k == "all_gather"}
        reduce_s = seconds_of("dp", r, reduce)
        gather_s = seconds_of("dp", r, gather)
        last_backward = sum(work[s].backward for s in range(S) if owner[s] == r) / rate
        buckets = max(1, sum(int(v["calls"]) for v in reduce.values()))
        exposed_reduce = max(reduce_s - last_backward, reduce_s / buckets) if reduce_s else 0.0
        compute = flops_of_rank[r] / rate
        exposed_gather = max(0.0, gather_s - compute) if p.zero_stage == 3 else gather_s
        after[r] = {"dp_reduce": exposed_reduce, "dp_gather": exposed_gather,
                    "embedding": seconds_of("embedding", r), "other": seconds_of("other", r),
                    "optimizer": optimizer_seconds(state_bytes[r], c)}
    tail = max(sum(v.values()) for v in after.values())
    step = sim.step_seconds + tail
    tokens = t.global_batch_size * cfg.model.seq_length
    from megalm.models import flops_per_token
    model_flops = flops_per_token(cfg.model) * tokens
    return {"step_seconds": step, "pipeline_seconds": sim.step_seconds,
            "tokens_per_second": tokens / step, "mfu": model_flops / (step * dims.world_size * peak),
            "bubble": {r: sim.idle_share(r) for r in range(dims.pp)},
            "tp_seconds": {r: seconds_of("tp", r) for r in range(dims.pp)},
            "after_backward": after, "micro_batches": m, "peak_flops": peak}
