"""`search`: every tp / pp / schedule / virtual-stage / micro-batch layout of a GPU count, each with its fastest
recompute and ZeRO choice that fits the device, ranked by estimated step time, and why the others were dropped.
A candidate's parameters come from three meta-device layouts per tp degree (`stage_params_estimate`), not one
per layout."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Optional, Tuple

from megalm.errors import ConfigError
from megalm.plan.positions import GB, _dims, rank_params

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
    # lazy: the formula modules import torch (through megalm.parallel), kept off the command line's start-up path
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
    from megalm.training.memory import expected_bytes_per_param, precision_bytes  # lazy: torch, as the formula modules
    dims = _dims(cfg, world)
    return expected_bytes_per_param(**precision_bytes(cfg.trainer), zero_stage=cfg.parallel.zero_stage,
                                    dp=dims.dp * dims.cp) * \
        stage_params_estimate(cfg, world, pp_rank)


def _best_option(cfg, gpus: int, candidate) -> Tuple[str, Optional[Dict[str, Any]], str]:
    """(name, the fastest fitting recompute x ZeRO option of one candidate layout or None, why none)."""
    # lazy: the formula modules import torch (through megalm.parallel), kept off the command line's start-up path
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
    # lazy: the formula modules import torch (through megalm.parallel), kept off the command line's start-up path
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
