"""Reading a checkpoint without running code from it.

DCP's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and its default load
planner reads non-tensor entries (optimizer hyper-parameters, Adam's step when it is a float)
with `torch.load(weights_only=False)`, so a crafted checkpoint could run any code on every rank
that loads it. Here the metadata goes through an unpickler that builds only DCP's own metadata
classes (and torch.Size, dtypes, layouts, paths), and non-tensor entries through
`torch.load(weights_only=True)`. DCP already reads tensor data weights-only.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megalm.errors import CheckpointError

# (module, name) pairs a DCP .metadata file is built from, and nothing else.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided and kin, by name
    ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint file asks to build something other than checkpoint data."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self.where} asks to build {module}.{name}, which is not part of a "
                                    "checkpoint's metadata; refusing to load it (it could run code)")


def load_state(state: dict, path: str | Path, metadata_read: bool = False) -> None:
    """dcp.load of `state` in place from the step folder `path`, through the safe reader and
    planner; a refused file raises UnsafeCheckpointError itself rather than DCP's wrapper.
    `metadata_read`: the caller has read the metadata through read_metadata already."""
    if not metadata_read:  # first, so a refused .metadata says so rather than through DCP's wrappers
        read_metadata(path)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except CheckpointException as e:  # a BaseException: it carries each rank's exception
        for exc, _ in e.failures.values():
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None
        raise


def _custom_leaves(sd: dict):
    """(container, key, value) of every value that follows DCP's chunk protocol without being a tensor."""
    for key, value in sd.items():
        if isinstance(value, dict):
            yield from _custom_leaves(value)
        elif hasattr(value, "__get_tensor_shard__") and not torch.is_tensor(value):
            yield sd, key, value


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of the step folder `path`, read without executing anything from it."""
    return SafeFileSystemReader(path).read_metadata()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries weights-only (and finds the blocks of
    megalm.training.checkpoint.chunks.Chunked entries)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's _init_state_dict replaces values of types it does not know with None, in place:
        # put the Chunked entries back and flatten again.
        custom = list(_custom_leaves(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if custom:
            for container, key, obj in custom:
                container[key] = obj
            self.state_dict = self.original_state_dict
            if self.flatten_state_dict:
                self.state_dict, self.mappings = flatten_state_dict(self.original_state_dict)

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        if hasattr(obj, "__get_tensor_shard__") and not torch.is_tensor(obj):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint entry {fqn!r} holds a pickled object that weights-only "
                                        f"loading refuses: {e}") from None
        if self.flatten_state_dict:  # placed as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
