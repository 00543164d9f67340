"""Megatron-LM's indexed dataset (.bin/.idx), byte for byte, so files move between the two.

`.idx` (little-endian): magic b"MMIDIDX\\x00\\x00", u64 version (1), u8 dtype code, u64 sequence
count N, u64 document-index count D+1, int32[N] sequence lengths, int64[N] byte offsets of the
sequences in `.bin`, int64[D+1] document indices (document d is sequences [doc_idx[d],
doc_idx[d+1])). `.bin`: the tokens of all sequences back to back, no header.
"""

from __future__ import annotations

import os
import struct
import tempfile
from array import array
from pathlib import Path
from typing import Iterable, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D+1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

PathLike = Union[str, os.PathLike]


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while the ids fit (with its margin), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _paths(prefix: PathLike) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin`/`.idx`; only the lengths stay in memory.

    Both files are written under temporary names; finalize() renames .bin and then .idx into
    place, so a reader never finds an .idx whose .bin is incomplete. Use as a context manager
    to finalize on success and discard the temporaries on error.
    """

    def __init__(self, prefix: PathLike, dtype=np.uint16):
        self._dtype = np.dtype(dtype)
        if self._dtype not in _CODE_OF:
            raise ValueError(f"dtype {self._dtype} is not one the format supports: "
                             f"{', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())}")
        self._dtype = self._dtype.newbyteorder("<")
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._bin_tmp = tempfile.mkstemp(dir=self.bin_path.parent, prefix=f".{self.bin_path.name}.")
        self._bin = os.fdopen(fd, "wb")
        self._sizes = array("q")
        self._done = False

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document, stored as one sequence."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {arr.shape}")
        if arr.size:
            info = np.iinfo(self._dtype) if self._dtype.kind in "iu" else np.finfo(self._dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise ValueError(f"ids in [{lo}, {hi}] do not fit the dataset dtype {self._dtype} "
                                 f"([{info.min}, {info.max}])")
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {arr.size} tokens exceeds the format's int32 length")
        self._bin.write(arr.astype(self._dtype, copy=False).tobytes())
        self._sizes.append(arr.size)

    def finalize(self) -> None:
        if self._done:
            return
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if self._sizes else np.zeros(0, np.int64)
        n = sizes.size
        pointers = np.zeros(n, dtype="<i8")
        np.cumsum(sizes[:-1] * self._dtype.itemsize, out=pointers[1:])
        fd, idx_tmp = tempfile.mkstemp(dir=self.idx_path.parent, prefix=f".{self.idx_path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self._dtype.newbyteorder("=")], n, n + 1))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(n + 1, dtype="<i8").tobytes())  # one sequence per document
            f.flush()
            os.fsync(f.fileno())
        # Drop a previous .idx first: if we stop between the two renames, the new .bin
        # must not be paired with the old index.
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(idx_tmp, self.idx_path)
        self._done = True

    def abort(self) -> None:
        """Discard what was written; nothing appears under the final names."""
        if not self._done:
            self._bin.close()
            Path(self._bin_tmp).unlink(missing_ok=True)
            self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Reads `<prefix>.bin`/`.idx` through memory maps; item i is sequence i's tokens."""

    def __init__(self, prefix: PathLike):
        self.prefix = str(prefix)
        bin_path, idx_path = _paths(prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist (indexed dataset prefix {self.prefix!r} "
                                        "needs both .idx and .bin)")
        idx_bytes = idx_path.stat().st_size
        if idx_bytes < _HEADER.size:
            raise ValueError(f"{idx_path}: {idx_bytes} bytes is shorter than the {_HEADER.size}-byte header")
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        magic, version, code, n, n_doc_idx = _HEADER.unpack(bytes(buf[:_HEADER.size]))
        if magic != MAGIC:
            raise ValueError(f"{idx_path}: bad magic {magic!r}, expected {MAGIC!r} "
                             "(not a Megatron indexed dataset index)")
        if version != VERSION:
            raise ValueError(f"{idx_path}: version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        expected = _HEADER.size + 12 * n + 8 * n_doc_idx
        if idx_bytes != expected:
            raise ValueError(f"{idx_path}: {idx_bytes} bytes, but a header of {n} sequences and "
                             f"{n_doc_idx} document indices needs {expected}")
        self.sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=_HEADER.size)
        self.pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=_HEADER.size + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype="<i8", count=n_doc_idx, offset=_HEADER.size + 12 * n)

        # Token offset of every sequence; tokens of sequence i are tokens[offsets[i]:offsets[i+1]].
        self.offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.offsets[1:])
        bin_bytes = bin_path.stat().st_size
        need = int(self.offsets[-1]) * self.dtype.itemsize
        if bin_bytes != need:
            raise ValueError(f"{bin_path}: {bin_bytes} bytes, but {idx_path} describes "
                             f"{int(self.offsets[-1])} tokens of {self.dtype} = {need} bytes")
        if not np.array_equal(self.pointers, self.offsets[:-1] * self.dtype.itemsize):
            raise ValueError(f"{idx_path}: sequence pointers are not the running sum of the lengths")
        d = self.doc_idx
        if n_doc_idx < 1 or d[0] != 0 or d[-1] != n or np.any(np.diff(d) < 0):
            raise ValueError(f"{idx_path}: document indices must rise from 0 to {n} "
                             f"(got {n_doc_idx} entries from {d[0] if n_doc_idx else None} "
                             f"to {d[-1] if n_doc_idx else None})")
        # np.memmap cannot map an empty file.
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_bytes
                       else np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        return self.sizes.size

    @property
    def num_documents(self) -> int:
        return self.doc_idx.size - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i %= n
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def get_document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences are contiguous in .bin)."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} out of range for {self.num_documents} documents in {self.prefix}")
        return self.tokens[self.offsets[self.doc_idx[d]]:self.offsets[self.doc_idx[d + 1]]]

    def __reduce__(self):
        # Reopen by path in worker processes instead of pickling the mapped arrays.
        return (IndexedDataset, (self.prefix,))
