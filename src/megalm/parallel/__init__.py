"""Parallelism applied to a plain model from outside, in one ordered function.

`parallelize(model, family, mesh, cfg)` takes the model on the meta device and the Family it belongs to,
and applies, in this order (each step assumes the previous ones):
1. the pipeline split: keep only this rank's layers and first / last parts (the family's Parts), so what
   follows touches only what the rank keeps;
2. a mixture of experts' plan (megalm.parallel.experts): experts split over ep and expert tp, each rank
   routing its own tokens under tp and cp;
3. context parallelism (megalm.parallel.context): the attention cores the family's cp plan names become
   the ring's, before tp wraps cores for its random streams;
4. tensor (and sequence) parallelism by the family's tp plan (megalm.parallel.styles), while no weight is
   allocated;
5. activation recomputation, which must see (and replay) the tp dropout stream.
It returns the Layout it applied; no process group or per-step value is left on the model's own modules
(the parallel modules and hooks the styles install hold what they need). Data parallelism (buckets,
ZeRO) comes after the weights exist: `build_data_parallel`, since ZeRO moves the parameters into flat
buffers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from megalm.config import ParallelConfig
from megalm.errors import ConfigError
from megalm.family import Family
from megalm.parallel.context import ContextParallel, CPContext
from megalm.parallel.data import DataParallel
from megalm.parallel.experts import expert_context, expert_groups
from megalm.parallel.params import materialize, retie, shared_names
from megalm.parallel.pipeline import embedding_group, keep_stage_parts
from megalm.parallel.random import TPRNG
from megalm.parallel.recompute import apply_recompute
from megalm.parallel.stages import stage_layer_ranges, virtual_stages_of
from megalm.parallel.styles import apply_plan, apply_tensor_parallel
from megalm.parallel.zero3 import FullyShardedDataParallel


def te_available() -> bool:
    """Transformer Engine is importable and a CUDA device is present."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    return torch.cuda.is_available()


@dataclass
class Layout:
    """What `parallelize` decided for this rank, which the pipeline, data parallelism, gradient
    sums and checkpoints need; the model itself carries no layout state."""
    stage_ranges: List[range]
    """Layers of every pipeline stage (one stage holding every layer without a pipeline)."""
    stage_ids: List[int]
    """The (virtual) stages this rank runs, in pipeline order."""
    num_stages: int
    embedding_group: Optional[object] = None
    """The process group of the two ranks holding the two copies of a tied weight split across
    pipeline stages (Megatron's embedding group); None when no tied weight is split."""
    tied: Optional[str] = None
    """This rank's copy of that weight, by parameter name (its gradient is summed over the group)."""
    tp_rng: Optional[TPRNG] = None
    """The tensor-parallel random streams (megalm.parallel.random), when tp > 1."""
    ep_group: Optional[object] = None
    """Expert parallelism: the ranks that split each MoE layer's experts with this one (megalm.parallel.experts)."""
    edp_group: Optional[object] = None
    """And the ranks holding the same experts as this one, over which their gradients are reduced."""
    context: Optional[ContextParallel] = None
    """Context parallelism: this rank's place in its cp group (the trainer splits each micro-batch by it)."""

    @property
    def pipelined(self) -> bool:
        return self.num_stages > 1

    def tied_param(self, model: nn.Module) -> Optional[nn.Parameter]:
        return model.get_parameter(self.tied) if self.tied is not None else None


def _tied_pairs(model: nn.Module, family: Family):
    """The family's (copy, source) pairs that this model shares (the config ties them)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [(c, s) for c, s in family.tied if c in params and s in params and params[c] is params[s]]


def parallelize(model: nn.Module, family: Family, mesh, cfg: ParallelConfig, seed: int = 0) -> Layout:
    """Apply the layout `cfg` over `mesh` to `model` (still on the meta device), a model of `family`,
    in place; return what this rank's part of the layout is."""
    layout = Layout([range(model.cfg.num_layers)], [0], 1)
    if mesh is None:
        apply_recompute(model, family.parts, cfg, layout)
        return layout
    pp, tp = mesh["pp"], mesh["tp"]
    if pp.size() > 1:
        # 1. Pipeline split first, so the tensor-parallel plan only touches what this rank keeps.
        tied = _tied_pairs(model, family)
        num_stages = pp.size() * (2 if cfg.pipeline_schedule == "zbv" else cfg.virtual_pipeline_size)
        ranges = stage_layer_ranges(model.cfg.num_layers, num_stages, cfg.layers_per_stage)
        stage_ids = virtual_stages_of(pp.get_local_rank(), pp.size(), cfg.virtual_pipeline_size,
                                      cfg.pipeline_schedule)
        first, last = 0 in stage_ids, num_stages - 1 in stage_ids
        keep_stage_parts(model, family.parts, [i for s in stage_ids for i in ranges[s]], first, last)
        layout = Layout(ranges, stage_ids, num_stages)
        if tied:
            last_pp_rank = 0 if cfg.pipeline_schedule == "zbv" else pp.size() - 1
            layout.embedding_group = embedding_group(mesh, last_pp_rank)
    experts = family.expert_plan(model.cfg) if family.expert_plan is not None else []
    if experts and (cfg.ep > 1 or tp.size() > 1 or mesh["cp"].size() > 1):
        # 2. A mixture of experts: its experts split over ep (this rank keeps E / ep of them) and, with
        # parallel.expert_tp, over tp; under tp / cp each rank routes its own tokens, the experts' load summed
        # over the ranks sharing the micro-batch. The expert-parallel groups are carved from dp.
        if cfg.ep > 1:
            layout.ep_group, layout.edp_group = expert_groups(mesh, cfg.ep)
        ctx = expert_context(mesh, cfg.ep, cfg.expert_tp > 1, cfg.sequence_parallel, layout.ep_group)
        apply_plan(model, experts, ctx)
    if mesh["cp"].size() > 1:
        # 3. Context parallelism: the attention cores become the ring's (before TP wraps cores for its RNG), and
        # the modules reading positions get this rank's.
        if family.cp_plan is None:
            raise ConfigError(f"parallel.cp={mesh['cp'].size()}: the {family.name} family has no context-parallel "
                              "plan; use parallel.cp=1")
        cp = mesh["cp"]
        layout.context = ContextParallel(cp.get_group(), cp.get_local_rank(), cp.size())
        shards = tp.size() if cfg.sequence_parallel else 1
        apply_plan(model, family.cp_plan(model.cfg), CPContext(layout.context, shards))
    if tp.size() > 1:
        # 4. Tensor (and sequence) parallel layers.
        if family.tp_plan is None:
            raise ConfigError(f"parallel.tp={tp.size()}: the {family.name} family has no tensor-parallel plan; "
                              "use parallel.tp=1")
        plan = family.tp_plan(model.cfg, tp.size(), cfg.sequence_parallel)
        layout.tp_rng = apply_tensor_parallel(model, plan, tp.get_group(), sequence_parallel=cfg.sequence_parallel,
                                              seed=seed, rng_device=torch.device(mesh.device_type),
                                              comm_overlap=cfg.tp_comm_overlap)
    if layout.embedding_group is not None:
        held = dict(model.named_parameters())
        (copy, source), = tied
        layout.tied = source if source in held else copy
        if layout.tied == copy:
            # The last stage's copy of the tied weight: initialised from the source's name, and left
            # out of the gradient norm (the first stage counts that matrix).
            held[copy].tied_copy_of = source
    # 5. Activation recomputation, after TP so it sees (and replays) the tp dropout stream.
    apply_recompute(model, family.parts, cfg, layout)
    return layout


def build_data_parallel(model: nn.Module, family: Family, mesh, layout: Layout, zero_stage: int,
                        bucket_size_mb: Optional[float], param_dtype: Optional[torch.dtype] = None,
                        overlap_param_gather: bool = False) -> Optional[DataParallel]:
    """The gradient synchroniser of a distributed run (ZeRO-3 gathers `family`'s units); None in a single
    process, unless `param_dtype` asks for low-precision weights with fp32 main parameters (the buckets
    hold the main gradients then, megalm.parallel.data). `overlap_param_gather`: ZeRO 1/2's."""
    if mesh is None:
        return DataParallel(model, None, layout, 0, bucket_size_mb, param_dtype) if param_dtype is not None else None
    if zero_stage == 3:
        return FullyShardedDataParallel(model, family.parts, mesh, layout, bucket_size_mb, param_dtype)
    return DataParallel(model, mesh, layout, zero_stage, bucket_size_mb, param_dtype, overlap_param_gather)


__all__ = ["Layout", "build_data_parallel", "materialize", "parallelize", "retie", "shared_names", "te_available"]
