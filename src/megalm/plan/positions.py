"""`plan`: what every distinct rank position of one layout holds, keeps and sends (pipeline rank x first / last
tensor-parallel rank), and the layout's step on its cluster; the parameters of any rank (`rank_params`) from the
meta-device model laid out over a fake process group."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from megalm.errors import ConfigError

GB = 1e9


def _dims(cfg, world: int):
    from megalm.distributed.mesh import ParallelDims  # lazy: torch, off the command line's start-up path
    return ParallelDims.from_config(cfg.parallel, world)


def _rank_of(stage: int, tp_rank: int, dims) -> int:
    # megalm.distributed.mesh.MESH_DIMS order: (pp, dp, cp, tp), the last varying fastest
    return ((stage * dims.dp) * dims.cp) * dims.tp + tp_rank


def rank_params(cfg, world: int, rank: int) -> int:
    """Parameters rank `rank` of the layout holds (a tied weight once), from the meta-device model."""
    # lazy: torch, off the command line's start-up path (the meta model over a fake process group)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megalm.distributed.mesh import build_mesh
    from megalm.models import build_model, family_of
    from megalm.parallel import parallelize
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(_dims(cfg, world), "cpu")
        model = build_model(cfg.model, device="meta")
        parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel, seed=cfg.trainer.seed)
        return sum(p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def _fit(total: float, cluster) -> Optional[bool]:
    return None if not cluster.memory_per_device_gb else total <= cluster.memory_per_device_gb * GB


def plan(cfg, world: int) -> Dict[str, Any]:
    # lazy: the formula modules import torch (through megalm.parallel), kept off the command line's start-up path
    from megalm.models import flops_per_token
    from megalm.plan.activations import stage_activation_bytes
    from megalm.plan.collectives import step_collectives
    from megalm.plan.layout import rank_layout
    from megalm.plan.model_state import exact_model_state_bytes
    from megalm.plan.schedules import bubble_equal_stages, compute_bubble, stage_layers
    from megalm.plan.step_time import estimate_step
    from megalm.training.memory import expected_bytes_per_param, precision_bytes
    dims = _dims(cfg, world)
    p, t = cfg.parallel, cfg.trainer
    replicas = dims.dp * dims.cp  # the ranks ZeRO shards over (megalm.distributed.mesh.replica_mesh)
    per_param = expected_bytes_per_param(**precision_bytes(t), zero_stage=p.zero_stage, dp=replicas)
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
