"""Parallelism applied to a plain model from outside, in one ordered function.

Order (each step assumes the previous ones): tensor parallel (swap linears and embeddings for
sharded ones while the model is still on the meta device, so no full weight is allocated) →
pipeline split → activation recomputation → precision → data parallel / ZeRO. Data parallelism
is plain gradient averaging in `finalize_grads` for now; pipeline, recomputation and ZeRO are
refused by `validate` until they land.
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
    if mesh is None:
        return model
    tp = mesh["tp"]
    if tp.size() > 1:
        from megalm.parallel.tp_plan import apply_tensor_parallel
        import torch
        apply_tensor_parallel(model, tp.get_group(), sequence_parallel=cfg.sequence_parallel, seed=seed,
                              rng_device=torch.device(mesh.device_type))
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
