"""Parallelism applied to a plain model from outside, in one ordered function.

Order (each step assumes the previous ones): tensor parallel → pipeline split → activation
recomputation → precision → data parallel / ZeRO. The plain single-process path is the
identity; the parallel steps arrive one issue at a time and are refused clearly until then.
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


def parallelize(model: nn.Module, mesh, cfg: ParallelConfig) -> nn.Module:
    """Apply the layout `cfg` over `mesh` to `model` (still on the meta device) and return it."""
    if mesh is None:
        return model
    raise ValueError(f"parallel layout tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} needs multi-rank training, "
                     "which is not available yet; use parallel=single")
