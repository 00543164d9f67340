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
Every formula lives in one of megalm.plan's modules with its source (the package's docstring lists them).
`--search` ranks the layouts of a GPU count instead. Printed as a table, or as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from megalm.errors import ConfigError, cli_errors
from megalm.plan.layout_search import search
from megalm.plan.positions import GB, plan

PROG = "megalm.plan"


def compose(overrides: List[str], gpus: Optional[int] = None, config_dir: Optional[str] = None):
    """The Config `python -m megalm.train` would run with these overrides, validated for its world size
    (`gpus` ranks when given, parallel.dp then filling what tp x pp leaves). `config_dir`: searched before megalm's
    conf/ for presets, as train's --config-dir (an imported model's DIR/conf)."""
    # lazy: Hydra, the families' schemas and validation's imports, off `--help` and the argument errors
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.launch import ranks_needed
    from megalm.validation import reject_unknown_keys, validate
    from megalm.cli import raise_explained
    register_configs()
    if config_dir is not None:
        from pathlib import Path  # lazy: as the rest, off `--help`
        where = Path(config_dir).expanduser().resolve()
        if not where.is_dir():
            raise ConfigError(f"--config-dir {config_dir} is not a directory")
        quoted = str(where).replace("\\", "\\\\").replace("'", "\\'")  # a comma or bracket in the path stays text
        overrides = [f"hydra.searchpath=['file://{quoted}']", *overrides]
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
    ap.add_argument("--config-dir", default=None,
                    help="a folder of presets searched before megalm's conf/, as train's --config-dir (an imported "
                         "model: --config-dir DIR/conf model=NAME; default none)")
    args = ap.parse_intermixed_args(argv)  # overrides before, between or after the flags
    with cli_errors(PROG):
        if args.search:
            if args.gpus is None:
                raise ConfigError("--search needs --gpus N: the devices to lay the model out on")
            cfg, _ = compose(args.overrides + ["parallel.dp=-1"], gpus=None, config_dir=args.config_dir)
            jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
            if jobs < 1:
                raise ConfigError(f"--jobs={jobs} must be at least 1")
            result = search(cfg, args.gpus, args.top, jobs)
            print(json.dumps(result, indent=1) if args.json else format_search(result))
            return
        overrides = list(args.overrides)
        if args.gpus is not None and not any(o.lstrip("+~").startswith("parallel.dp=") for o in overrides):
            overrides.append("parallel.dp=-1")  # the presets name dp=1; --gpus fills it
        cfg, world = compose(overrides, args.gpus, args.config_dir)
        result = plan(cfg, world)
        print(json.dumps(result, indent=1) if args.json else format_table(result))
