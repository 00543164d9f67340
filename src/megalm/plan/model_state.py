"""The model state one rank holds right after an optimizer step (`exact_model_state_bytes`: weights, gradients and
optimizer moments, the ZeRO buckets' padding included), read off its meta-device layout."""

from __future__ import annotations

from typing import Dict

from megalm.errors import ConfigError
from megalm.plan.layout import rank_layout
from megalm.plan.shapes import FP32
from megalm.training.precision import param_dtype


def optimizer_moments(cfg) -> int:
    """fp32 tensors of optimizer state per parameter element: Adam's two moments; SGD's momentum buffer."""
    o = cfg.optimizer
    if o.name == "adamw":
        return 2
    if o.name == "sgd":
        return 1 if o.momentum else 0
    raise ConfigError(f"optimizer.name={o.name!r} is not one of adamw, sgd")


def exact_model_state_bytes(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0,
                            cp_rank: int = 0) -> Dict[str, int]:
    """Bytes of weights, gradients and optimizer state the rank holds right after an optimizer step
    (before the gradients are zeroed), as megalm.training.memory.measured_model_state_bytes reports.

    fp32 weights, fp32 gradients, fp32 optimizer moments (megalm.training.memory; ZeRO, arXiv:1910.02054,
    sec. 5): with gradient buckets the gradients are the buckets' buffers, padding included: whole
    (ZeRO 0, 1) or this rank's 1/replicas chunk (ZeRO 2, 3; replicas = dp, or dp x cp under context
    parallelism); ZeRO 1-3 keep optimizer state for this rank's shards of real parameters only (no
    padding); ZeRO-3 keeps the weights' 1/replicas chunks, padding included (under expert parallelism the
    experts' buckets are chunked over their (dp / ep) x cp ranks instead). A single process, or a run
    without buckets (one replica, ZeRO 0), holds one gradient per parameter; ZeRO needs more than one
    rank (a single process runs unsharded).

    trainer.mixed_precision=main_params (bf16 / fp16) holds the weights in 2 bytes (ZeRO-3: its chunks) and beside
    the optimizer's moments the fp32 main parameters of the range it updates: the whole buckets at ZeRO-0 (a single
    process has buckets then too), this rank's chunks under ZeRO 1-3, padding included (megalm.parallel.data)."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    k = optimizer_moments(cfg)
    z = cfg.parallel.zero_stage
    if not lay.buckets:
        return {"weights": lay.param_bytes, "grads": lay.params * FP32, "optimizer": k * lay.params * FP32}
    full = sum(size for size, _ in lay.buckets + lay.expert_buckets)
    chunks = sum(shard for _, shard in lay.buckets + lay.expert_buckets)
    low = param_dtype(cfg.trainer)
    weight = FP32 if low is None else low.itemsize
    main = 0 if low is None else (full if z == 0 else chunks) * FP32
    return {"weights": chunks * weight if z == 3 else lay.params * weight,
            "grads": (full if z <= 1 else chunks) * FP32,
            "optimizer": k * (lay.owned if z >= 1 else lay.params) * FP32 + main}
