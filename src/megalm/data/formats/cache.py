"""A cache of numpy arrays keyed by what defines them: built once, written atomically.

An entry is a folder `<root>/<kind>/<key>/` of `.npy` files plus `description.json`. It is
built in a hidden temporary folder and renamed into place whole, under a file lock: the first
process (rank 0 of a node, in practice the first to arrive) builds, the others wait on the lock
and then load. A process killed while building leaves only its hidden temporary folder, which
is never read and is cleaned up by the next builder; an entry whose files do not match its
description (or that fails to load) is rebuilt.

`stable_hash` and `locked` are what every cache of the data pipeline keys and guards its entries
with (the tokenizer's, the tokenized corpora's, the token ranges').
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import numpy as np

log = logging.getLogger("megalm.data")

Arrays = Dict[str, np.ndarray]


def stable_hash(*parts: str, length: int = 16) -> str:
    """Hex digest of the parts; unlike hash(), the same on every run and machine."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\x00")  # so ("ab", "c") and ("a", "bc") differ
    return h.hexdigest()[:length]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed).

    Several ranks of one job may build the same cache entry at once; the lock makes the
    first one build it while the others wait and then find it ready.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def cache_key(description: dict) -> str:
    return stable_hash(json.dumps(description, sort_keys=True, default=str), length=24)


def _load(entry: Path, description: dict) -> Optional[Arrays]:
    """The arrays of a complete entry that matches `description`; None if absent or not usable."""
    meta_path = entry / "description.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("description") != json.loads(json.dumps(description, default=str)):
            return None
        arrays = {}
        for name, (shape, dtype) in meta["arrays"].items():
            arr = np.load(entry / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            if list(arr.shape) != list(shape) or str(arr.dtype) != dtype:
                return None
            arrays[name] = arr
        return arrays
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None


def load_or_build(cache_dir: Optional[Path], kind: str, description: dict,
                  build: Callable[[], Arrays]) -> Tuple[Arrays, bool]:
    """(arrays, built_now): load the cached entry for `description`, or build and store it once.

    With cache_dir None the arrays are built in memory and nothing is written.
    """
    if cache_dir is None:
        return build(), True
    root = Path(cache_dir).expanduser() / kind
    key = cache_key(description)
    entry = root / key
    arrays = _load(entry, description)  # the common case: ready, no lock needed
    if arrays is not None:
        return arrays, False
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f"{key}.lock"):
        arrays = _load(entry, description)  # another rank built it while we waited
        if arrays is not None:
            return arrays, False
        for leftover in root.glob(f".{key}.*"):  # a builder that died; we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        built = build()
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}."))
        try:
            for name, arr in built.items():
                with open(tmp / f"{name}.npy", "wb") as f:
                    np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
            meta = {"description": description,
                    "arrays": {name: [list(arr.shape), str(arr.dtype)] for name, arr in built.items()}}
            (tmp / "description.json").write_text(json.dumps(meta, indent=1, default=str))
            if entry.exists():
                shutil.rmtree(entry)  # stale or mismatched: replaced whole
            os.replace(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("cache: wrote %s", entry)
    arrays = _load(entry, description)
    if arrays is None:
        raise RuntimeError(f"{entry}: the cache entry just written does not load back")
    return arrays, True
