"""The embedding lookup, with a backward that a compiled graph calls as aten's own kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("megalm::embedding_grad", mutates_args=())
def embedding_grad(grad: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The gradient of a (rows, h) table from its lookup of `ids` (grad: ids' shape + (h,)): aten's
    kernel, as an op inductor calls instead of generating code for."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, rows, -1, False)


@embedding_grad.register_fake
def _(grad: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    return grad.new_empty((rows, grad.shape[-1]))


class _Lookup(torch.autograd.Function):
    """F.embedding whose backward is `embedding_grad`."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return embedding_grad(grad.contiguous(), ids, ctx.rows), None


def lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight). Inside a compiled graph its backward is aten's kernel (`embedding_grad`):
    inductor's own code for it adds each looked-up row into the table gradient by an atomic add per
    element, about 3x aten's time on CPU (docs/PERFORMANCE.md)."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled() and weight.requires_grad:
        return _Lookup.apply(weight, ids)
    return F.embedding(ids, weight)
