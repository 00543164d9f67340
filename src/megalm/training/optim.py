"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import math
from typing import List

import torch
from torch import nn

from megalm.config import OptimizerConfig
from megalm.errors import ConfigError
from megalm.parallel.data import ZeroOptimizer


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: matrices decay; norms, biases and other 1-D parameters do not (as GPT-2/3, Megatron)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: OptimizerConfig, model: nn.Module, data_parallel=None):
    """The optimizer of `model`; under ZeRO or with main parameters (data_parallel.has_shards) one over this
    rank's shards."""
    if data_parallel is not None and data_parallel.has_shards:
        decay, no_decay = [], []
        for s in data_parallel.shards:  # a shard is 1-D: decay follows the parameter it belongs to
            (decay if s.param.ndim >= 2 else no_decay).append(s.tensor)
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        return ZeroOptimizer(_make(cfg, groups), data_parallel)
    return _make(cfg, param_groups(model, cfg.weight_decay))


_IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}


def kernel_options(implementation: str) -> dict:
    """torch.optim's keyword arguments for optimizer.implementation (fused: 3.6x foreach's speed on CPU at gpt_cpu,
    docs/PERFORMANCE.md)."""
    if implementation not in _IMPLEMENTATIONS:
        raise ConfigError(f"optimizer.implementation={implementation!r} is not one of {', '.join(_IMPLEMENTATIONS)}")
    return _IMPLEMENTATIONS[implementation]


def _make(cfg: OptimizerConfig, groups: List[dict]) -> torch.optim.Optimizer:
    kernel = kernel_options(cfg.implementation)
    if cfg.name == "adamw":
        # Decoupled weight decay (arXiv:1711.05101).
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernel)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **kernel)
    raise ConfigError(f"optimizer.name={cfg.name!r} is not one of adamw, sgd")


class LRSchedule:
    """Linear warmup to lr, then cosine / linear decay to min_lr at decay_steps, then min_lr.

    A pure function of the step, so a resumed run needs no schedule state.
    """

    def __init__(self, cfg: OptimizerConfig, max_steps: int):
        self.cfg = cfg
        self.decay_steps = cfg.decay_steps if cfg.decay_steps is not None else max_steps

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        c = self.cfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        if c.decay == "constant":
            return c.lr
        span = max(self.decay_steps - c.warmup_steps, 1)
        progress = min(max(step - c.warmup_steps, 0) / span, 1.0)
        if c.decay == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return c.min_lr + (c.lr - c.min_lr) * factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
