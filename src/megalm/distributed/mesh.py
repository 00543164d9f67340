"""Parallel degrees and the device mesh they describe.

Rank order follows Megatron: tp varies fastest, then cp, dp, pp, so a tensor-parallel group
stays inside a node. Process groups are handed down from the mesh as arguments; nothing here
is a module global. With context parallelism the mesh also has `dp_cp`, dp and cp flattened:
the ranks that hold the same weights (`replica_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalm.errors import ConfigError

MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest varying


@dataclass(frozen=True)
class ParallelDims:
    tp: int
    pp: int
    dp: int
    cp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @classmethod
    def from_config(cls, p, world_size: int) -> "ParallelDims":
        """Resolve dp = -1 against the world size; every error carries the numbers."""
        for key in ("tp", "pp", "cp"):
            if getattr(p, key) < 1:
                raise ConfigError(f"parallel.{key}={getattr(p, key)} must be at least 1")
        model_parallel = p.tp * p.pp * p.cp
        if p.dp == -1:
            if world_size % model_parallel:
                raise ConfigError(
                    f"world size {world_size} is not divisible by tp({p.tp}) * pp({p.pp}) * "
                    f"cp({p.cp}) = {model_parallel}, so dp=-1 has no whole value")
            dp = world_size // model_parallel
        elif p.dp < 1:
            raise ConfigError(f"parallel.dp={p.dp} must be at least 1, or -1 for the rest of the world")
        else:
            dp = p.dp
        dims = cls(tp=p.tp, pp=p.pp, dp=dp, cp=p.cp)
        if dims.world_size != world_size:
            raise ConfigError(
                f"tp({p.tp}) * pp({p.pp}) * dp({dp}) * cp({p.cp}) = {dims.world_size} "
                f"!= world size ({world_size})")
        return dims

    def ranks_needed(self) -> int:
        return self.world_size


def build_mesh(dims: ParallelDims, device_type: str) -> Optional["torch.distributed.device_mesh.DeviceMesh"]:
    """A DeviceMesh with dims (pp, dp, cp, tp); None in a single process without a process group."""
    if dims.world_size == 1 and not torch.distributed.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh
    shape = tuple(getattr(dims, d) for d in MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    if dims.cp > 1:
        mesh.replicas = mesh["dp", "cp"]._flatten(REPLICAS)  # kept: slicing a flattened dim from the root is deprecated
    return mesh


REPLICAS = "dp_cp"  # the ranks holding the same weights: dp x cp, flattened (context parallelism)


def replica_mesh(mesh):
    """The mesh dimension over which gradients are averaged and ZeRO shards: dp, or dp x cp flattened
    when context parallelism splits each sequence over cp ranks that hold the same weights."""
    return mesh.replicas if mesh["cp"].size() > 1 else mesh["dp"]
