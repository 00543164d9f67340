"""Step time, tokens/s and MFU of a layout on a cluster profile (`estimate_step`), with the profile fields it
needs (`estimate_requirements`), the optimizer's update and the cp ring's exchanges beyond the attention they
overlap."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from megalm.models import flops_per_token
from megalm.parallel.tensor import overlap_pieces
from megalm.plan.collective_time import expert_ranks, group_ranks, group_seconds, link, replica_ranks
from megalm.plan.flops import attention_core_flops_per_token, stage_work
from megalm.plan.group_collectives import boundary_messages, ring_block_bytes
from megalm.plan.model_state import optimizer_moments
from megalm.plan.schedules import action_seconds, schedule_order, simulate, stage_layers, stage_owner
from megalm.plan.shapes import FP32, held_bytes, local_tokens
from megalm.plan.traffic import stage_traffic
from megalm.training.precision import param_dtype


def peak_flops(cluster, precision: str) -> Optional[float]:
    """The profile's dense FLOP/s of one device in `precision` (training's MFU denominator), or None."""
    if cluster.peak_flops:
        return float(cluster.peak_flops)
    value = cluster.peak_flops_per_dtype.get(precision)
    return float(value) if value else None


def optimizer_bytes_per_param(cfg) -> int:
    """Bytes the optimizer step streams per parameter it updates: it reads the fp32 weight, gradient and
    its k state tensors and writes the weight and the state: 12 + 8k (AdamW, k = 2: 28; SGD with
    momentum: 20; plain SGD: 12). Under trainer.mixed_precision=main_params the fp32 weight is the main
    parameter, then cast into the 2-byte weight (a 4-byte read and a 2-byte write): 6 more."""
    return 12 + 8 * optimizer_moments(cfg) + (FP32 + held_bytes(cfg.trainer) if param_dtype(cfg.trainer) else 0)


def optimizer_seconds(updated_params: float, cfg) -> float:
    """A memory-bound elementwise update of the parameters this rank's optimizer owns (all it holds, or its
    1/dp under ZeRO 1-3): the bytes it streams over the device's memory bandwidth."""
    if not cfg.cluster.memory_bandwidth:
        return 0.0
    return updated_params * optimizer_bytes_per_param(cfg) / cfg.cluster.memory_bandwidth


def ring_exposed_seconds(cfg, tp: int, rate: float, bandwidth: float, latency: float) -> Tuple[float, float]:
    """(forward, backward) seconds the cp ring adds to one layer's pass over one micro-batch on one rank.

    Ring attention overlaps each step's exchange with the compute over the block already held (Liu et al.
    2023, arXiv:2310.01889, sec. 3): the cp - 1 sends of a pass, each a point-to-point message (latency plus
    `ring_block_bytes` over the cp group's link), run beside the attention core's compute of that pass, the
    forward's QK^T and AV (`attention_core_flops_per_token` over the rank's tokens / tp) and the backward's
    twice that; only the exchanges' time beyond it is added. Assumed: the overlap is taken over the whole
    pass (all its sends against all its core compute, not step by step), the exchanges slow no kernel
    beside them, and the ring's extra elementwise work (`stage_work`, `stage_traffic`) is not counted."""
    p = cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0
    sends = (p.cp - 1) * (latency + ring_block_bytes(cfg, tp) / bandwidth)
    core = attention_core_flops_per_token(cfg.model) * cfg.trainer.micro_batch_size * local_tokens(cfg) / tp / rate
    return max(0.0, sends - core), max(0.0, sends - 2 * core)


def estimate_requirements(cfg, world: int) -> List[str]:
    """The cluster-profile fields a step-time estimate of `world` devices needs and cfg.cluster lacks."""
    c = cfg.cluster
    missing = []
    if peak_flops(c, cfg.trainer.precision) is None:
        missing.append(f"cluster.peak_flops_per_dtype.{cfg.trainer.precision} (or cluster.peak_flops)")
    if world > 1 and not c.intra_node_bandwidth:
        missing.append("cluster.intra_node_bandwidth")
    if world > c.devices_per_node and not c.inter_node_bandwidth:
        missing.append("cluster.inter_node_bandwidth")
    return missing


def estimate_step(cfg, dims, comm: Dict[int, Dict[str, Dict[str, Dict[str, float]]]],
                  updated_params: Dict[int, float]) -> Dict[str, object]:
    """Step time, tokens/s and MFU of a layout on cfg.cluster, or {"missing": [what the profile lacks]}.

    The model, each term in seconds:
    - every pipeline action (forward, backward, or zero-bubble's input / weight halves) computes its
      FLOPs (`stage_work`) at cluster.matmul_efficiency x the peak of trainer.precision, plus its share
      (by FLOPs) of the rank's tensor-parallel collectives, which wait on the compute (Megatron's layers
      issue them between dependent matmuls, nothing to overlap them with; with parallel.tp_comm_overlap
      only what `tp_exposed` leaves of sequence parallelism's), and likewise of a mixture of
      experts' all-to-alls over the ep group (each `collective_seconds` over the group's link: the counts,
      the rows out and back, forward and backward, and their replay under full recomputation; dispatch
      waits on each), under expert tensor parallelism its all-to-alls and counts' gather over tp (with tp's
      collectives: run_experts waits on each) and its routing counts over the token group; and its bytes
      outside the
      matmuls (`stage_traffic`: norms, activations, copies, the loss on the last stage...) over
      cluster.memory_bandwidth;
    - activations cross pipeline ranks as point-to-point sends (`boundary_messages`: forward the
      activations, and BERT's padding mask; backward their gradient), over NVLink or the network by where
      the two ranks sit;
    - context parallelism's ring exchanges overlap the attention core's compute of the same pass and add
      only what they take beyond it (`ring_exposed_seconds`) to the actions of each layer: forward to F,
      the gradients' (and recomputation's replayed forward's) to B, or to zero-bubble's I;
    - `simulate` runs the schedule's order with these times: the step's pipeline part and each rank's
      bubble;
    - data-parallel gradient reduction overlaps the backward of the step's last micro-batch (megalm
      launches each bucket as its gradients are complete) and shows only beyond it, at least its last
      bucket (over the replicas: dp, or dp x cp; under expert parallelism the experts' buckets over their
      (dp / ep) x cp ranks too, after the others); ZeRO-1/2's parameter all-gather after the update is
      exposed, or with parallel.overlap_param_gather overlaps the next step's first forward on the rank (each
      bucket waited on where a layer first uses it) and shows only beyond it, at least its first bucket (the
      first layers wait for theirs); the tied-embedding sum is exposed, and so are the gradient-norm and loss
      scalars, each 2 log2(world) latencies (a tree, as NCCL runs small all-reduces); ZeRO-3's gathers (the
      experts' over their (dp / ep) x cp ranks under expert parallelism) are prefetched one unit ahead in
      forward and in backward and show only beyond the rank's compute, at least one bucket a pass (the first
      unit of each micro-batch's forward and backward waits for its own);
    - the optimizer step streams the parameters this rank updates through device memory (`optimizer_seconds`;
      `updated_params` per pipeline rank).
    The step ends when the slowest pipeline rank has done all of it.
    """
    c, p, t = cfg.cluster, cfg.parallel, cfg.trainer
    missing = estimate_requirements(cfg, dims.world_size)
    if missing:
        return {"missing": missing}
    peak = peak_flops(c, t.precision)
    rate = peak * c.matmul_efficiency
    m = t.global_batch_size // (t.micro_batch_size * dims.dp)
    layers = stage_layers(cfg, dims.pp)
    S = len(layers)
    owner = stage_owner(p.pipeline_schedule, dims.pp, S) if dims.pp > 1 else [0] * S
    work = [stage_work(cfg, n, s == S - 1, dims.tp) for s, n in enumerate(layers)]
    rank_of = lambda pp_rank: pp_rank * dims.dp * dims.cp * dims.tp  # noqa: E731  (dp, cp, tp index 0)

    def seconds_of(group: str, pp_rank: int, kinds=None) -> float:
        r = rank_of(pp_rank)
        if group == "other":  # gradient-norm and loss scalars: latency-bound, NCCL runs them as trees
            calls = sum(int(v["calls"]) for v in comm[pp_rank].get("other", {}).values())
            _, lat = link(c, list(range(dims.world_size)))
            return calls * 2 * math.ceil(math.log2(dims.world_size)) * lat if dims.world_size > 1 else 0.0
        if group == "embedding":
            ranks = [rank_of(0), rank_of(dims.pp - 1)]
        elif group == "dp":
            ranks = replica_ranks(dims, r)
        elif group in ("ep", "edp"):
            ranks = expert_ranks(dims, p.ep, r, group)
        else:
            ranks = group_ranks(dims, group, r)
        bw, lat = link(c, ranks)
        kinds = kinds if kinds is not None else comm[pp_rank].get(group, {})
        return group_seconds(kinds, len(ranks), bw, lat) if bw else 0.0

    flops_of_rank = {r: m * sum(work[s].forward + work[s].backward for s in range(S) if owner[s] == r)
                     for r in range(dims.pp)}

    def tp_exposed(r: int) -> float:
        """tp's collectives the rank waits on: all of them, or under parallel.tp_comm_overlap the sequence-parallel
        all-gathers and reduce-scatters only beyond the linears' matmuls they run beside (3x the weight-gradient
        FLOPs: forward, input and weight gradients), and at least one piece of each (the first gather, the last
        reduce-scatter wait alone)."""
        kinds = comm[r].get("tp", {})
        if not p.tp_comm_overlap:
            return seconds_of("tp", r)
        pieces = {k: v for k, v in kinds.items() if k in ("all_gather", "reduce_scatter")}
        hidden = seconds_of("tp", r, pieces)
        matmuls = m * sum(3 * work[s].weight_grad for s in range(S) if owner[s] == r) / rate
        k = overlap_pieces(local_tokens(cfg) // dims.tp, dims.tp)
        rest = {kind: v for kind, v in kinds.items() if kind not in pieces}
        return seconds_of("tp", r, rest) + max(hidden / k, hidden - matmuls)

    def waited_on(r: int) -> float:  # tp's collectives (expert tp's among them), a mixture's all-to-alls and
        # its counts over cp
        cp_kinds = {k: v for k, v in comm[r].get("cp", {}).items() if k != "ring"}
        return tp_exposed(r) + seconds_of("ep", r) + (seconds_of("cp", r, cp_kinds) if cp_kinds else 0.0)
    tp_share = {r: waited_on(r) / flops_of_rank[r] if flops_of_rank[r] else 0.0 for r in range(dims.pp)}

    traffic = [stage_traffic(cfg, n, s == 0, s == S - 1, dims.tp, m) if c.memory_bandwidth else None
               for s, n in enumerate(layers)]

    ring_forward = ring_backward = 0.0
    if dims.cp > 1:
        bw, lat = link(c, group_ranks(dims, "cp", 0))
        ring_forward, ring_backward = ring_exposed_seconds(cfg, dims.tp, rate, bw, lat)
    n_replay = p.recompute_num_layers if p.recompute == "full" and p.recompute_num_layers is not None else None
    replayed = [0 if p.recompute == "none" else n if n_replay is None else min(n, n_replay) for n in layers]
    backward = [n * ring_backward + k * ring_forward for n, k in zip(layers, replayed)]
    ring = [{"F": n * ring_forward, "B": b, "I": b, "W": 0.0} for n, b in zip(layers, backward)]

    def seconds(kind: str, s: int) -> float:
        w = work[s]
        flops = {"F": w.forward, "B": w.backward, "I": w.input_grad, "W": w.weight_grad}[kind]
        return action_seconds(w, kind, rate, traffic[s], c.memory_bandwidth) + flops * tp_share[owner[s]] \
            + ring[s][kind]

    forward_msgs, backward_msg = boundary_messages(cfg, dims.tp)

    def transfer(a: int, b: int) -> float:  # from stage a to stage b: forward when a < b
        if dims.pp == 1:
            return 0.0
        pair = [rank_of(owner[a]), rank_of(owner[b])]
        bw, lat = link(c, pair)
        return lat + (sum(forward_msgs) if a < b else backward_msg) / bw

    order = schedule_order(p.pipeline_schedule, dims.pp, S // dims.pp, m) if dims.pp > 1 else \
        {0: [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]}
    sim = simulate(order, seconds, transfer, lambda s: owner[s], S)
    after = {}
    for r in range(dims.pp):
        reduce_s = gather_s = 0.0
        buckets = gathers = 0
        for group in ("dp", "edp"):  # the experts' buckets (expert parallelism) over their own group, in turn
            kinds = comm[r].get(group, {})
            reduce = {k: v for k, v in kinds.items() if k in ("all_reduce", "reduce_scatter")}
            reduce_s += seconds_of(group, r, reduce)
            gather_s += seconds_of(group, r, {k: v for k, v in kinds.items() if k == "all_gather"})
            gathers += int(kinds.get("all_gather", {}).get("calls", 0))
            buckets += sum(int(v["calls"]) for v in reduce.values())
        last_backward = sum(work[s].backward for s in range(S) if owner[s] == r) / rate
        buckets = max(1, buckets)
        exposed_reduce = max(reduce_s - last_backward, reduce_s / buckets) if reduce_s else 0.0
        compute = flops_of_rank[r] / rate
        if p.zero_stage == 3 and gathers:  # each unit's gather runs behind the unit before it (forward) or after it
            # (backward); a pass's first unit has nothing to hide behind: one bucket per forward and backward
            exposed_gather = max(gather_s - compute, 2 * m * gather_s / gathers)
        elif p.overlap_param_gather and gathers:
            first_forward = sum(work[s].forward for s in range(S) if owner[s] == r) / rate
            exposed_gather = max(gather_s / gathers, gather_s - first_forward)
        else:
            exposed_gather = gather_s
        after[r] = {"dp_reduce": exposed_reduce, "dp_gather": exposed_gather,
                    "embedding": seconds_of("embedding", r), "other": seconds_of("other", r),
                    "optimizer": optimizer_seconds(updated_params[r], cfg)}
    tail = max(sum(v.values()) for v in after.values())
    step = sim.step_seconds + tail
    tokens = t.global_batch_size * cfg.model.seq_length
    model_flops = flops_per_token(cfg.model) * tokens
    return {"step_seconds": step, "pipeline_seconds": sim.step_seconds,
            "tokens_per_second": tokens / step, "mfu": model_flops / (step * dims.world_size * peak),
            "bubble": {r: sim.idle_share(r) for r in range(dims.pp)},
            "tp_seconds": {r: seconds_of("tp", r) for r in range(dims.pp)},
            "tp_exposed_seconds": {r: tp_exposed(r) for r in range(dims.pp)},
            "ep_seconds": {r: seconds_of("ep", r) for r in range(dims.pp)},
            "cp_seconds": {r: seconds_of("cp", r) for r in range(dims.pp)},
            "cp_exposed_seconds": {r: m * sum(ring[s]["F"] + ring[s]["B"] for s in range(S) if owner[s] == r)
                                   for r in range(dims.pp)},
            "after_backward": after, "micro_batches": m, "peak_flops": peak}
