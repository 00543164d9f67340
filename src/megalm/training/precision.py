"""Mixed precision: the weights' dtype and the autocast context per `trainer.precision` and
`trainer.mixed_precision`, and fp16's dynamic loss scaler.

- autocast: parameters, gradients and optimizer state stay fp32 (master weights); autocast casts
  the weights and activations to bf16 or fp16 in every matmul.
- main_params (Megatron's mixed precision): the weights are held in bf16 / fp16 and the optimizer
  updates fp32 main parameters, with gradients accumulated into fp32 main-grad buffers
  (megalm.parallel.data). Autocast stays on as the dtype policy of the ops that run in fp32
  (losses); it has no weight left to cast.

fp16's narrow range needs the loss scaled up before backward so small gradients
do not flush to zero, and the step skipped when the scaled gradients overflow. The scaler
follows Megatron's DynamicGradScaler (arXiv:1710.03740 for the method): start at 2^32; on an
overflow anywhere in the job every rank skips the step and spends one unit of hysteresis, and
when hysteresis is used up the scale halves (not below the minimum); after `window` clean steps
in a row the scale doubles and hysteresis refills.

torch.amp.GradScaler is not used: it decides overflow per process and per optimizer, while a
parallel step must be skipped on every rank together (an inf on one pipeline stage or tensor
shard concerns all), and it has no hysteresis.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
import torch.distributed as dist


LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def param_dtype(trainer) -> Optional[torch.dtype]:
    """The dtype the weights are held in under `trainer` (a TrainerConfig) when it is not theirs (fp32):
    bf16 / fp16 with trainer.mixed_precision=main_params; None otherwise."""
    if trainer.mixed_precision == "main_params":
        return LOW_PRECISION.get(trainer.precision)
    return None


def autocast(precision: str, device_type: str):
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device_type, dtype=torch.float16)
    return contextlib.nullcontext()


class DynamicLossScaler:
    def __init__(self, initial_scale: float = 2.0 ** 32, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, static: Optional[float] = None):
        self.scale = float(static if static is not None else initial_scale)
        self.static = static is not None
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self._hysteresis_left, self._clean_steps = hysteresis, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter], group=None) -> bool:
        """Divide gradients by the scale; True when any rank (of `group`, default all) overflowed."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros((), dtype=torch.float32)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            found = (~torch.isfinite(torch.stack([g.float().abs().sum() for g in grads]))).any().float()
        if dist.is_initialized():
            device = grads[0].device if grads else torch.device("cpu")
            found = found.to(device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        if self.static:
            return
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps == self.window:
                self._clean_steps, self._hysteresis_left = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left, self._clean_steps = state["hysteresis_left"], state["clean_steps"]
