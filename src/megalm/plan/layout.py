"""What one rank of a layout holds and runs (`RankLayout`: its stages, parameters, gradient buckets and ZeRO shards),
read off the meta-device model laid out over a fake process group of the layout's size by the same code a run uses
(megalm.parallel.parallelize and the DataParallel bucket layout); nothing is allocated. The collectives
(megalm.plan.collectives) and the model state (megalm.plan.model_state) are counted from it."""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from megalm.distributed.mesh import ParallelDims, build_mesh
from megalm.errors import ConfigError
from megalm.models import build_model, family_of
from megalm.parallel import build_data_parallel, parallelize
from megalm.parallel.stages import virtual_stages_of
from megalm.plan.shapes import check_modelled
from megalm.training.precision import param_dtype

ZERO_BUBBLE = ("interleaved_zb", "zbv")  # weight-gradient passes of their own (no accumulate hooks)


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """What one rank of a layout holds and runs, read off the meta-device model (elements, not bytes)."""
    tp: int
    pp: int
    dp: int
    pp_rank: int
    stage_layers: Tuple[int, ...]      # layers of each of this rank's (virtual) stages, in its order
    stage_ids: Tuple[int, ...]
    owner: Tuple[int, ...]             # the pp rank running each stage
    params: int                        # elements this rank's model holds (a tied weight once)
    param_bytes: int
    buckets: Tuple[Tuple[int, int], ...] = ()  # (elements padded to a multiple of dp x cp, elements / (dp x cp))
    zero3_unit_buckets: Tuple[int, ...] = ()   # ZeRO-3: per unit, the shard elements of its buckets (not the
    zero3_unit_calls: int = 0                  # experts'); the buckets of every unit (a shared one per unit)
    owned: int = 0                     # elements of this rank's ZeRO shards of real parameters
    sp_elements: int = 0               # gradient elements summed over tp (sequence-parallel tags)
    tied_elements: int = 0             # gradient elements summed over the embedding group
    embedding_group: bool = False
    cp: int = 1                        # context-parallel ranks: buckets and ZeRO shards span dp x cp
    ep: int = 1                        # expert-parallel ranks (parallel.ep): E / ep experts a MoE layer here
    expert_buckets: Tuple[Tuple[int, int], ...] = ()  # experts' buckets over the (dp / ep) x cp ranks holding
                                                       # them: (elements padded to a multiple of that, / that)
    zero3_expert_unit_buckets: Tuple[int, ...] = ()  # ZeRO-3 under ep: per unit, the shard elements of its experts'
    zero3_expert_unit_calls: int = 0                 # buckets, and how many (gathered over (dp / ep) x cp)
    expert_tp: int = 1                 # tp ranks each expert is split over (parallel.expert_tp; 1: whole)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, over which gradients are averaged and ZeRO shards: dp x cp
        (megalm.distributed.mesh.replica_mesh)."""
        return self.dp * self.cp

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return len(self.owner) - 1 in self.stage_ids


_CACHE: Dict[tuple, RankLayout] = {}


def _check(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int, cp_rank: int = 0):
    m, p, d = cfg.model, cfg.parallel, cfg.data
    check_modelled(m, "megalm.plan's collective formulas")
    if d.source == "sft" and d.packing:
        raise ConfigError("data.packing=true: stage boundaries then carry position and segment ids, which "
                          "megalm.plan's collective formulas do not model yet")
    dims = ParallelDims.from_config(p, world)
    if p.zero_stage == 3 and dims.pp > 1 and p.pipeline_schedule in ZERO_BUBBLE:
        raise ConfigError(f"parallel.zero_stage=3 with pipeline_schedule={p.pipeline_schedule}: a unit stays "
                          "gathered from its first input-gradient pass to the end of the step there, so its "
                          "all-gathers depend on the schedule's order of passes, which is not modelled")
    for name, value, size in (("pp_rank", pp_rank, dims.pp), ("tp_rank", tp_rank, dims.tp),
                              ("dp_rank", dp_rank, dims.dp), ("cp_rank", cp_rank, dims.cp)):
        if not 0 <= value < size:
            raise ValueError(f"{name}={value} is outside the layout's {size} ({name[:2]}={size})")
    return dims


def rank_layout(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0, cp_rank: int = 0) -> RankLayout:
    """The RankLayout of the rank at (pp_rank, dp_rank, cp_rank, tp_rank), from the meta-device model laid
    out over a fake process group of `world` ranks (torch's testing backend), as megalm.plan does."""
    dims = _check(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    # Recomputation changes no parameter, bucket or shard, and ZeRO-2 lays out ZeRO-1's buckets and shards
    # (it only frees the full gradients sooner): layouts that differ only there share a reading.
    layout_fields = dataclasses.replace(cfg.parallel, recompute="none", recompute_num_layers=None,
                                        zero_stage=1 if cfg.parallel.zero_stage == 2 else cfg.parallel.zero_stage)
    key = (repr(cfg.model), repr(layout_fields), param_dtype(cfg.trainer), world, pp_rank, tp_rank, dp_rank, cp_rank)
    if key not in _CACHE:  # megalm.distributed.mesh's rank order: (pp, dp, cp, tp), tp fastest
        _CACHE[key] = _read_layout(cfg, dims, ((pp_rank * dims.dp + dp_rank) * dims.cp + cp_rank) * dims.tp + tp_rank)
    return _CACHE[key]


def _read_layout(cfg, dims, rank: int) -> RankLayout:
    import torch.distributed as dist
    p = cfg.parallel
    world = dims.world_size
    if world > 1:
        if dist.is_initialized():
            raise RuntimeError("rank_layout lays the model out over a fake process group of its own: call it "
                               "where no process group is initialised (megalm.plan, not inside a run)")
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(dims, "cpu") if world > 1 else None
        model = build_model(cfg.model, device="meta")
        layout = parallelize(model, family_of(model.cfg.arch), mesh, p, seed=cfg.trainer.seed)
        params = list(model.parameters())
        v = len(layout.stage_ids)
        owner = tuple(next(r for r in range(dims.pp) if s in virtual_stages_of(r, dims.pp, v, p.pipeline_schedule))
                      for s in range(layout.num_stages)) if dims.pp > 1 else (0,)
        fields = dict(tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, ep=p.ep,
                      expert_tp=p.expert_tp if dims.tp > 1 else 1,
                      pp_rank=rank // (dims.dp * dims.cp * dims.tp),
                      stage_layers=tuple(len(layout.stage_ranges[s]) for s in layout.stage_ids),
                      stage_ids=tuple(layout.stage_ids), owner=owner, params=sum(q.numel() for q in params),
                      param_bytes=sum(q.numel() * q.element_size() for q in params))
        # The bucket layout of a run (parallel/data.py, zero3.py), built on the meta device; a single process has
        # buckets only to hold the main gradients of low-precision weights (trainer.mixed_precision=main_params).
        dp = build_data_parallel(model, family_of(model.cfg.arch), mesh, layout, p.zero_stage, p.bucket_size_mb,
                                 param_dtype(cfg.trainer))
        if dp is None:
            return RankLayout(**fields)
        tied = layout.tied_param(model)
        if dp.sharded:
            grads = [(s.tensor, s.stop - s.start, s.param is tied) for s in dp.shards]
        else:
            grads = [(q, q.numel(), q is tied) for q in dp.params]
        experts = [getattr(b.params[0], "ep_shard", None) is not None for b in dp.buckets]
        fields.update(
            buckets=tuple((b.size, b.shard_size) for b, e in zip(dp.buckets, experts) if not e),
            expert_buckets=tuple((b.size, b.shard_size) for b, e in zip(dp.buckets, experts) if e),
            owned=sum(s.stop - s.start for s in dp.shards),
            sp_elements=sum(n for t, n, _ in grads if getattr(t, "sequence_parallel", False)),
            tied_elements=sum(n for _, n, is_tied in grads if is_tied),
            embedding_group=layout.embedding_group is not None)
        if p.zero_stage == 3:  # each unit's buckets, the experts' (over their own group) apart
            is_experts = {id(b): e for b, e in zip(dp.buckets, experts)}
            for key, want in (("zero3_unit", False), ("zero3_expert_unit", True)):
                per_unit = [[b for b in dp.unit_buckets[u] if is_experts[id(b)] == want] for u in dp.units]
                fields[f"{key}_buckets"] = tuple(sum(b.shard_size for b in bs) for bs in per_unit)
                fields[f"{key}_calls"] = sum(len(bs) for bs in per_unit)
        return RankLayout(**fields)
    finally:
        if world > 1:
            dist.destroy_process_group()
