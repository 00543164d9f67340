"""What a mixture of experts' routers report over a training step, and the gradient scale of their
auxiliary losses: a record the trainer opens around the step (`routing_step`), written by the layers.

The auxiliary losses are not added to the reported loss: each layer adds its gradient where its router
made it (`add_aux_grad`), scaled as the trainer scales the loss (1 / micro-batches, the fp16 loss scale,
x cp under context parallelism), so pipeline stages need no path for them to the last stage. That scale
changes from step to step (fp16's dynamic loss scale), so it is the step's, held by the record the trainer
opens, as torch.autocast holds the compute dtype, and never stored on a module. The record spans the
step's backward too: a recomputed layer's forward runs again there and must add the same gradient.
Outside a step (evaluation, a test calling a layer) the scale is 1 and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Iterator, List, Optional, Tuple

import torch


class RoutingRecord:
    """The aux-loss gradient scale of one step, and what each MoE layer's training forwards reported in it
    (kept as tensors, read once a step)."""

    def __init__(self, grad_scale: float = 1.0):
        self.grad_scale = grad_scale
        self.records: Dict[int, List[Tuple]] = {}

    def add(self, layer: int, aux, z, dropped: int, assigned: int, load_max, counts: torch.Tensor) -> None:
        self.records.setdefault(layer, []).append((aux, z, dropped, assigned, load_max, counts))

    def values(self, micro_batches: int, num_experts: int) -> torch.Tensor:
        """(aux, z, dropped, assigned summed over this rank's layers and the step's micro-batches; the largest
        load; then the assignments kept by each expert, summed alike). Each layer's last `micro_batches`
        forwards count: a pipeline's first step also runs a probing forward, before the real ones, to learn
        its stages' shapes."""
        rows = [r for layer in self.records.values() for r in layer[-micro_batches:]]
        if not rows:
            return torch.zeros(5 + num_experts, dtype=torch.float64)
        sums = [sum(float(r[i]) for r in rows) for i in range(4)]
        counts = torch.stack([r[5].detach().double().cpu() for r in rows]).sum(0)
        return torch.cat([torch.tensor([*sums, max(float(r[4]) for r in rows)], dtype=torch.float64), counts])


_current: contextvars.ContextVar[Optional[RoutingRecord]] = contextvars.ContextVar("megalm_routing", default=None)


@contextlib.contextmanager
def routing_step(grad_scale: float) -> Iterator[RoutingRecord]:
    """A new record for one training step (its forwards and backwards), its aux losses' gradients scaled
    by `grad_scale`."""
    record = RoutingRecord(grad_scale)
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


def current_record() -> Optional[RoutingRecord]:
    """The record of the step in progress; None outside one. (Inside a compiled graph, torch.compile runs the
    read eagerly between the graph's parts.)"""
    return _current.get()


class _AddAuxGrad(torch.autograd.Function):
    """Identity on `x`; in backward, also the gradient of `aux` x scale (the loss it stands for)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


def add_aux_grad(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`x`, through which backward also sends the gradient of the auxiliary loss `aux`, scaled by the
    step's record (1 outside a step)."""
    record = current_record()
    return _AddAuxGrad.apply(x, aux, record.grad_scale if record is not None else 1.0)
