"""Fixed-length training samples packed from documents, as GPT pretraining uses them.

Each epoch concatenates the documents of a split (each already ending in eod) in a freshly
shuffled order and cuts the stream into samples of seq_length + 1 tokens. Sample k starts at
token k * seq_length, so its last token is the first of sample k + 1: the +1 is the label of
the last input position, and no token is ever skipped as an input. Samples cross document
boundaries; the tail of an epoch that does not fill a sample is dropped.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from megalm.data.indexed import IndexedDataset

_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


class GPTDataset:
    """Packed samples over documents [documents.start, documents.stop) of an IndexedDataset.

    Any index i >= 0 is valid: sample i is sample i % len(self) of epoch i // len(self).
    """

    def __init__(self, indexed: IndexedDataset, documents: range, seq_length: int, seed: int,
                 name: str = "train"):
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be at least 1")
        if not 0 <= documents.start <= documents.stop <= indexed.num_documents or documents.step != 1:
            raise ValueError(f"{name} split: documents {documents} are not a contiguous range "
                             f"within the {indexed.num_documents} documents of {indexed.prefix}")
        self.indexed, self.name, self.seq_length, self.seed = indexed, name, seq_length, seed
        self.documents = documents
        bounds = indexed.offsets[indexed.doc_idx[documents.start:documents.stop + 1]]
        self._doc_start = bounds[:-1]  # token offset of each document in indexed.tokens
        self._doc_len = np.diff(bounds)
        self.num_tokens = int(self._doc_len.sum())
        need = seq_length + 1
        if self.num_tokens < need:
            raise ValueError(
                f"{name} split has {self.num_tokens} tokens in {len(documents)} documents "
                f"(documents {documents.start}..{documents.stop} of {indexed.prefix}), but one "
                f"sample needs seq_length + 1 = {need}; use more data or a different split")
        self._num_samples = (self.num_tokens - 1) // seq_length
        self._epochs: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return self._num_samples

    def _epoch_index(self, epoch: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, first document of each sample in that order, offset in it)."""
        if epoch not in self._epochs:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self._doc_len))
            ends = np.cumsum(self._doc_len[order])  # stream position where each document ends
            starts = np.arange(self._num_samples, dtype=np.int64) * self.seq_length
            # The first document whose end lies beyond the sample start holds that start
            # (empty documents end where they begin, so they are never chosen).
            first = np.searchsorted(ends, starts, side="right")
            offset = starts - (ends[first] - self._doc_len[order][first])
            if len(self._epochs) >= 2:  # readers move forward; keep this epoch and the last
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, first, offset)
        return self._epochs[epoch]

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise IndexError(f"{self.name} sample index {i} must not be negative")
        epoch, k = divmod(int(i), self._num_samples)
        order, first, offset = self._epoch_index(epoch)
        need, pos, off = self.seq_length + 1, int(first[k]), int(offset[k])
        pieces = []
        while need:  # one step per document touched, a handful per sample
            doc = order[pos]
            take = min(need, int(self._doc_len[doc]) - off)
            start = int(self._doc_start[doc]) + off
            pieces.append(self.indexed.tokens[start:start + take])
            need -= take
            pos, off = pos + 1, 0
        return np.concatenate(pieces).astype(np.int64)


class MockGPTDataset:
    """Synthetic samples with no files: sample i depends only on (seed, split, i).

    Each sample is an arithmetic progression of ids modulo vocab_size with a random start and
    stride, so the tokens look random across samples yet a model can learn to continue them,
    which makes the loss of a smoke test fall.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, name: str = "train",
                 num_samples: int = 4096):
        if vocab_size < 2 or seq_length < 1 or num_samples < 1:
            raise ValueError(f"mock dataset needs vocab_size >= 2, seq_length >= 1, num_samples >= 1 "
                             f"(got {vocab_size}, {seq_length}, {num_samples})")
        if name not in _SPLIT_IDS:
            raise ValueError(f"mock split name {name!r} is not one of {', '.join(_SPLIT_IDS)}")
        self.vocab_size, self.seq_length, self.seed, self.name = vocab_size, seq_length, seed, name
        self._num_samples = num_samples

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            raise IndexError(f"{self.name} sample index {i} must not be negative")
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.name], int(i)])
        start, stride = rng.integers(0, self.vocab_size), rng.integers(1, min(17, self.vocab_size))
        return (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
