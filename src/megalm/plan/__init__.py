"""`python -m megalm.plan [the overrides train takes]`: what each rank of a layout holds, before any run.

The config composes and validates as `megalm.train`'s does. No devices and no other processes are
needed: for each distinct rank position (pipeline stage x first / last tensor-parallel rank), the
model is built on the meta device and laid out as that rank's part of it, over a fake process
group of the layout's size (torch's testing backend, as torchtitan uses for dry runs). Nothing is
allocated. Reported per position:
- the parameters this rank holds (exact: the same layout code a run uses);
- the model-state bytes (weights, gradients, Adam's moments) under the run's ZeRO stage, by
  megalm.training.memory's per-parameter formula.
It also reports the model FLOPs of a step (megalm.models.flops's definition) and the tokens a step
reads. Printed as a table, or as JSON with --json.

Activation memory, collective bytes, the bubble and step-time estimates are not here yet.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megalm.errors import cli_errors

PROG = "megalm.plan"


@dataclass
class Position:
    """One kind of rank: the ranks of a pipeline stage at one tensor-parallel rank (every dp replica alike)."""
    stage: int
    tp_rank: int
    rank: int
    """A global rank at this position (dp and cp index 0)."""
    params: int = 0
    bytes: Dict[str, float] = field(default_factory=dict)
    same_as: List[str] = field(default_factory=list)


def compose(overrides: List[str]):
    """The Config `python -m megalm.train` would run with these overrides, validated for its world size."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir, register_configs
    from megalm.launch import ranks_needed
    from megalm.validation import reject_unknown_keys, validate
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        dcfg = hydra_compose("config", overrides=list(overrides))
    reject_unknown_keys(dcfg)
    cfg = OmegaConf.to_object(dcfg)
    world = ranks_needed(cfg)
    validate(cfg, world)
    return cfg, world


def _rank_of(stage: int, tp_rank: int, dims) -> int:
    # megalm.distributed.mesh.MESH_DIMS order: (pp, dp, cp, tp), the last varying fastest
    return ((stage * dims.dp) * dims.cp) * dims.tp + tp_rank


def rank_params(cfg, world: int, rank: int) -> int:
    """Parameters rank `rank` of the layout holds (a tied weight once), from the meta-device model."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model
    from megalm.parallel import parallelize
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
        model = build_model(cfg.model, device="meta")
        parallelize(model, mesh, cfg.parallel, seed=cfg.trainer.seed)
        return sum(p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def plan(cfg, world: int) -> Dict[str, Any]:
    from megalm.distributed.mesh import ParallelDims
    from megalm.models import flops_per_token
    from megalm.training.memory import expected_bytes_per_param
    dims = ParallelDims.from_config(cfg.parallel, world)
    p, t = cfg.parallel, cfg.trainer
    per_param = expected_bytes_per_param(zero_stage=p.zero_stage, dp=dims.dp)
    parts = {"weights": expected_bytes_per_param(zero_stage=p.zero_stage, dp=dims.dp, grad_bytes=0, optimizer_moments=0),
             "grads": expected_bytes_per_param(zero_stage=p.zero_stage, dp=dims.dp, weight_bytes=0, optimizer_moments=0),
             "optimizer": expected_bytes_per_param(zero_stage=p.zero_stage, dp=dims.dp, weight_bytes=0, grad_bytes=0)}
    positions: List[Position] = []
    for stage in range(dims.pp):
        for tp_rank in sorted({0, dims.tp - 1}):
            pos = Position(stage, tp_rank, _rank_of(stage, tp_rank, dims))
            pos.params = rank_params(cfg, world, pos.rank)
            pos.bytes = {k: v * pos.params for k, v in parts.items()}
            pos.bytes["model_state"] = per_param * pos.params
            positions.append(pos)
    tokens = t.global_batch_size * cfg.model.seq_length
    return {"model": cfg.model.name, "layout": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp,
                                                "world": world, "zero_stage": p.zero_stage,
                                                "sequence_parallel": p.sequence_parallel},
            "tokens_per_step": tokens, "model_flops_per_step": flops_per_token(cfg.model) * tokens,
            "bytes_per_param": per_param,
            "positions": [{"stage": q.stage, "tp_rank": q.tp_rank, "example_rank": q.rank, "params": q.params,
                           **{f"{k}_bytes": v for k, v in q.bytes.items()}} for q in positions]}


def _span(values: List[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}" if values == list(
        range(values[0], values[-1] + 1)) else ",".join(map(str, values))


def format_table(result: Dict[str, Any]) -> str:
    lay = result["layout"]
    head = (f"{result['model']} at tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} ({lay['world']} ranks), "
            f"ZeRO-{lay['zero_stage']}: {result['bytes_per_param']:.3g} bytes of model state per parameter; "
            f"{result['tokens_per_step']:,} tokens and {result['model_flops_per_step']:.3e} model FLOPs a step")
    rows = [("stages", "tp ranks", "params", "weights GB", "grads GB", "optimizer GB", "model state GB")]
    groups: Dict[int, List[Dict[str, Any]]] = {}  # positions holding as many parameters share a row
    for q in result["positions"]:
        groups.setdefault(q["params"], []).append(q)
    for qs in sorted(groups.values(), key=lambda g: (g[0]["stage"], g[0]["tp_rank"])):
        q = qs[0]
        rows.append((_span(sorted({x["stage"] for x in qs})), _span(sorted({x["tp_rank"] for x in qs})),
                     f"{q['params']:,}", f"{q['weights_bytes'] / 1e9:.2f}", f"{q['grads_bytes'] / 1e9:.2f}",
                     f"{q['optimizer_bytes'] / 1e9:.2f}", f"{q['model_state_bytes'] / 1e9:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([head, *lines])


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="the overrides python -m megalm.train takes (model=..., parallel=...)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        cfg, world = compose(args.overrides)
        result = plan(cfg, world)
        print(json.dumps(result, indent=1) if args.json else format_table(result))
