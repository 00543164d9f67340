"""Megatron-LM's indexed dataset (.bin/.idx), byte for byte, so files move between the two: the
format and its memory-mapped reader (writing and merging: megalm.data.formats.indexed_writer).

`.idx` (little-endian): magic b"MMIDIDX\\x00\\x00", u64 version (1), u8 dtype code, u64 sequence
count N, u64 document-index count D+1, int32[N] sequence lengths, int64[N] byte offsets of the
sequences in `.bin`, int64[D+1] document indices (document d is sequences [doc_idx[d],
doc_idx[d+1])), and optionally int8[N] sequence modes (Megatron's multimodal variant).
`.bin`: the tokens of all sequences back to back, no header.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Optional, Tuple, Union

import numpy as np

from megalm.errors import DataError, MissingFileError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D+1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_SCAN_CHUNK = 1 << 24  # tokens per step of a full scan of .bin (32 MB of uint16)

PathLike = Union[str, os.PathLike]


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while the ids fit (with its margin), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dataset_paths(prefix: PathLike) -> Tuple[Path, Path]:
    """(`<prefix>.bin`, `<prefix>.idx`)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """Reads `<prefix>.bin`/`.idx` through memory maps; item i is sequence i's tokens."""

    def __init__(self, prefix: PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = bin_path, idx_path = dataset_paths(prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise MissingFileError(f"{path} does not exist (indexed dataset prefix {self.prefix!r} "
                                       "needs both .idx and .bin)")
        idx_bytes = idx_path.stat().st_size
        if idx_bytes < HEADER.size:
            raise DataError(f"{idx_path}: {idx_bytes} bytes is shorter than the {HEADER.size}-byte header")
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        magic, version, code, n, n_doc_idx = HEADER.unpack(bytes(buf[:HEADER.size]))
        if magic != MAGIC:
            raise DataError(f"{idx_path}: bad magic {magic!r}, expected {MAGIC!r} "
                            "(not a Megatron indexed dataset index)")
        if version != VERSION:
            raise DataError(f"{idx_path}: version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        expected = HEADER.size + 12 * n + 8 * n_doc_idx
        if idx_bytes not in (expected, expected + n):  # + int8[N] sequence modes
            raise DataError(f"{idx_path}: {idx_bytes} bytes, but a header of {n} sequences and "
                            f"{n_doc_idx} document indices needs {expected}")
        self.sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER.size)
        self.pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER.size + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype="<i8", count=n_doc_idx, offset=HEADER.size + 12 * n)
        self.modes = (np.frombuffer(buf, dtype=np.int8, count=n, offset=expected)
                      if idx_bytes == expected + n and n else None)

        # Token offset of every sequence; tokens of sequence i are tokens[offsets[i]:offsets[i+1]].
        self.offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.offsets[1:])
        bin_bytes = bin_path.stat().st_size
        need = int(self.offsets[-1]) * self.dtype.itemsize
        if bin_bytes != need:
            raise DataError(f"{bin_path}: {bin_bytes} bytes, but {idx_path} describes "
                            f"{int(self.offsets[-1])} tokens of {self.dtype} = {need} bytes")
        if self.sizes.size and self.sizes.min() < 0:
            raise DataError(f"{idx_path}: negative sequence length {int(self.sizes.min())}")
        if not np.array_equal(self.pointers, self.offsets[:-1] * self.dtype.itemsize):
            raise DataError(f"{idx_path}: sequence pointers are not the running sum of the lengths")
        d = self.doc_idx
        if n_doc_idx < 1 or d[0] != 0 or d[-1] != n or np.any(np.diff(d) < 0):
            raise DataError(f"{idx_path}: document indices must rise from 0 to {n} "
                            f"(got {n_doc_idx} entries from {d[0] if n_doc_idx else None} "
                            f"to {d[-1] if n_doc_idx else None})")
        # np.memmap cannot map an empty file.
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_bytes
                       else np.zeros(0, dtype=self.dtype))
        self._token_range: Optional[Tuple[int, int]] = None

    def __len__(self) -> int:
        return self.sizes.size

    @property
    def num_documents(self) -> int:
        return self.doc_idx.size - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def document_offsets(self) -> np.ndarray:
        """int64[D+1]: the tokens of document d are tokens[o[d]:o[d+1]] (its sequences are contiguous)."""
        return self.offsets[self.doc_idx]

    def document_lengths(self) -> np.ndarray:
        """int64[D]: tokens per document."""
        return np.diff(self.document_offsets())

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

    def fingerprint(self) -> str:
        """Names these exact files for cache keys: resolved path, sizes and modification times."""
        parts = []
        for path in (self.idx_path, self.bin_path):
            st = path.stat()
            parts.append(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        return "|".join(parts)

    def token_range(self) -> Tuple[int, int]:
        """(smallest, largest) token id in .bin, by a chunked scan of the memory map; (0, -1) if empty."""
        if self._token_range is None:
            lo, hi = 0, -1
            for start in range(0, self.num_tokens, _SCAN_CHUNK):
                chunk = self.tokens[start:start + _SCAN_CHUNK]
                c_lo, c_hi = int(chunk.min()), int(chunk.max())
                lo, hi = (c_lo, c_hi) if hi < lo else (min(lo, c_lo), max(hi, c_hi))
            self._token_range = (lo, hi)
        return self._token_range

    def check_vocab(self, vocab_size: int, token_range: Optional[Tuple[int, int]] = None) -> None:
        """Raise ValueError naming the file, the id and where it is if a token is outside [0, vocab_size).

        `token_range` is a known (min, max) of the file (a cached scan); None scans it now.
        """
        lo, hi = token_range if token_range is not None else self.token_range()
        if hi < lo or (lo >= 0 and hi < vocab_size):
            return
        bad = hi if hi >= vocab_size else lo
        pos = None  # find the first offender, chunk by chunk (only on the error path)
        for start in range(0, self.num_tokens, _SCAN_CHUNK):
            chunk = self.tokens[start:start + _SCAN_CHUNK]
            hits = np.flatnonzero((chunk >= vocab_size) | (chunk < 0))
            if hits.size:
                pos, bad = start + int(hits[0]), int(chunk[hits[0]])
                break
        where = ""
        if pos is not None:
            seq = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            doc = int(np.searchsorted(self.doc_idx, seq, side="right")) - 1
            where = f" at token {pos} (document {doc}, {pos - int(self.offsets[self.doc_idx[doc]])} tokens in)"
        raise DataError(f"{self.bin_path}: token id {bad}{where} is outside the tokenizer's vocabulary of "
                        f"{vocab_size} ids (the file holds ids {lo}..{hi}); was it tokenized with another "
                        "tokenizer?")

    def __reduce__(self):
        # Reopen by path in worker processes instead of pickling the mapped arrays.
        return (IndexedDataset, (self.prefix,))

