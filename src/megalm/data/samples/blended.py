"""Weighted blending of several datasets with Megatron-LM's greedy index (blended_dataset.py).

Sample t of the blend comes from the dataset whose error weight_i * max(t, 1) - taken_i is the
largest (the first such on ties), where taken_i counts the samples dataset i gave before t;
it is that dataset's sample number taken_i. Megatron runs this loop in C++; here it runs
exactly, in double precision like Megatron's, but vectorized "in parallel in time": the range is
cut into chunks, every chunk is simulated at once from a guessed starting state (the counts a
proportional split would give), and any chunk whose guess differs from the state its
predecessor actually ended in is simulated again from that state, until all agree. The
dynamics forget their start within a few steps, so one or two passes usually settle it; the
result equals the sequential loop's whatever the number of passes.

With two datasets every prefix holds each dataset's share to within one sample of
weight * length. With three or more Megatron's rule can fall behind by a little more on
very skewed weights (up to about 1.6 samples for a 0.97 weight next to two tiny ones).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from megalm.data.formats.cache import load_or_build
from megalm.errors import DataError

log = logging.getLogger("megalm.data")

BLEND_VERSION = "blend-v1"
SIZE_MARGIN = 1.005
"""megatron-core's mid_level_dataset_surplus (0.005): each dataset of a blend for N samples is
built for ceil(ceil(weight * N) * 1.005) samples."""
_CHUNK = 2048  # time steps per chunk of the parallel-in-time build


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """float64 weights / their sum, as Megatron normalizes them."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
        raise DataError(f"blend weights {list(map(float, np.ravel(w)))} must be finite, >= 0, "
                        "and not all zero")
    return w / w.sum()


def target_samples(weights: Sequence[float], size: int) -> List[int]:
    """Samples the blend plans to take from each dataset for a request of `size`: ceil(w * size)."""
    return [int(math.ceil(size * w)) for w in normalize_weights(weights).tolist()]


def per_dataset_samples(weights: Sequence[float], size: int) -> List[int]:
    """Samples each dataset is built for, for a blend requested at `size`: megatron-core's
    ceil(ceil(w * size) * 1.005). (Older Megatron-LM: ceil(w * size * 1.005).)"""
    return [int(math.ceil(n * SIZE_MARGIN)) for n in target_samples(weights, size)]


def blend_size(weights: Sequence[float], size: int) -> int:
    """The samples a blend requested at `size` holds: megatron-core's sum of ceil(w * size), which
    can exceed `size` by up to one sample per dataset."""
    return sum(target_samples(weights, size))


def _simulate(w: np.ndarray, t0: np.ndarray, counts: np.ndarray, steps: int,
              choice: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """Run the greedy for `steps` from times t0 (one row per chunk) and counts; fill choice/sample."""
    counts = counts.copy()
    rows = np.arange(t0.size)
    t = t0.astype(np.float64)
    for j in range(steps):
        s = np.maximum(t + j, 1.0)
        err = w[None, :] * s[:, None] - counts  # the same double arithmetic as Megatron's loop
        pick = err.argmax(axis=1)  # the first maximum, like its strict ">" scan
        choice[:, j] = pick
        sample[:, j] = counts[rows, pick]
        counts[rows, pick] += 1
    return counts


def _proportional_counts(w: np.ndarray, t: np.ndarray) -> np.ndarray:
    """A guess of the greedy's counts at times t: floor(w t), plus one for the largest remainders."""
    q = w[None, :] * t[:, None].astype(np.float64)
    base = np.floor(q)
    counts = base.astype(np.int64)
    short = t - counts.sum(axis=1)
    order = np.argsort(-(q - base), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(w.size), order.shape), axis=1)
    counts += rank < short[:, None]
    return counts


def blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of Megatron's greedy blend of `size` samples."""
    w = normalize_weights(weights)
    k = w.size
    if k > np.iinfo(np.int16).max:
        raise DataError(f"{k} datasets is more than a blend can index (int16)")
    if size < 0:
        raise DataError(f"blend size {size} must not be negative")
    if size == 0:
        return np.zeros(0, np.int16), np.zeros(0, np.int64)
    chunk = min(_CHUNK, size)
    m = -(-size // chunk)
    starts = np.arange(m, dtype=np.int64) * chunk
    state = _proportional_counts(w, starts)
    state[0] = 0
    choice = np.empty((m, chunk), dtype=np.int64)
    sample = np.empty((m, chunk), dtype=np.int64)
    ends = np.empty_like(state)
    todo = np.arange(m)
    passes = 0
    while todo.size:
        passes += 1
        c, s = np.empty((todo.size, chunk), np.int64), np.empty((todo.size, chunk), np.int64)
        ends[todo] = _simulate(w, starts[todo], state[todo], chunk, c, s)
        choice[todo], sample[todo] = c, s
        # chunk i + 1 is right once chunk i is right and ends where chunk i + 1 started
        wrong = np.flatnonzero((ends[:-1] != state[1:]).any(axis=1)) + 1
        state[wrong] = ends[wrong - 1]
        todo = wrong
    log.debug("blend: %d samples over %d datasets in %d pass(es)", size, k, passes)
    return choice.reshape(-1)[:size].astype(np.int16), sample.reshape(-1)[:size]


def blending_indices_reference(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The plain sequential loop (Megatron's C++ build_blending_indices, in Python): for tests."""
    w = normalize_weights(weights).tolist()
    counts = [0] * len(w)
    dataset_index = np.empty(size, np.int16)
    sample_index = np.empty(size, np.int64)
    for t in range(size):
        s = max(float(t), 1.0)
        best, best_err = 0, w[0] * s - counts[0]
        for i in range(1, len(w)):
            err = w[i] * s - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[t], sample_index[t] = best, counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Sample i is datasets[dataset_index[i]][dataset_sample_index[i]], Megatron's greedy blend."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int, name: str = "train",
                 cache_dir: Optional[Union[str, Path]] = None, description: Optional[dict] = None):
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.name, self.size = list(datasets), name, int(size)
        self.weights = normalize_weights(weights)
        start = time.perf_counter()
        desc = {"version": BLEND_VERSION, "weights": self.weights.tolist(), "size": self.size,
                "datasets": description or [str(d) for d in range(len(datasets))]}
        arrays, self.built_anew = load_or_build(
            Path(cache_dir).expanduser() if cache_dir is not None else None, "blend_indices", desc,
            lambda: dict(zip(("dataset_index", "dataset_sample_index"), blending_indices(self.weights, self.size))))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets)) if self.size else \
            np.zeros(len(self.datasets), np.int64)
        for d, (ds, n) in enumerate(zip(self.datasets, counts)):
            if n > len(ds):
                raise DataError(f"{name} blend of {self.size} samples takes {n} from dataset {d} "
                                f"(weight {self.weights[d]:.4g}), which has only {len(ds)}")
        log.info("%s blend: %d samples from %s in %.2f s", name, self.size,
                 ", ".join(f"{n} ({w:.3f})" for n, w in zip(counts, self.weights)), time.perf_counter() - start)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"{self.name} blend sample {i} is out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
