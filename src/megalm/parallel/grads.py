"""Gradient reductions after the backward pass, and the global gradient norm.

- Sequence parallel: norms (and row-parallel biases) see only this rank's sequence shard, so
  their gradients are partial sums over the tp group (Megatron: arXiv:2205.05198, sec. 4.2.2).
- Data parallel: gradients are averaged over the dp group (megalm.parallel.data buckets and
  overlaps this; `finalize_grads` here is the unbucketed form for scripts).
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
from megalm.distributed.mesh import replica_mesh


def _all_reduce_coalesced(grads: List[torch.Tensor], group, scale: float = 1.0) -> None:
    if not grads:
        return
    flat = all_reduce_sum(_flatten_dense_tensors(grads), group)
    if scale != 1.0:
        flat.mul_(scale)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def sum_replicas(sp: List[torch.Tensor], tp_group, tied: List[torch.Tensor], embedding_group) -> None:
    """Sum `sp` (gradients of sequence-parallel parameters) over tp, and `tied` (the tied
    embedding's, first stage, or its head copy's, last stage) over the embedding group."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        _all_reduce_coalesced(sp, tp_group)
    if embedding_group is not None:
        _all_reduce_coalesced(tied, embedding_group)


def finalize_grads(model: nn.Module, mesh, layout) -> None:
    """Unbucketed gradient synchronisation after backward, for scripts that drive a model by hand
    (the trainer uses megalm.parallel.data.DataParallel, which overlaps the dp reduction)."""
    if mesh is None:
        return
    tp, dp = mesh["tp"], replica_mesh(mesh)
    group = layout.embedding_group
    tied = []
    if group is not None:
        weight = layout.tied_param(model)
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        tied = [weight.grad]
    sp = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "sequence_parallel", False)]
    sum_replicas(sp, tp.get_group(), tied, group)
    if dp.size() > 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        _all_reduce_coalesced(grads, dp.get_group(), scale=1.0 / dp.size())


def grad_norm_sq(params: Iterable[nn.Parameter], tp_group=None, pp_group=None, dp_group=None,
                 ep_group=None) -> torch.Tensor:
    """Squared global L2 norm of the gradients, each parameter counted once across tp and pp.

    With `dp_group` the params are ZeRO shards, disjoint over dp: their sums add up over it. Experts
    split by expert parallelism (tagged ep_shard) are disjoint over `ep_group` (and over tp where expert
    tensor parallelism splits them too); as ZeRO shards (over the ranks holding the same experts) they are
    disjoint over all of dp."""
    sharded, replicated, experts, experts_tp = [], [], [], []
    for p in params:
        if p.grad is not None and getattr(p, "tied_copy_of", None) is None:
            split = getattr(p, "tp_shard", None) is not None  # (experts too, under expert tensor parallelism)
            if getattr(p, "ep_shard", None) is not None and dp_group is None:
                (experts_tp if split else experts).append(p.grad)
            else:
                (sharded if split else replicated).append(p.grad)

    def sq(grads: List[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        return torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in grads]).sum()

    total_sharded = sq(sharded)
    total_replicated = sq(replicated).to(total_sharded.device)
    if dp_group is not None:
        both = all_reduce_sum(torch.stack([total_sharded, total_replicated]), dp_group)
        total_sharded, total_replicated = both[0], both[1]
    if tp_group is not None:
        all_reduce_sum(total_sharded, tp_group)
    total = total_sharded + total_replicated
    if experts or experts_tp:
        total_experts = sq(experts).to(total.device)
        if experts_tp:
            slices = sq(experts_tp).to(total.device)
            total_experts = total_experts + (all_reduce_sum(slices, tp_group) if tp_group is not None else slices)
        if ep_group is not None:
            all_reduce_sum(total_experts, ep_group)
        total = total + total_experts
    if pp_group is not None:  # stages hold disjoint layers
        all_reduce_sum(total, pp_group)
    return total


def clip_grads(params: List[nn.Parameter], max_norm: float, tp_group=None,
               pp_group=None, dp_group=None, ep_group=None) -> Tuple[torch.Tensor, bool]:
    """Global gradient norm before clipping, and whether it was finite; scales grads to max_norm."""
    norm = grad_norm_sq(params, tp_group, pp_group, dp_group, ep_group).sqrt()
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
