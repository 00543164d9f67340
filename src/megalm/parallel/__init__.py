"""Parallelism applied to a plain model from outside, in one ordered function.

Order (each step assumes the previous ones): pipeline split (keep only this rank's layers) →
tensor parallel (swap linears and embeddings for sharded ones while the model is still on the
meta device, so no full weight is allocated) → activation recomputation (it must see the tp
dropout stream to replay it). Data parallelism (buckets, ZeRO) comes after the weights exist:
`megalm.parallel.data.build_data_parallel`, since ZeRO moves the parameters into flat buffers.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from megalm.config import ParallelConfig


def te_available() -> bool:
    """Transformer Engine is importable and a CUDA device is present."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    import torch
    return torch.cuda.is_available()


def parallelize(model: nn.Module, mesh, cfg: ParallelConfig, seed: int = 0) -> nn.Module:
    """Apply the layout `cfg` over `mesh` to `model` (still on the meta device) and return it."""
    from megalm.parallel.recompute import apply_recompute
    if mesh is None:
        apply_recompute(model, cfg)
        return model
    import torch
    pp, tp = mesh["pp"], mesh["tp"]
    if pp.size() > 1:
        # 1. Pipeline split first, so the tensor-parallel plan only touches what this rank keeps.
        from megalm.parallel.pipeline import embedding_group, keep_stage_parts
        from megalm.parallel.stages import stage_layer_ranges, virtual_stages_of
        num_stages = pp.size() * (2 if cfg.pipeline_schedule == "zbv" else cfg.virtual_pipeline_size)
        ranges = stage_layer_ranges(model.cfg.num_layers, num_stages, cfg.layers_per_stage)
        stage_ids = virtual_stages_of(pp.get_local_rank(), pp.size(), cfg.virtual_pipeline_size,
                                      cfg.pipeline_schedule)
        first, last = 0 in stage_ids, num_stages - 1 in stage_ids
        keep_stage_parts(model, [i for s in stage_ids for i in ranges[s]], first, last)
        model.pp_plan = {"ranges": ranges, "stage_ids": stage_ids, "num_stages": num_stages}
        if model.cfg.tie_embeddings:
            last_pp_rank = 0 if cfg.pipeline_schedule == "zbv" else pp.size() - 1
            model.embedding_group = embedding_group(mesh, last_pp_rank)
    if tp.size() > 1:
        # 2. Tensor (and sequence) parallel layers.
        from megalm.parallel.tp_plan import apply_tensor_parallel
        apply_tensor_parallel(model, tp.get_group(), sequence_parallel=cfg.sequence_parallel, seed=seed,
                              rng_device=torch.device(mesh.device_type))
    if getattr(model, "embedding_group", None) is not None and model.embed is None and model.head is not None:
        # The last stage's head is a copy of the tied embedding: initialised from the embedding's
        # name, and left out of the gradient norm (the first stage counts that matrix).
        model.head.weight.tied_copy_of = "embed.tok.weight"
    # 3. Activation recomputation, after TP so it sees (and replays) the tp dropout stream.
    plan = getattr(model, "pp_plan", None)
    apply_recompute(model, cfg, [plan["ranges"][s] for s in plan["stage_ids"]] if plan else None)
    return model


def materialize(model: nn.Module, device) -> nn.Module:
    """Allocate a meta-device model on `device` (uninitialised), keeping ties and parameter tags.

    `to_empty` makes new Parameter objects when leaving the meta device, which drops attributes
    such as `tp_shard` / `sequence_parallel` and unties shared weights: restore both.
    """
    tags = {name: dict(vars(p)) for name, p in model.named_parameters(remove_duplicate=False)}
    model.to_empty(device=device)
    model.tie_weights()
    for name, p in model.named_parameters(remove_duplicate=False):
        p.__dict__.update(tags[name])
    return model
