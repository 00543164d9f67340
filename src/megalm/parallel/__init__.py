"""Parallelism applied to a plain model from outside, in one ordered function.

Order (each step assumes the previous ones): pipeline split (keep only this rank's layers) →
tensor parallel (swap linears and embeddings for sharded ones while the model is still on the
meta device, so no full weight is allocated) → activation recomputation (it must see the tp
dropout stream to replay it). Data parallelism (buckets, ZeRO) comes after the weights exist:
`megalm.parallel.data.build_data_parallel`, since ZeRO moves the parameters into flat buffers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import List, Optional

from torch import nn

from megalm.config import ParallelConfig
from megalm.parallel.random import TPRNG


def te_available() -> bool:
    """Transformer Engine is importable and a CUDA device is present."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    import torch
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

    @property
    def pipelined(self) -> bool:
        return self.num_stages > 1

    def tied_param(self, model: nn.Module) -> Optional[nn.Parameter]:
        return model.get_parameter(self.tied) if self.tied is not None else None


def _tied_pairs(model: nn.Module):
    """The family's (copy, source) pairs that this model shares (the config ties them)."""
    from megalm.models import family_of
    params = dict(model.named_parameters(remove_duplicate=False))
    return [(c, s) for c, s in family_of(model.cfg.arch).tied
            if c in params and s in params and params[c] is params[s]]


def parallelize(model: nn.Module, mesh, cfg: ParallelConfig, seed: int = 0) -> Layout:
    """Apply the layout `cfg` over `mesh` to `model` (still on the meta device) in place; return
    what this rank's part of the layout is."""
    from megalm.models import family_of
    from megalm.parallel.recompute import apply_recompute
    layout = Layout([range(model.cfg.num_layers)], [0], 1)
    if mesh is None:
        apply_recompute(model, cfg, layout)
        return layout
    import torch
    pp, tp = mesh["pp"], mesh["tp"]
    if pp.size() > 1:
        # 1. Pipeline split first, so the tensor-parallel plan only touches what this rank keeps.
        from megalm.parallel.pipeline import embedding_group, keep_stage_parts
        from megalm.parallel.stages import stage_layer_ranges, virtual_stages_of
        tied = _tied_pairs(model)
        num_stages = pp.size() * (2 if cfg.pipeline_schedule == "zbv" else cfg.virtual_pipeline_size)
        ranges = stage_layer_ranges(model.cfg.num_layers, num_stages, cfg.layers_per_stage)
        stage_ids = virtual_stages_of(pp.get_local_rank(), pp.size(), cfg.virtual_pipeline_size,
                                      cfg.pipeline_schedule)
        first, last = 0 in stage_ids, num_stages - 1 in stage_ids
        keep_stage_parts(model, family_of(model.cfg.arch).parts, [i for s in stage_ids for i in ranges[s]],
                         first, last)
        layout = Layout(ranges, stage_ids, num_stages)
        if tied:
            last_pp_rank = 0 if cfg.pipeline_schedule == "zbv" else pp.size() - 1
            layout.embedding_group = embedding_group(mesh, last_pp_rank)
    if cfg.ep > 1:
        # Expert parallelism: this rank keeps E / ep of every MoE layer's experts (before TP sees the layers).
        from megalm.parallel.experts import apply_expert_parallel, expert_groups
        layout.ep_group, layout.edp_group = expert_groups(mesh, cfg.ep)
        apply_expert_parallel(model, layout.ep_group)
    if mesh["cp"].size() > 1:
        # Context parallelism: the attention cores become the ring's (before TP wraps cores for its RNG).
        from megalm.parallel.context import ContextParallel, apply_context_parallel
        cp = mesh["cp"]
        apply_context_parallel(model, ContextParallel(cp.get_group(), cp.get_local_rank(), cp.size()))
    if tp.size() > 1:
        # 2. Tensor (and sequence) parallel layers.
        from megalm.parallel.tp_plan import apply_tensor_parallel
        layout.tp_rng = apply_tensor_parallel(model, tp.get_group(), sequence_parallel=cfg.sequence_parallel,
                                              seed=seed, rng_device=torch.device(mesh.device_type))
    if layout.embedding_group is not None:
        held = dict(model.named_parameters())
        (copy, source), = tied
        layout.tied = source if source in held else copy
        if layout.tied == copy:
            # The last stage's copy of the tied weight: initialised from the source's name, and left
            # out of the gradient norm (the first stage counts that matrix).
            held[copy].tied_copy_of = source
    if getattr(model.cfg, "num_experts", 0):
        # A mixture under tp / cp: each rank routes its own tokens (experts replicated over tp and cp, or split
        # over tp with parallel.expert_tp).
        from megalm.parallel.experts import split_tokens
        split_tokens(model, mesh, cfg.sequence_parallel, expert_tp=cfg.expert_tp > 1)
    # 3. Activation recomputation, after TP so it sees (and replays) the tp dropout stream.
    apply_recompute(model, cfg, layout)
    return layout


def shared_names(model: nn.Module) -> List[List[str]]:
    """Names of the parameters that are one tensor (tied weights), grouped, in registration order."""
    by_id: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: List[List[str]]) -> None:
    """Share each group's parameters again (the first one's) where this rank holds several of them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in groups:
        held = [n for n in names if n in params]
        for name in held[1:]:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, params[held[0]])


def materialize(model: nn.Module, device) -> nn.Module:
    """Allocate a meta-device model on `device` (uninitialised), keeping ties and parameter tags.

    `to_empty` makes new Parameter objects when leaving the meta device, which drops attributes
    such as `tp_shard` / `sequence_parallel` and unties shared weights: restore both.
    """
    tags = {name: dict(vars(p)) for name, p in model.named_parameters(remove_duplicate=False)}
    tied = shared_names(model)
    model.to_empty(device=device)
    retie(model, tied)
    for name, p in model.named_parameters(remove_duplicate=False):
        p.__dict__.update(tags[name])
    return model
