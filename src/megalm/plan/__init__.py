"""`python -m megalm.plan [the overrides train takes]`: what each rank of a layout holds, computes and
sends, and what a step costs on a cluster, before any run.

The config composes and validates as `megalm.train`'s does. No devices and no other processes are
needed: for each distinct rank position (pipeline rank x first / last tensor-parallel rank) the model
is built on the meta device and laid out as that rank's part of it, over a fake process group of the
layout's size (torch's testing backend, as torchtitan uses for dry runs). Nothing is allocated.
Reported per position:
- the parameters this rank holds (exact: the same layout code a run uses), and its model-state bytes
  (weights, gradients, Adam's moments, the ZeRO buckets' padding included);
- activation memory at the rank's peak (the schedule's in-flight micro-batches, sequence parallelism,
  context parallelism's share of each sequence and its ring attention, recomputation; a mixture of
  experts' router and rows, planned for balanced routing, under expert tensor parallelism every tp rank's
  rows through the rank's slices of the experts), the logits and loss buffers, and the peak in all against
  the device's memory;
- bytes per collective in a step, by group (tp / sp, the cp ring's sends, pipeline sends, dp buckets
  (over dp x cp under context parallelism), ZeRO-3 gathers, the tied embedding; a mixture of experts'
  all-to-alls over ep, its experts' buckets (and ZeRO-3's gathers of them) over (dp / ep) x cp, and under
  expert tensor parallelism its rows' all-to-alls over tp, in the tp column);
and for the layout: the model FLOPs and tokens of a step, the bubble of the schedule, and the step
time, tokens/s and MFU on `cluster` (its peak FLOP/s, memory, bandwidths and latencies).
`--search` ranks the layouts of a GPU count instead. Printed as a table, or as JSON with --json.

Every formula lives in a module of its own quantity, with its source:
- shapes: the sizes the formulas read off a config (`_Shape`: one micro-batch on one rank);
- flops: a pipeline stage's FLOPs, forward and backward, from the family's one FLOPs definition;
- traffic: the bytes a stage moves outside its matmuls, counted op by op on fake tensors;
- activations (with attention and moe): what autograd keeps for backward per layer, per stage and at
  a rank's peak under its schedule (Korthikanti et al. 2022, with megalm's own coefficients);
- layout: what one rank holds, read off the meta-device model over a fake process group;
- collectives (with group_collectives and expert_collectives): the collectives of one optimizer step
  on a rank, counted as megalm.distributed.comm counts them; model_state: the exact model state it holds;
- collective_time: the time of one collective (the alpha-beta model with the ring's bus-bandwidth
  factors) over the link between the ranks of its group;
- schedules: the order each rank runs its actions in, and an event simulation of that order with
  per-action times, which gives the bubble;
- step_time: step time, tokens/s and MFU on a cluster profile.

Context parallelism (parallel.cp) runs through all of them: a rank's seq_length / cp tokens, the ring
attention's saved tensors, the ring's sends and their overlap with the attention, gradients and ZeRO
shards over dp x cp. So does a mixture of experts (model.num_experts > 0, megalm.models.moe): the FLOPs of k
experts a token and the router; what its router and experts keep (`moe_kept_bytes`), planned for balanced
routing (`moe_rows`: dropless, tokens x k rows; under expert parallelism every rank receiving as many rows
as it sends); each tp rank routing its own tokens; expert parallelism's all-to-alls (`expert_parallel`),
waited on in the step time; the experts' buckets over the (dp / ep) x cp ranks holding them (`expert_data_parallel`),
ZeRO-3's gathers of them there too. Under expert tensor parallelism (parallel.expert_tp) each expert is split
over tp and every tp rank runs all tp ranks' rows through its slices: tp x the rows' fc1 inputs and grouping
indices kept (`moe_kept_bytes`), the rows' all-to-alls over tp, forward and backward (`expert_tensor_parallel`),
and the counts' gather (`untracked_collectives`), both under "tp" and waited on like tp's collectives, the
experts' tp slices in the gradient norm (`other`).

Each estimate is checked against a measured run: tests/test_plan_activations.py (saved tensors),
tests/test_plan_collectives.py (count_comm and the held model state), tests/test_plan.py
(schedules, step time, search) and scripts/bench_pp.py (the bubble).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from megalm.errors import ConfigError, cli_errors

PROG = "megalm.plan"
GB = 1e9


def compose(overrides: List[str], gpus: Optional[int] = None):
    """The Config `python -m megalm.train` would run with these overrides, validated for its world size
    (`gpus` ranks when given, parallel.dp then filling what tp x pp leaves)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir, register_configs
    from megalm.launch import ranks_needed
    from megalm.validation import reject_unknown_keys, validate
    from megalm.cli import raise_explained
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        try:
            dcfg = hydra_compose("config", overrides=list(overrides))
        except Exception as e:  # a misspelt key or preset, as train says it
            raise_explained(e)
    reject_unknown_keys(dcfg)
    cfg = OmegaConf.to_object(dcfg)
    if gpus is not None and gpus < 1:
        raise ConfigError(f"--gpus={gpus} must be at least 1")
    world = gpus if gpus is not None else ranks_needed(cfg)
    validate(cfg, world)
    return cfg, world


def _dims(cfg, world: int):
    from megalm.distributed.mesh import ParallelDims
    return ParallelDims.from_config(cfg.parallel, world)


def _rank_of(stage: int, tp_rank: int, dims) -> int:
    # megalm.distributed.mesh.MESH_DIMS order: (pp, dp, cp, tp), the last varying fastest
    return ((stage * dims.dp) * dims.cp) * dims.tp + tp_rank


def rank_params(cfg, world: int, rank: int) -> int:
    """Parameters rank `rank` of the layout holds (a tied weight once), from the meta-device model."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megalm.distributed.mesh import build_mesh
    from megalm.models import build_model
    from megalm.parallel import parallelize
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(_dims(cfg, world), "cpu")
        model = build_model(cfg.model, device="meta")
        parallelize(model, mesh, cfg.parallel, seed=cfg.trainer.seed)
        return sum(p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def _fit(total: float, cluster) -> Optional[bool]:
    return None if not cluster.memory_per_device_gb else total <= cluster.memory_per_device_gb * GB


def plan(cfg, world: int) -> Dict[str, Any]:
    from megalm.models import flops_per_token
    # the formula modules import torch (through megalm.parallel): kept off the command line's start-up path
    from megalm.plan.activations import stage_activation_bytes
    from megalm.plan.collectives import step_collectives
    from megalm.plan.layout import rank_layout
    from megalm.plan.model_state import exact_model_state_bytes
    from megalm.plan.schedules import bubble_equal_stages, compute_bubble, stage_layers
    from megalm.plan.step_time import estimate_step
    from megalm.training.memory import expected_bytes_per_param
    dims = _dims(cfg, world)
    p, t = cfg.parallel, cfg.trainer
    replicas = dims.dp * dims.cp  # the ranks ZeRO shards over (megalm.distributed.mesh.replica_mesh)
    per_param = expected_bytes_per_param(zero_stage=p.zero_stage, dp=replicas)
    m = t.global_batch_size // (t.micro_batch_size * dims.dp)
    positions: List[Dict[str, Any]] = []
    comm: Dict[int, Dict[str, Any]] = {}
    state: Dict[int, float] = {}
    not_modelled = None
    for stage in range(dims.pp):
        try:
            act = stage_activation_bytes(cfg, world, stage)  # alike on every tp rank of the stage
        except ConfigError as e:  # modelled for GPT language models and BERT pretraining only
            act, not_modelled = None, str(e)
        for tp_rank in sorted({0, dims.tp - 1}):
            rank = _rank_of(stage, tp_rank, dims)
            q: Dict[str, Any] = {"stage": stage, "tp_rank": tp_rank, "example_rank": rank}
            try:
                if act is None:
                    raise ConfigError(not_modelled)
                # the meta-device layout these read is also where the rank's parameters are counted
                lay = rank_layout(cfg, world, stage, tp_rank)
                q["params"] = lay.params
                held = exact_model_state_bytes(cfg, world, stage, tp_rank)
                coll = step_collectives(cfg, world, stage, tp_rank)
            except ConfigError as e:
                not_modelled = str(e)
                q["params"] = rank_params(cfg, world, rank)
                q.update({k: v * q["params"] for k, v in (("weights_bytes", 4), ("grads_bytes", 4))})
                q["model_state_bytes"] = per_param * q["params"]
                positions.append(q)
                continue
            model_state = held["weights"] + held["grads"] + held["optimizer"]
            if tp_rank == 0:
                comm[stage] = coll
                # what its optimizer updates: its ZeRO shards (experts' over (dp / ep) x cp), or all it holds
                state[stage] = lay.owned if p.zero_stage >= 1 and (lay.buckets or lay.expert_buckets) else q["params"]
            total = model_state + act["peak"]
            q.update({
                "weights_bytes": held["weights"], "grads_bytes": held["grads"], "optimizer_bytes": held["optimizer"],
                "model_state_bytes": model_state, "layers": act["layers"],
                "activation_bytes_per_microbatch": act["per_microbatch"], "in_flight_microbatches": act["in_flight"],
                "logits_and_loss_bytes": act["logits_and_loss"], "activation_peak_bytes": act["peak"],
                "peak_bytes": total, "fits": _fit(total, cfg.cluster), "collectives": coll,
                "comm_bytes": {g: sum(v["bytes"] for k, v in kinds.items() if k != "recv") for g, kinds in coll.items()}})
            positions.append(q)
    tokens = t.global_batch_size * cfg.model.seq_length
    schedule = p.pipeline_schedule if dims.pp > 1 else None
    v = len(stage_layers(cfg, dims.pp)) // dims.pp
    out = {"model": cfg.model.name, "cluster": cfg.cluster.name,
           "layout": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "ep": p.ep,
                      "expert_tp": p.expert_tp if dims.tp > 1 else 1, "world": world,
                      "zero_stage": p.zero_stage, "sequence_parallel": p.sequence_parallel,
                      "schedule": schedule, "virtual_stages": v, "recompute": p.recompute,
                      "precision": t.precision, "micro_batch_size": t.micro_batch_size, "micro_batches": m},
           "tokens_per_step": tokens, "model_flops_per_step": flops_per_token(cfg.model) * tokens,
           "bytes_per_param": per_param,
           "bubble_equal_stages": bubble_equal_stages(dims.pp, m, v) if dims.pp > 1 else 0.0,
           "bubble_compute_only": compute_bubble(cfg, dims.pp, m) if dims.pp > 1 else {0: 0.0},
           "positions": positions}
    if not_modelled:
        out["not_modelled"] = not_modelled
        out["estimate"] = {"missing": ["activation and communication formulas for this model"]}
    else:
        out["estimate"] = estimate_step(cfg, dims, comm, state)
    return out


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------

SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")
MAX_VIRTUAL_STAGES = 8  # interleaving deeper than this gains little bubble for its extra sends
RECOMPUTE = ("none", "selective", "full")
ZERO = (0, 1, 2, 3)


def _powers_of_two(limit: int) -> List[int]:
    return [2 ** k for k in range(limit.bit_length()) if 2 ** k <= limit]


def _virtual_stages(schedule: str, pp: int, layers: int) -> List[int]:
    """The stages per rank a schedule is tried with: 1 for 1F1B, 2 for ZBV's V, and for the interleaved
    schedule every v from 2 to MAX_VIRTUAL_STAGES that splits the layers evenly over pp x v stages."""
    if schedule == "1f1b":
        return [1]
    if schedule == "zbv":
        return [2]
    return [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if layers % (pp * v) == 0]


def candidates(cfg, gpus: int, micro_batches=(1, 2, 4, 8)):
    """Every (tp, pp, schedule, v, micro-batch) of `gpus` devices, sequence parallel on wherever tp > 1;
    parallel.cp stays as given (dp fills what tp x pp x cp leaves)."""
    heads, layers, cp = cfg.model.num_attention_heads, cfg.model.num_layers, cfg.parallel.cp
    for tp in _powers_of_two(min(cfg.cluster.devices_per_node, heads)):
        for pp in range(1, layers + 1):
            if gpus % (tp * pp * cp):
                continue
            for schedule in (SCHEDULES if pp > 1 else ("1f1b",)):
                for v in _virtual_stages(schedule, pp, layers):
                    for mbs in micro_batches:
                        yield tp, pp, gpus // (tp * pp * cp), schedule, v, mbs


def _with(cfg, **parallel_and_mbs):
    mbs = parallel_and_mbs.pop("micro_batch_size")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel_and_mbs),
                               trainer=dataclasses.replace(cfg.trainer, micro_batch_size=mbs))


_PARTS: Dict[tuple, Tuple[int, int, int, int]] = {}


def _parts(cfg, tp: int) -> Tuple[int, int, int, int]:
    """(first stage's own, each layer's, last stage's own, counted twice when one rank holds both ends)
    parameters of tp rank 0 at tensor-parallel degree tp (experts split over it too under parallel.expert_tp),
    from three meta-device layouts: pp2 with every layer on the last stage, pp2 with every layer on the first,
    and pp1 (where a tied weight is one)."""
    expert_tp = tp if cfg.parallel.expert_tp > 1 else 1  # the experts split over tp, or whole
    key = (repr(cfg.model), tp, expert_tp)
    if key not in _PARTS:
        L = cfg.model.num_layers
        base = dict(tp=tp, dp=1, cp=1, ep=1, expert_tp=expert_tp, sequence_parallel=tp > 1, pipeline_schedule="1f1b",
                    virtual_pipeline_size=1, zero_stage=0, recompute="none", recompute_num_layers=None)
        two = lambda split: _with(cfg, pp=2, layers_per_stage=split, micro_batch_size=1, **base)  # noqa: E731
        first = rank_params(two([0, L]), 2 * tp, 0)
        first_and_layers_last = rank_params(two([0, L]), 2 * tp, tp)
        last = rank_params(two([L, 0]), 2 * tp, tp)
        whole = rank_params(_with(cfg, pp=1, layers_per_stage=None, micro_batch_size=1, **base), tp, 0)
        per_layer = (first_and_layers_last - last) // L
        _PARTS[key] = (first, per_layer, last, first + L * per_layer + last - whole)
    return _PARTS[key]


def expert_params_per_layer(cfg) -> int:
    """Elements of a layer's experts (fc1 (E, h, 2f or f) and fc2 (E, f, h)); 0 for a dense MLP."""
    m = cfg.model
    E = getattr(m, "num_experts", 0)
    return E * m.hidden_size * m.ffn_size * (3 if m.activation == "swiglu" else 2)


def stage_params_estimate(cfg, world: int, pp_rank: int) -> int:
    """Parameters of tp rank 0 on pipeline rank `pp_rank`, from `_parts` (no model built per layout)."""
    # the formula modules import torch (through megalm.parallel): kept off the command line's start-up path
    from megalm.plan.schedules import stage_layers, stage_owner
    dims = _dims(cfg, world)
    first, per_layer, last, twice = _parts(cfg, dims.tp)
    layers = stage_layers(cfg, dims.pp)
    owner = stage_owner(cfg.parallel.pipeline_schedule, dims.pp, len(layers)) if dims.pp > 1 else [0] * len(layers)
    mine = [s for s in range(len(layers)) if owner[s] == pp_rank]
    experts = expert_params_per_layer(cfg) // (dims.tp if cfg.parallel.expert_tp > 1 else 1)  # (tp slices)
    per_layer -= experts * (cfg.parallel.ep - 1) // cfg.parallel.ep  # E / ep experts here
    n = sum(layers[s] for s in mine) * per_layer
    n += first if 0 in mine else 0
    n += last if len(layers) - 1 in mine else 0
    return n - (twice if 0 in mine and len(layers) - 1 in mine else 0)


def _state_estimate(cfg, world: int, pp_rank: int) -> float:
    from megalm.training.memory import expected_bytes_per_param
    dims = _dims(cfg, world)
    return expected_bytes_per_param(zero_stage=cfg.parallel.zero_stage, dp=dims.dp * dims.cp) * \
        stage_params_estimate(cfg, world, pp_rank)


def _best_option(cfg, gpus: int, candidate) -> Tuple[str, Optional[Dict[str, Any]], str]:
    """(name, the fastest fitting recompute x ZeRO option of one candidate layout or None, why none)."""
    # the formula modules import torch (through megalm.parallel): kept off the command line's start-up path
    from megalm.plan.activations import stage_activation_bytes
    from megalm.plan.collectives import step_collectives
    from megalm.plan.step_time import estimate_step
    from megalm.validation import validate
    tp, pp, dp, schedule, v, mbs = candidate
    cp = cfg.parallel.cp
    name = f"tp{tp} pp{pp} dp{dp}" + (f" cp{cp}" if cp > 1 else "") + (f" {schedule} v{v}" if pp > 1 else "") \
        + f" mbs{mbs}"
    # parallel.expert_tp > 1 asks for the experts split over whatever tp a candidate has
    expert_tp = tp if cfg.parallel.expert_tp > 1 else 1
    layout = dict(tp=tp, pp=pp, dp=dp, sequence_parallel=tp > 1, pipeline_schedule=schedule, expert_tp=expert_tp,
                  virtual_pipeline_size=v, layers_per_stage=None, recompute_num_layers=None, micro_batch_size=mbs)
    try:
        validate(_with(cfg, zero_stage=0, recompute="none", **layout), gpus)
    except ConfigError as e:
        return name, None, str(e)
    best, reasons = None, []
    activations: Dict[str, List[int]] = {}  # per recomputation: the ZeRO stage moves no activation
    for recompute, zero in itertools.product(RECOMPUTE, ZERO):
        c = _with(cfg, zero_stage=zero, recompute=recompute, **layout)
        try:
            validate(c, gpus)
            if recompute not in activations:
                activations[recompute] = [stage_activation_bytes(c, gpus, s)["peak"] for s in range(pp)]
            peak = max(activations[recompute][s] + _state_estimate(c, gpus, s) for s in range(pp))
            if peak > c.cluster.memory_per_device_gb * GB:
                reasons.append(f"needs {peak / GB:.1f} GB a device with recompute={recompute}, ZeRO-{zero}")
                continue
            # Under an even split the middle pipeline ranks hold and send alike: read one of them.
            like = {s: s if s in (0, pp - 1) else 1 for s in range(pp)}
            read = {s: step_collectives(c, gpus, s, 0) for s in set(like.values())}
            est = estimate_step(c, _dims(c, gpus), {s: read[like[s]] for s in range(pp)},
                                  {s: stage_params_estimate(c, gpus, s) / (dp * cp if zero >= 1 else 1)
                                   for s in range(pp)})
        except ConfigError as e:  # an option the run refuses, or one the formulas do not model
            reasons.append(f"recompute={recompute}, ZeRO-{zero}: {e}")
            continue
        if best is None or est["step_seconds"] < best["step_seconds"]:
            best = {"layout": name, "tp": tp, "pp": pp, "dp": dp, "cp": cp, "expert_tp": expert_tp,
                    "schedule": schedule if pp > 1 else None,
                    "virtual_stages": v if pp > 1 else 1, "micro_batch_size": mbs, "recompute": recompute,
                    "zero_stage": zero, "sequence_parallel": tp > 1, "peak_bytes": peak,
                    "step_seconds": est["step_seconds"], "tokens_per_second": est["tokens_per_second"],
                    "mfu": est["mfu"], "bubble": max(est["bubble"].values())}
    if best is not None:
        return name, best, ""
    fits = [r for r in reasons if r.startswith("needs ")]
    return name, None, min(fits, key=lambda r: float(r.split()[1])) if fits else reasons[-1]


def _best_options(cfg, gpus: int, group: List[tuple]) -> List[Tuple[str, Optional[Dict[str, Any]], str]]:
    return [_best_option(cfg, gpus, c) for c in group]


def search(cfg, gpus: int, top: int = 10, jobs: int = 1) -> Dict[str, Any]:
    """Rank the layouts of `gpus` devices by estimated step time; say why the others were dropped.

    Every (tp, pp, schedule, virtual stages, micro-batch) of `candidates` (at the config's parallel.cp and ep;
    with parallel.expert_tp > 1, the experts split over each candidate's tp) is
    tried with each recomputation (none, selective, full) and ZeRO stage (0-3); the options whose peak fits
    the device are estimated and the fastest is kept. A layout the run itself would refuse is dropped with
    its error, one where no option fits with what the leanest option needs. `jobs` processes share the work (the layouts of one tp, pp
    schedule and virtual stages go to one process, which reads their meta-device layout once)."""
    # the formula modules import torch (through megalm.parallel): kept off the command line's start-up path
    from megalm.plan.step_time import estimate_requirements
    if not cfg.cluster.memory_per_device_gb:
        raise ConfigError(f"--search needs the devices' memory: cluster={cfg.cluster.name} has no "
                          "cluster.memory_per_device_gb (choose a cluster preset, e.g. cluster=slurm_h100)")
    missing = estimate_requirements(cfg, gpus)
    if missing:
        raise ConfigError(f"--search needs step times: cluster={cfg.cluster.name} lacks {', '.join(missing)}")
    groups: Dict[tuple, List[tuple]] = {}
    for c in candidates(cfg, gpus):
        groups.setdefault(c[:5], []).append(c)
    if jobs > 1 and len(groups) > 1:
        import concurrent.futures
        import multiprocessing
        # spawn: a fresh interpreter per worker (each sets up its own fake process groups)
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = [r for rs in pool.map(_best_options, *zip(*[(cfg, gpus, g) for g in groups.values()]))
                       for r in rs]
    else:
        results = [r for g in groups.values() for r in _best_options(cfg, gpus, g)]
    ranked = sorted((best for _, best, _ in results if best is not None), key=lambda r: r["step_seconds"])
    # the layouts too big for the device first: the reasons a reader most needs
    dropped = dict(sorted(((name, why) for name, best, why in results if best is None),
                          key=lambda item: not item[1].startswith("needs ")))
    return {"model": cfg.model.name, "cluster": cfg.cluster.name, "gpus": gpus,
            "global_batch_size": cfg.trainer.global_batch_size, "ranked": ranked[:top] if top else ranked,
            "considered": len(results), "fitting": len(ranked), "dropped": dropped}


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def _span(values: List[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}" if values == list(
        range(values[0], values[-1] + 1)) else ",".join(map(str, values))


def _table(rows: List[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


def _unit(values) -> Tuple[float, str]:
    top = max([v for v in values if v] or [0])
    return (1e9, "GB") if top >= 1e9 else (1e6, "MB") if top >= 1e6 else (1e3, "kB")


def format_table(result: Dict[str, Any]) -> str:
    lay, est = result["layout"], result["estimate"]
    sched = f", {lay['schedule']} x{lay['virtual_stages']}" if lay["schedule"] else ""
    cp = (f" cp{lay['cp']}" if lay["cp"] > 1 else "") + (f" ep{lay['ep']}" if lay.get("ep", 1) > 1 else "") \
        + (f" expert_tp{lay['expert_tp']}" if lay.get("expert_tp", 1) > 1 else "")
    head = [f"{result['model']} at tp{lay['tp']} pp{lay['pp']} dp{lay['dp']}{cp} ({lay['world']} ranks{sched}), "
            f"{lay['precision']}, ZeRO-{lay['zero_stage']}, sp {'on' if lay['sequence_parallel'] else 'off'}, "
            f"recompute {lay['recompute']}, {lay['micro_batches']} micro-batches of {lay['micro_batch_size']}",
            f"a step: {result['tokens_per_step']:,} tokens, {result['model_flops_per_step']:.3e} model FLOPs"]
    qs_all = result["positions"]
    if result.get("not_modelled"):
        mu, mn = _unit(q["model_state_bytes"] for q in qs_all)
        rows = [("stages", "tp ranks", "params", f"model state {mn}")]
        rows += [(str(q["stage"]), str(q["tp_rank"]), f"{q['params']:,}", f"{q['model_state_bytes'] / mu:.2f}")
                 for q in qs_all]
        return "\n".join(head + _table(rows) + [f"activations, communication and step time: not modelled "
                                                   f"({result['not_modelled']})"])
    bubble = est.get("bubble") or result["bubble_compute_only"]
    su, sn = _unit(q["peak_bytes"] for q in qs_all)
    cu, cn = _unit(b for q in qs_all for b in q["comm_bytes"].values())
    groups_shown = ("tp",) + (("cp",) if lay["cp"] > 1 else ()) + (("ep",) if lay.get("ep", 1) > 1 else ()) \
        + ("pp", "dp") + (("edp",) if lay.get("ep", 1) > 1 else ()) + ("embedding",)
    rows = [("stages", "tp ranks", "params", f"model state {sn}", f"activations {sn}", "in flight", f"peak {sn}",
             "fits", *(f"{'emb' if g == 'embedding' else g} {cn}" for g in groups_shown), "bubble")]
    groups: Dict[tuple, List[Dict[str, Any]]] = {}  # positions alike in every column share a row
    for q in qs_all:
        key = (q["params"], q["model_state_bytes"], q["activation_peak_bytes"],
               tuple(sorted(q["comm_bytes"].items())), round(bubble.get(q["stage"], 0.0), 4))
        groups.setdefault(key, []).append(q)
    for qs in sorted(groups.values(), key=lambda g: (g[0]["stage"], g[0]["tp_rank"])):
        q = qs[0]
        c = q["comm_bytes"]
        rows.append((_span(sorted({x["stage"] for x in qs})), _span(sorted({x["tp_rank"] for x in qs})),
                     f"{q['params']:,}", f"{q['model_state_bytes'] / su:.2f}", f"{q['activation_peak_bytes'] / su:.2f}",
                     f"{q['in_flight_microbatches']:g}", f"{q['peak_bytes'] / su:.2f}",
                     {None: "?", True: "yes", False: "NO"}[q["fits"]],
                     *(f"{c.get(g, 0) / cu:.2f}" for g in groups_shown),
                     f"{bubble.get(q['stage'], 0.0):.1%}" if lay["pp"] > 1 else "-"))
    lines = head + _table(rows)
    cp_note = "; cp: the ring's sends, dp: over dp x cp" if lay["cp"] > 1 else ""
    if lay.get("ep", 1) > 1:
        cp_note += "; ep: the experts' all-to-alls (what a rank sends), edp: the experts' buckets over (dp / ep) x cp"
    if lay.get("expert_tp", 1) > 1:
        cp_note += "; tp: with the experts' all-to-alls among the tp ranks (expert tp)"
    lines.append("communication: bytes each rank sends in a step (all-reduce: the tensor; all-gather: its input; "
                 f"reduce-scatter: the full input{cp_note})")
    if "missing" in est:
        lines.append(("bubble: compute alone (FLOPs as time). " if lay["pp"] > 1 else "")
                     + f"No step time on cluster={result['cluster']}: it lacks {', '.join(est['missing'])} "
                     "(try cluster=slurm_h100)")
    else:
        lines.append(f"on cluster={result['cluster']}: step {_seconds(est['step_seconds'])} "
                     f"(pipeline {_seconds(est['pipeline_seconds'])}), {est['tokens_per_second']:,.0f} tokens/s, "
                     f"MFU {est['mfu']:.1%} of {est['peak_flops'] / 1e12:.0f} TFLOP/s a device")
    return "\n".join(lines)


def format_search(result: Dict[str, Any]) -> str:
    head = (f"{result['model']} on {result['gpus']} devices of cluster={result['cluster']}, global batch "
            f"{result['global_batch_size']}: {result['fitting']} of {result['considered']} layouts fit")
    rows = [("layout", "recompute", "ZeRO", "peak GB", "bubble", "step s", "tokens/s", "MFU")]
    for r in result["ranked"]:
        rows.append((r["layout"], r["recompute"], str(r["zero_stage"]), f"{r['peak_bytes'] / GB:.1f}",
                     f"{r['bubble']:.1%}", f"{r['step_seconds']:.3f}", f"{r['tokens_per_second']:,.0f}",
                     f"{r['mfu']:.1%}"))
    lines = [head, *(_table(rows) if result["ranked"] else ["(none fits)"])]
    if result["dropped"]:
        lines.append(f"dropped ({len(result['dropped'])}):")
        lines += [f"  {k}: {v}" for k, v in list(result["dropped"].items())[:20]]
        if len(result["dropped"]) > 20:
            lines.append(f"  ... and {len(result['dropped']) - 20} more (--json lists all)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="the overrides python -m megalm.train takes (model=..., parallel=...)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="devices in all (default: what the layout names; parallel.dp fills the rest)")
    ap.add_argument("--search", action="store_true",
                    help="rank every tp / pp / schedule / micro-batch / recompute / ZeRO layout of --gpus devices")
    ap.add_argument("--top", type=int, default=10, help="layouts --search prints (0 = all; default 10)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes --search runs in (default: this machine's CPU count)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_intermixed_args(argv)  # overrides before, between or after the flags
    with cli_errors(PROG):
        if args.search:
            if args.gpus is None:
                raise ConfigError("--search needs --gpus N: the devices to lay the model out on")
            cfg, _ = compose(args.overrides + ["parallel.dp=-1"], gpus=None)
            jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
            if jobs < 1:
                raise ConfigError(f"--jobs={jobs} must be at least 1")
            result = search(cfg, args.gpus, args.top, jobs)
            print(json.dumps(result, indent=1) if args.json else format_search(result))
            return
        overrides = list(args.overrides)
        if args.gpus is not None and not any(o.lstrip("+~").startswith("parallel.dp=") for o in overrides):
            overrides.append("parallel.dp=-1")  # the presets name dp=1; --gpus fills it
        cfg, world = compose(overrides, args.gpus)
        result = plan(cfg, world)
        print(json.dumps(result, indent=1) if args.json else format_table(result))
