"""Writing Megatron's indexed dataset (.bin/.idx; the format: megalm.data.formats.indexed): a
streaming writer, and the merge of several datasets into one.

Writers put both files under temporary names and rename them into place at the end (.bin
first, after removing any old .idx; then .idx), so an interrupted write never leaves an .idx
whose .bin is incomplete: a reader finds either the old complete pair, or no .idx at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from array import array
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from megalm.data.formats.indexed import DTYPE_CODES, HEADER, MAGIC, VERSION, IndexedDataset, PathLike, dataset_paths
from megalm.errors import DataError

_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def _temp_file(final: Path) -> Tuple[int, str]:
    # Hidden and randomly named next to the final file: never taken for a dataset.
    return tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.")


def _write_index(final_idx: Path, dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray,
                 modes: Optional[np.ndarray] = None) -> str:
    """Write an .idx under a temporary name next to `final_idx`; return that name."""
    sizes = np.asarray(sizes, dtype=np.int64)
    n = sizes.size
    pointers = np.zeros(n, dtype="<i8")
    np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    fd, tmp = _temp_file(final_idx)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, _CODE_OF[dtype.newbyteorder("=")], n, doc_idx.size))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(doc_idx, dtype="<i8").tobytes())
            if modes is not None:
                f.write(np.asarray(modes, dtype=np.int8).tobytes())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _install(bin_tmp: str, idx_tmp: str, bin_path: Path, idx_path: Path) -> None:
    mode = 0o666 & ~_umask()  # mkstemp made them private; give them a normal file's mode
    os.chmod(bin_tmp, mode)
    os.chmod(idx_tmp, mode)
    # Drop a previous .idx first: if we stop between the two renames, the new .bin
    # must not be paired with the old index.
    idx_path.unlink(missing_ok=True)
    os.replace(bin_tmp, bin_path)
    os.replace(idx_tmp, idx_path)


def _check_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.newbyteorder("=") not in _CODE_OF:
        raise DataError(f"dtype {dtype} is not one the format supports: "
                        f"{', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())}")
    return dtype.newbyteorder("<")


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin`/`.idx`; only the lengths stay in memory.

    A document is one sequence (add_document) or several (add_documents with
    sequences_per_document: one sequence per sentence, as Megatron's --split-sentences writes).

    Both files are written under temporary names; finalize() renames .bin and then .idx into
    place, so a reader never finds an .idx whose .bin is incomplete. Use as a context manager
    to finalize on success and discard the temporaries on error.
    """

    def __init__(self, prefix: PathLike, dtype=np.uint16):
        self._dtype = _check_dtype(dtype)
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._bin_tmp = _temp_file(self.bin_path)
        self._bin = os.fdopen(fd, "wb")
        self._sizes = array("q")
        self._doc_idx = array("q", [0])  # sequence index where each document starts, then the end
        self._done = False
        info = np.iinfo(self._dtype) if self._dtype.kind in "iu" else np.finfo(self._dtype)
        self._lo, self._hi = info.min, info.max

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)

    def _check_range(self, arr: np.ndarray) -> None:
        if arr.size:
            lo, hi = arr.min(), arr.max()
            if lo < self._lo or hi > self._hi:
                raise DataError(f"ids in [{lo}, {hi}] do not fit the dataset dtype {self._dtype} "
                                f"([{self._lo}, {self._hi}])")

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document, stored as one sequence."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if arr.ndim != 1:
            raise DataError(f"a document must be a 1-D sequence of ids, got shape {arr.shape}")
        self._check_range(arr)
        if arr.size > np.iinfo(np.int32).max:
            raise DataError(f"a document of {arr.size} tokens exceeds the format's int32 length")
        self._bin.write(arr.astype(self._dtype, copy=False).tobytes())
        self._sizes.append(arr.size)
        self._doc_idx.append(len(self._sizes))

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int],
                      sequences_per_document: Optional[Sequence[int]] = None) -> None:
        """Append several documents at once: `tokens` is their ids back to back, `lengths` the sequence sizes.

        Without `sequences_per_document` each sequence is a document; with it, document d is the
        next sequences_per_document[d] sequences (at least one each; they must add up to len(lengths)).
        """
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.size or \
                (lengths.size and lengths.min() < 0):
            raise DataError(f"{lengths.size} sequence lengths summing to {int(lengths.sum())} do not "
                            f"describe {tokens.size} tokens")
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise DataError(f"a sequence of {lengths.max()} tokens exceeds the format's int32 length")
        if sequences_per_document is not None:
            counts = np.asarray(sequences_per_document, dtype=np.int64)
            if counts.ndim != 1 or int(counts.sum()) != lengths.size or (counts.size and counts.min() < 1):
                raise DataError(f"sequences_per_document (sum {int(counts.sum())}, smallest "
                                f"{int(counts.min()) if counts.size else None}) must give each document at "
                                f"least one sequence and add up to the {lengths.size} sequences given")
        self._check_range(tokens)
        self._bin.write(tokens.astype(self._dtype, copy=False).tobytes())
        first = len(self._sizes)
        self._sizes.extend(lengths.tolist())
        ends = (first + np.arange(1, lengths.size + 1) if sequences_per_document is None
                else first + np.cumsum(counts))
        self._doc_idx.extend(ends.tolist())

    def finalize(self) -> None:
        if self._done:
            return
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if self._sizes else np.zeros(0, np.int64)
        try:
            idx_tmp = _write_index(self.idx_path, self._dtype, sizes, np.frombuffer(self._doc_idx, dtype=np.int64))
        except BaseException:
            Path(self._bin_tmp).unlink(missing_ok=True)
            self._done = True
            raise
        _install(self._bin_tmp, idx_tmp, self.bin_path, self.idx_path)
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



def merge_datasets(prefixes: Sequence[PathLike], output_prefix: PathLike) -> IndexedDataset:
    """Concatenate several datasets into `output_prefix`: .bin files back to back, .idx rebuilt.

    The result equals preprocessing the inputs' documents in order into one dataset. All inputs
    must share one dtype; the output appears atomically, like the writer's.
    """
    if not prefixes:
        raise DataError("merge needs at least one input prefix")
    sets: List[IndexedDataset] = [IndexedDataset(p) for p in prefixes]
    dtypes = {str(s.dtype) for s in sets}
    if len(dtypes) > 1:
        listing = ", ".join(f"{s.prefix} ({s.dtype})" for s in sets)
        raise DataError(f"cannot merge datasets of different token dtypes: {listing}")
    with_modes = [s.modes is not None or len(s) == 0 for s in sets]
    if any(s.modes is not None for s in sets) and not all(with_modes):
        raise DataError("cannot merge datasets with sequence modes and datasets without: "
                         + ", ".join(f"{s.prefix} ({'modes' if s.modes is not None else 'no modes'})"
                                     for s in sets))
    bin_path, idx_path = dataset_paths(output_prefix)
    for s in sets:
        if s.bin_path.resolve() == bin_path.resolve():
            raise DataError(f"merge output {output_prefix} is also an input")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = sets[0].dtype
    sizes = np.concatenate([s.sizes.astype(np.int64) for s in sets])
    doc_parts, base = [], 0
    for s in sets:
        doc_parts.append(s.doc_idx[:-1] + base)
        base += len(s)
    doc_idx = np.concatenate(doc_parts + [np.array([base], dtype=np.int64)])
    modes = (np.concatenate([s.modes for s in sets if s.modes is not None])
             if any(s.modes is not None for s in sets) else None)
    fd, bin_tmp = _temp_file(bin_path)
    idx_tmp = None
    try:
        with os.fdopen(fd, "wb") as out:
            for s in sets:
                with open(s.bin_path, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        idx_tmp = _write_index(idx_path, dtype, sizes, doc_idx, modes)
        _install(bin_tmp, idx_tmp, bin_path, idx_path)
    except BaseException:
        Path(bin_tmp).unlink(missing_ok=True)
        if idx_tmp:
            Path(idx_tmp).unlink(missing_ok=True)
        raise
    return IndexedDataset(output_prefix)
