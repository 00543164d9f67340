"""A model of a config's family, built, initialised and counted: what the commands that start from a
config call (the registry finds the family; code below the commands is handed the Family instead)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from megalm.config import ModelConfig
from megalm.models.registry import family_of


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    """The plain single-device model of cfg's family, its parameters allocated on `device` but
    not yet initialised. Pass device="meta" for a model that takes no memory (for planning, and
    for parallelize to shard before allocating)."""
    family = family_of(cfg.arch)
    skip = _SkipMetaInit() if torch.device(device).type == "meta" else contextlib.nullcontext()
    with torch.device(device), skip:
        return family.build(cfg)


class _SkipMetaInit(TorchFunctionMode):
    """torch.nn.init's initialisers (normal_, kaiming_uniform_, ones_, ...) and the tensor fills they end in leave a
    meta tensor as it is.

    Modules initialise their parameters as they are built, which on the meta device computes nothing yet
    cost most of a meta build (megalm.plan builds a 175B model once per rank position it reads) and made
    torch import its compiler on the way (torch._refs' normal_). init_weights initialises every parameter
    after materialize, so nothing is lost."""

    FILLS = frozenset({"normal_", "uniform_", "fill_", "zero_"})  # value-only: a meta tensor's shape stays

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.FILLS or (getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_")
                                  and not name.startswith("_")):
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise `model` (any layout's part of it) as its family does, from (seed, global name)."""
    family_of(cfg.arch).init_weights(model, cfg, seed)


def flops_per_token(cfg: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Training model FLOPs per token of cfg's family (the one definition used for MFU)."""
    return family_of(cfg.arch).flops_per_token(cfg, seq_length)

