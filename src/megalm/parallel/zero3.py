"""ZeRO-3: parameters sharded over dp as well, gathered one layer at a time when they are used.

ZeRO stage 3 (arXiv:1910.02054, sec. 5.3) on top of the buckets of `megalm.parallel.data`: every
unit of the model (the family's first-stage modules, each layer, its last-stage modules: the
embedding, each block, the final norm, the head for GPT) gets buckets of its own (the experts that
expert parallelism splits in buckets apart, sharded over the ranks holding the same experts), and at
rest a rank keeps only its 1/dp chunk of each bucket's parameters (`param_shard`, which
its optimizer updates). The flat buffer the model's parameters view keeps its tensor but has its
storage freed (resized to 0 bytes), so the parameter objects, autograd's references to them and
the optimizer's bookkeeping never change; only the bytes come and go.

- forward: a pre-hook all-gathers the unit's buckets (and starts the next unit's gather, so it
  overlaps this unit's compute); a post-hook frees them again, and hooks the unit's outputs.
- backward: the output hook fires when the gradient reaches the unit, before its backward runs,
  and gathers the buckets again (and starts the gather of the unit before it, whose backward comes
  next, so that one too overlaps this unit's compute); they are freed once every parameter of the
  unit has had its gradient of that micro-batch accumulated. Gradients are reduce-scattered as in
  ZeRO-2.
- Zero-bubble schedules assign weight gradients themselves (no accumulate hooks fire), so there
  a unit stays gathered from its input-gradient pass until the step's backward ends.
- The optimizer step writes only the shards; the next forward gathers the new values. With main
  parameters the kept shard is in the weights' dtype, the fp32 main shard beside it, and the
  all-gathers move the weights' dtype.

Why our own rather than FSDP2's fully_shard: it would turn parameters into DTensors over the dp
mesh, while the tensor-parallel shards, the gradient norm, the replica sums and the checkpoint
code here work on plain tensors; and ZeRO-3 built on the same flat buckets as stages 1 and 2 keeps
their communication schedule and their checkpoint form, so a checkpoint moves between all four
stages unchanged.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from megalm.distributed.async_comm import bucket_all_gather
from megalm.family import Parts
from megalm.parallel.data import Bucket, DataParallel, capped_groups


def model_units(model: nn.Module, parts: Parts) -> List[nn.Module]:
    """The modules whose parameters are gathered together, in forward order (this stage's part): each
    of the family's first-stage modules, each layer, each last-stage module (its megalm.family.Parts)."""
    held = [getattr(model, name) for name in parts.first]
    held += list(getattr(model, parts.layers).values())
    held += [getattr(model, name) for name in parts.last]
    return [m for m in held if m is not None and any(True for _ in m.parameters())]


class FullyShardedDataParallel(DataParallel):
    """DataParallel with zero_stage 3: weights, gradients and optimizer state sharded over dp."""

    def __init__(self, model: nn.Module, parts: Parts, mesh, layout, bucket_size_mb: Optional[float] = None,
                 param_dtype=None):
        self.units = model_units(model, parts)
        super().__init__(model, mesh, layout, zero_stage=3, bucket_size_mb=bucket_size_mb, param_dtype=param_dtype)
        self.unit_buckets: Dict[nn.Module, List[Bucket]] = {}
        for unit in self.units:
            buckets = []
            for p in unit.parameters():
                b = self.where[p][0]
                if all(b is not x for x in buckets):  # identity: a dataclass's == compares tensors
                    buckets.append(b)
            self.unit_buckets[unit] = buckets
        self.next_unit = {a: b for a, b in zip(self.units, self.units[1:])}
        self.previous_unit = {b: a for a, b in zip(self.units, self.units[1:])}
        # The hooks resize storages and wait on async gathers: torch.compile (trainer.compile) runs them
        # eagerly between its graphs rather than tracing them.
        pre, post = torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward)
        for unit in self.units:
            unit.register_forward_pre_hook(pre)
            unit.register_forward_hook(post)

    # -- layout: buckets never span two units ----------------------------------------------------
    def _param_groups(self, cap: int) -> List[List[nn.Parameter]]:
        owner: Dict[nn.Parameter, int] = {}
        for i, unit in enumerate(self.units):
            for p in unit.parameters():
                owner.setdefault(p, i)
        loose = [n for n, p in self.model.named_parameters() if p.requires_grad and p not in owner]
        if loose:
            raise ValueError(f"parallel.zero_stage=3 gathers parameters by unit (the family's Parts: first-stage "
                             f"modules, layers, last-stage modules); these belong to none: {loose}")
        groups: List[List[nn.Parameter]] = []
        for i in reversed(range(len(self.units))):
            params = [p for p in self.params if owner[p] == i]
            split = [getattr(p, "ep_shard", None) is not None for p in params]
            # The tied weight keeps a bucket of its own, as under stages 1 and 2; so do the experts expert
            # parallelism splits, which are sharded over the ranks holding the same experts.
            for part in ([p for p, e in zip(params, split) if p is not self.tied and not e],
                         [p for p, e in zip(params, split) if e], [p for p in params if p is self.tied]):
                groups += capped_groups(part, cap)
        return groups

    def _owned(self, b: Bucket) -> torch.Tensor:
        if b.param_shard is None:
            b.param_shard = torch.zeros(b.shard_size, dtype=b.param_buf.dtype, device=b.param_buf.device)
        return b.param_shard

    def _shard_parameters(self, device) -> None:
        super()._shard_parameters(device)
        for b in self.buckets:
            lo = b.rank * b.shard_size
            self._owned(b).copy_(b.param_buf[lo:lo + b.shard_size])
            b.gathered = True
            self._free(b)

    # -- gather and free -------------------------------------------------------------------------
    def _gather(self, b: Bucket, wait: bool = True) -> None:
        if not b.gathered:
            b.param_buf.untyped_storage().resize_(b.size * b.param_buf.element_size())
            with torch.no_grad():
                b.gather_work = bucket_all_gather(b.param_buf, b.param_shard, b.group, async_op=True)
            b.gathered = True
        if wait and b.gather_work is not None:
            b.gather_work.wait()
            b.gather_work = None

    def _free(self, b: Bucket) -> None:
        if b.gathered and not b.pending and not b.in_use:
            if b.gather_work is not None:
                b.gather_work.wait()
                b.gather_work = None
            b.param_buf.untyped_storage().resize_(0)
            b.gathered = False

    def _pre_forward(self, unit: nn.Module, args) -> None:
        for b in self.unit_buckets[unit]:
            self._gather(b)
            b.in_use = True
        nxt = self.next_unit.get(unit)
        if nxt is not None:  # prefetch: its all-gather runs while this unit computes
            for b in self.unit_buckets[nxt]:
                self._gather(b, wait=False)

    def _post_forward(self, unit: nn.Module, args, out) -> None:
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))
        for b in self.unit_buckets[unit]:
            b.in_use = False
            self._free(b)

    def _pre_backward(self, unit: nn.Module, grad) -> None:
        for b in self.unit_buckets[unit]:
            self._gather(b)
            b.pending.update(p for p in b.params if p.requires_grad)
        before = self.previous_unit.get(unit)
        if before is not None:  # prefetch: the unit whose backward comes next gathers while this one computes
            for b in self.unit_buckets[before]:
                self._gather(b, wait=False)

    def _on_grad(self, p: nn.Parameter) -> None:
        super()._on_grad(p)
        b = self.where[p][0]
        b.pending.discard(p)
        self._free(b)

    def finish(self) -> None:
        super().finish()
        self.release()

    def release(self) -> None:
        """Free every gathered bucket (the end of a step's backward)."""
        for b in self.buckets:
            b.pending.clear()
            b.in_use = False
            self._free(b)

    def gather_params(self) -> None:
        self.cast_main_params()  # the next forward gathers the updated shards, unit by unit

    def weight_bytes(self) -> int:
        return sum(b.param_shard.numel() * b.param_shard.element_size()
                   + b.param_buf.untyped_storage().nbytes() for b in self.buckets)
