"""Where a rank's shard of a parameter sits in the full tensor.

Tensor parallelism tags each sharded parameter with `tp_shard`, expert parallelism a stack of experts
with `ep_shard` (both TPShard): initialisation draws the full tensor of a global name and keeps the
rank's slice, checkpoints write each slice at its place in the full tensor, and conversions put the
slices back together. Plain data, no process group: every layer above may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class TPShard:
    """Where a rank's shard sits in the full tensor: even slices of every segment along `dim`.

    A fused weight such as QKV ([q | k | v] rows) must not be cut into contiguous blocks, or
    rank 0 would get all of q; instead each segment is split and a rank holds
    [q_r | k_r | v_r], which keeps its heads whole and the local split sizes proportional.
    """
    dim: int
    rank: int
    world: int
    segments: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"TPShard rank {self.rank} outside a group of {self.world}")
        if self.segments is not None:
            object.__setattr__(self, "segments", tuple(int(s) for s in self.segments))
            bad = [s for s in self.segments if s % self.world]
            if bad:
                raise ValueError(f"segments {list(self.segments)}: sizes {bad} are not divisible by "
                                 f"the tensor-parallel size {self.world}")

    def _segments(self, full_size: int) -> Tuple[int, ...]:
        if self.segments is None:
            if full_size % self.world:
                raise ValueError(f"size {full_size} of dim {self.dim} is not divisible by the "
                                 f"tensor-parallel size {self.world}")
            return (full_size,)
        if sum(self.segments) != full_size:
            raise ValueError(f"segments {list(self.segments)} sum to {sum(self.segments)}, "
                             f"but dim {self.dim} has size {full_size}")
        return self.segments

    def full_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        """Shape of the full tensor whose shard has `local_shape`."""
        shape = list(local_shape)
        shape[self.dim] *= self.world
        return tuple(shape)

    def local(self, full: Tensor) -> Tensor:
        """This rank's shard of `full` (a copy-free view where the layout allows)."""
        parts = []
        start = 0
        for seg in self._segments(full.shape[self.dim]):
            n = seg // self.world
            parts.append(full.narrow(self.dim, start + self.rank * n, n))
            start += seg
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def shard_specs(p) -> Tuple[TPShard, ...]:
    """How a parameter is split: its expert-parallel shard (`ep_shard`, dim 0 of a stack of experts) and its
    tensor-parallel one (`tp_shard`), those it has; each on its own dim."""
    return tuple(s for s in (getattr(p, "ep_shard", None), getattr(p, "tp_shard", None)) if s is not None)


def full_from_shards(shards: List[Tensor], spec: TPShard) -> Tensor:
    """Inverse of TPShard.local: the full tensor from every rank's shard, in rank order."""
    if len(shards) != spec.world:
        raise ValueError(f"got {len(shards)} shards for a tensor-parallel size of {spec.world}")
    local_size = shards[0].shape[spec.dim]
    segments = spec.segments or (local_size * spec.world,)
    local_segs = [s // spec.world for s in segments]
    if sum(local_segs) != local_size:
        raise ValueError(f"shards have size {local_size} on dim {spec.dim}; segments "
                         f"{list(segments)} need {sum(local_segs)} per rank")
    per_rank = [s.split(local_segs, dim=spec.dim) for s in shards]  # [rank][segment]
    return torch.cat([per_rank[r][i] for i in range(len(local_segs)) for r in range(spec.world)],
                     dim=spec.dim)
