"""Model-state memory per rank: the expected bytes per parameter, and what a rank really holds.

Megatron's accounting (its distributed-optimizer notes; ZeRO, arXiv:1910.02054): with low-precision
weights (2 bytes), fp32 gradients (4) and an fp32 master copy plus Adam's two moments (4 + 4 + 4),
a parameter costs 18 bytes without sharding and 6 + 12/dp with the optimizer state sharded over
dp. megalm's trainer.mixed_precision=main_params is that (bf16 / fp16): 18, 6 + 12/dp under ZeRO-1,
2 + 16/dp under ZeRO-2, 18/dp under ZeRO-3. fp32 runs and autocast keep fp32 weights (autocast casts
them per op) and fp32 gradients, the weights their own master copy: 16 bytes per parameter
unsharded, 4 + 4 + 8/dp under ZeRO-1, 4 + 12/dp under ZeRO-2 and 16/dp under ZeRO-3.
Activations are not model state and are not counted here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

import torch

from megalm.errors import ConfigError
from megalm.training.precision import param_dtype


def expected_bytes_per_param(*, weight_bytes: int = 4, grad_bytes: int = 4, master_weights: bool = False,
                             optimizer_moments: int = 2, zero_stage: int = 0, dp: int = 1) -> float:
    """Bytes of weights + gradients + optimizer state per parameter on one rank.

    zero_stage 1 shards the optimizer state (and master weights) over dp, 2 also the gradients,
    3 also the weights.
    """
    optimizer = 4 * optimizer_moments + (4 if master_weights else 0)
    shard = lambda x, stage: x / dp if zero_stage >= stage else x  # noqa: E731
    return shard(weight_bytes, 3) + shard(grad_bytes, 2) + shard(optimizer, 1)


def precision_bytes(trainer) -> Dict[str, object]:
    """`expected_bytes_per_param`'s weight_bytes and master_weights for a TrainerConfig: bf16 / fp16 weights
    with fp32 main parameters under trainer.mixed_precision=main_params, else fp32 weights, their own master."""
    main = param_dtype(trainer) is not None
    return {"weight_bytes": 2 if main else 4, "master_weights": main}


def measured_model_state_bytes(model: torch.nn.Module, optimizer, data_parallel=None) -> Dict[str, int]:
    """What this rank holds now: weights, gradients and optimizer state (fp32 main parameters included), in bytes.

    With a megalm.parallel.data.DataParallel the gradients are its buckets (full, or the ZeRO
    shard), which the parameters' .grad views or has been freed into, and under ZeRO-3 the
    weights are this rank's shards plus whatever layers are gathered at the moment."""
    params = list(model.parameters())  # a tied weight is one tensor, counted once
    weights = sum(p.numel() * p.element_size() for p in params)
    if data_parallel is not None:  # ZeRO-3's parameters are views of buffers mostly freed
        weights, grads = data_parallel.weight_bytes(), data_parallel.grad_bytes()
    else:
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)  # Adam's scalar `step` is not model state
    if data_parallel is not None:
        state += data_parallel.main_param_bytes()
    return {"params": sum(p.numel() for p in params), "weights": weights, "grads": grads, "optimizer": state}


def free_host_memory() -> Optional[int]:
    """Bytes this machine can still give (MemAvailable + SwapFree of /proc/meminfo); None where unknown."""
    try:
        text = Path("/proc/meminfo").read_text()
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return None


def check_host_memory(cfg, params_on_rank: int, dp: int, device: torch.device) -> None:
    """Refuse, before any allocation, a CPU run whose model state alone (weights, gradients, optimizer state:
    `expected_bytes_per_param`) on this machine's ranks is more than the machine has free; activations come on
    top, so passing says nothing about fitting. (GPU memory is the device's to refuse.)"""
    if device.type != "cpu":
        return
    free = free_host_memory()
    if free is None:
        return
    o = cfg.optimizer
    moments = 2 if o.name == "adamw" else (1 if o.momentum else 0)
    per_param = expected_bytes_per_param(**precision_bytes(cfg.trainer), optimizer_moments=moments,
                                         zero_stage=cfg.parallel.zero_stage, dp=dp)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)  # torch elastic and torchrun say how many share it
    need = params_on_rank * per_param * ranks
    if need > free:
        raise ConfigError(
            f"model={cfg.model.name}: its weights, gradients and optimizer state alone take {need / 1e9:.1f} GB here "
            f"({params_on_rank:,} parameters on a rank x {per_param:g} bytes x {ranks} rank(s) on this "
            f"machine), more than the {free / 1e9:.1f} GB it has free; choose a smaller model, or shard it "
            f"(parallel.zero_stage, tp, pp) over more machines: `python -m megalm.plan` with the same overrides "
            f"shows what each rank would hold")
