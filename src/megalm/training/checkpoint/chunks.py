"""Where the pieces a rank holds sit in a tensor's global form, for sharded checkpoint writes.

A checkpoint stores every tensor under its global name and canonical shape (the full tensor,
vocabulary matrices with only the real rows). A rank holds part of it: its tensor-parallel
shard (`TPShard`: an even slice of every segment along one dim, so a fused QKV shard is three
blocks of the global tensor), and under ZeRO only a flat range of that shard. `place` cuts
such a holding into rectangular blocks with their global offsets, each a view of the rank's own
memory, and `Chunked` hands them to torch.distributed.checkpoint through the protocol DTensor
uses (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`). So each rank
writes only what it holds and loads straight into its own tensors, at any layout: DCP reads the
overlap of each requested block with whatever blocks were saved.

Written here rather than with DTensor: a DTensor shard is one even block per rank, which covers
neither fused segments, nor vocabulary rows cut at the real vocabulary size, nor ZeRO's flat
ranges that start mid-row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megalm.distributed.shards import TPShard

Block = Tuple[Tuple[int, ...], torch.Tensor]  # (global offsets, a view of this rank's memory)


@dataclass
class Chunked:
    """This rank's blocks of one global tensor of shape `shape`."""
    shape: torch.Size
    blocks: List[Block]

    def size(self) -> torch.Size:  # DCP compares it with the stored shape
        return self.shape

    def __create_write_items__(self, fqn: str, obj: object) -> List[WriteItem]:
        props = TensorProperties(dtype=self.blocks[0][1].dtype) if self.blocks else TensorProperties()
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), t.shape),
                                                      properties=props, size=self.shape))
                for off, t in self.blocks]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), t.shape) for off, t in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.blocks:
            if torch.Size(off) == index.offset:
                return t
        raise ValueError(f"no block at offset {tuple(index.offset)} of {index.fqn}")


def _rows(flat: torch.Tensor, shape: Tuple[int, int], start: int, stop: int):
    """Rectangles (r0, c0, view) of a 2-D tensor's elements [start, stop), `flat` holding them."""
    R, C = shape
    out = []
    pos = start
    while pos < stop:
        r, c = divmod(pos, C)
        if c == 0 and stop - pos >= C:  # whole rows: one block
            n = (stop - pos) // C
            out.append((r, 0, flat[pos - start:pos - start + n * C].view(n, C)))
            pos += n * C
        else:  # the part of one row
            end = min(stop, (r + 1) * C)
            out.append((r, c, flat[pos - start:end - start].view(1, end - pos)))
            pos = end
    return out


def _tp_pieces(spec, local_len: int) -> List[Tuple[int, int, int]]:
    """(local start, global start, length) of each segment along the tensor-parallel dim."""
    if spec is None:
        return [(0, 0, local_len)]
    segments = spec.segments or (local_len * spec.world,)
    out, local, glob = [], 0, 0
    for seg in segments:
        n = seg // spec.world
        out.append((local, glob + spec.rank * n, n))
        local += n
        glob += seg
    return out


def place(flat: torch.Tensor, local_shape: Sequence[int], start: int, stop: int, spec=None,
          rows: Optional[int] = None, experts=None) -> Tuple[torch.Size, List[Block]]:
    """Global shape and this rank's blocks for elements [start, stop) of a local (tp-shard)
    tensor of `local_shape`, held by the 1-D `flat`. `spec` is its TPShard (None: not split),
    `rows` keeps only global rows below it (the real vocabulary). A stack of matrices (a mixture's
    experts, E x in x out) is stored as the rows of each, one after another (E in x out); `experts`
    is its expert-parallel shard (dim 0), and `spec` may split each matrix too (dim 1 or 2)."""
    shape = tuple(local_shape)
    if len(shape) == 3 and spec is not None:
        return _place_stack(flat, shape, start, stop, spec, experts)
    if len(shape) == 3:
        spec = experts  # whole matrices: the rank's experts are one run of rows
        shape = (shape[0] * shape[1], shape[2])
    if len(shape) not in (1, 2):
        raise ValueError(f"sharded checkpoint blocks need 1-D, 2-D or stacked 2-D tensors, not shape {shape}")
    one_d = len(shape) == 1
    shape2 = (1, shape[0]) if one_d else shape
    dim = None if spec is None else (1 if one_d else spec.dim)
    full = list(shape2)
    if spec is not None:
        full[dim] *= spec.world
    if rows is not None:
        full[0 if not one_d else 1] = rows
    blocks: List[Block] = []
    for r0, c0, view in _rows(flat, shape2, start, stop):
        lo = (r0, c0)
        pieces = [(lo, view)]
        if dim is not None:  # split at the segment boundaries and move each part to its global place
            pieces = []
            for l_start, g_start, n in _tp_pieces(spec, shape2[dim]):
                a, b = max(lo[dim], l_start), min(lo[dim] + view.shape[dim], l_start + n)
                if a < b:
                    off = list(lo)
                    off[dim] = g_start + (a - l_start)
                    pieces.append((tuple(off), view.narrow(dim, a - lo[dim], b - a)))
        for off, v in pieces:
            if rows is not None:  # cut at the real vocabulary
                vdim = 1 if one_d else 0
                keep = min(v.shape[vdim], rows - off[vdim])
                if keep <= 0:
                    continue
                v = v.narrow(vdim, 0, keep)
            if one_d:
                off, v = (off[1],), v.reshape(-1)
            blocks.append((tuple(off), v))
    size = torch.Size(full[1:] if one_d else full)
    return size, blocks


def _place_stack(flat: torch.Tensor, shape: Tuple[int, int, int], start: int, stop: int, spec,
                 experts) -> Tuple[torch.Size, List[Block]]:
    """`place` for a stack of matrices each split by `spec` (expert tensor parallelism): matrix by matrix,
    each one's blocks moved to its expert's rows."""
    E, n_in, n_out = shape
    inner = TPShard(spec.dim - 1, spec.rank, spec.world, spec.segments)
    full_in = n_in * (spec.world if inner.dim == 0 else 1)
    first = experts.rank * E if experts is not None else 0
    size = n_in * n_out
    blocks: List[Block] = []
    out_shape = None
    for e in range(E):
        lo, hi = max(start, e * size), min(stop, (e + 1) * size)
        if lo >= hi:
            continue
        out_shape, mine = place(flat[lo - start:hi - start], (n_in, n_out), lo - e * size, hi - e * size, inner)
        blocks += [((r + (first + e) * full_in, c), v) for (r, c), v in mine]
    if out_shape is None:
        out_shape, _ = place(flat[:0], (n_in, n_out), 0, 0, inner)
    total = E * (experts.world if experts is not None else 1) * full_in
    return torch.Size((total, out_shape[1])), blocks


class ChunkedSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that finds the data of a Chunked entry's blocks."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunked):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


def stage_to_cpu(state):
    """A copy of a checkpoint state dict in CPU memory that training can no longer change: each
    Chunked block and tensor cloned, the rest as is (for async_save, whose own stager would not
    know Chunked)."""
    if isinstance(state, Chunked):
        return Chunked(state.shape, [(off, t.detach().to("cpu", copy=True)) for off, t in state.blocks])
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: stage_to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [stage_to_cpu(v) for v in state]
    return state
