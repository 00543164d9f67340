"""Gradient reductions after the backward pass, and the global gradient norm.

- Sequence parallel: norms (and row-parallel biases) see only this rank's sequence shard, so
  their gradients are partial sums over the tp group (Megatron: arXiv:2205.05198, sec. 4.2.2).
- Data parallel: gradients are averaged over the dp group, coalesced into one flat buffer so a
  step issues one all-reduce rather than one per parameter.
- Tied embedding across pipeline stages: the first stage's embedding and the last stage's head
  copy get the sum of both gradients (Megatron's embedding group).
- Norm: parameters sharded over tp (`tp_shard`) contribute their squares summed across the tp
  group; replicated ones (norm weights, row-parallel biases) count once; stages' sums add up
  over the pp group; a tied embedding counts once (the head copy is left out).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch import nn

from megalm.distributed.comm import all_reduce_sum


def _all_reduce_coalesced(grads: List[torch.Tensor], group, scale: float = 1.0) -> None:
    if not grads:
        return
    flat = all_reduce_sum(_flatten_dense_tensors(grads), group)
    if scale != 1.0:
        flat.mul_(scale)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def finalize_grads(model: nn.Module, mesh) -> None:
    """Make every rank's gradients the gradients of the global batch's mean loss."""
    if mesh is None:
        return
    tp, dp = mesh["tp"], mesh["dp"]
    if tp.size() > 1:
        partial = [p.grad for p in model.parameters()
                   if p.grad is not None and getattr(p, "sequence_parallel", False)]
        _all_reduce_coalesced(partial, tp.get_group())
    group = getattr(model, "embedding_group", None)
    if group is not None:  # tied embedding (first stage) and head (last stage): sum their gradients
        weight = model.embed.tok.weight if model.embed is not None else model.head.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        all_reduce_sum(weight.grad, group)
    if dp.size() > 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        _all_reduce_coalesced(grads, dp.get_group(), scale=1.0 / dp.size())


def grad_norm_sq(params: Iterable[nn.Parameter], tp_group=None, pp_group=None) -> torch.Tensor:
    """Squared global L2 norm of the gradients, each parameter counted once across tp and pp."""
    sharded, replicated = [], []
    for p in params:
        if p.grad is not None and getattr(p, "tied_copy_of", None) is None:
            (sharded if getattr(p, "tp_shard", None) is not None else replicated).append(p.grad)

    def sq(grads: List[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        return torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in grads]).sum()

    total_sharded = sq(sharded)
    if tp_group is not None:
        all_reduce_sum(total_sharded, tp_group)
    total = total_sharded + sq(replicated).to(total_sharded.device)
    if pp_group is not None:  # stages hold disjoint layers
        all_reduce_sum(total, pp_group)
    return total


def clip_grads(params: List[nn.Parameter], max_norm: float, tp_group=None,
               pp_group=None) -> Tuple[torch.Tensor, bool]:
    """Global gradient norm before clipping, and whether it was finite; scales grads to max_norm."""
    norm = grad_norm_sq(params, tp_group, pp_group).sqrt()
    finite = bool(torch.isfinite(norm))
    if max_norm > 0 and finite:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].device, grads[0].dtype))
    return norm, finite


def mean_over(value: torch.Tensor, group: Optional[object]) -> torch.Tensor:
    """Average a scalar over a group (the dp group for logged losses)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)
