"""GPT pretraining samples with Megatron-LM's semantics (megatron/core/datasets/gpt_dataset.py).

Three indices define a split's samples, built vectorized with numpy and cached:

- document index: the split's documents repeated once per epoch, shuffled. The number of
  epochs is the least that yields the samples requested (one epoch when none are). All
  epochs are shuffled together, except that a short last epoch (less than 80% of an epoch's
  samples are drawn from it) is shuffled on its own, so it is not spread over the earlier ones.
- sample index: (position in the document index, token offset) where each sample starts. The
  documents are concatenated in document-index order and cut into samples of seq_length + 1
  tokens, each starting on the last token of the one before (the +1 is the label of the last
  input). Entry k + 1 is where sample k ends (inclusive), so samples cross document and epoch
  boundaries, and the tail that does not fill a sample is dropped.
- shuffle index: a permutation of the samples (the last epoch's permuted separately when it
  was separated).

One numpy RandomState(seed) draws the shuffles in Megatron's order, so for the same documents,
seed and sizes the indices equal Megatron's. A "document" here is a sequence of the indexed
dataset, as in megatron-core, which splits and samples GPT data per sequence: in a file of one
sequence per document the two agree, and a sentence-split file (preprocess --split-sentences)
is sampled per sentence, as megatron-core samples it.

Not done here: resetting position ids or attention masks at document boundaries
(Megatron's --reset-position-ids / --reset-attention-mask); samples attend across documents.

GPTSamples is how build_data makes GPT's samples (its default): these packed sequences, or a
decoder's classification samples (decoder_pair_sample).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Union

import numpy as np

from megalm.data.formats.cache import load_or_build
from megalm.data.formats.indexed import IndexedDataset
from megalm.data.tasks.classification import stack_choices
from megalm.data.tokenizers.base import Tokenizer
from megalm.errors import DataError
from megalm.ops.labels import IGNORE

if TYPE_CHECKING:
    import torch  # annotations only: this module stays importable without torch

log = logging.getLogger("megalm.data")

_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
"""Megatron's: the last epoch is shuffled apart when under this fraction of an epoch is used."""
INDEX_VERSION = "gpt-indices-v2"  # bump when the construction changes, to invalidate caches
_CHUNK = 1 << 22  # document-index positions per step of the sample-index build
_MOCK_DEFAULT_SAMPLES = 1 << 40  # a mock split without a requested size: as large as anyone asks


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Least number of epochs whose tokens give num_samples samples of seq_length + 1 (>= 1)."""
    if num_samples is None or tokens_per_epoch <= 0:
        return 1
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def separate_final_epoch_for(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int],
                             num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch apart when fewer than 80% of its samples are used."""
    if num_epochs == 1 or num_samples is None:
        return False
    sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """int32: the documents once per epoch, shuffled (the last epoch apart when separated)."""
    documents = np.asarray(documents, dtype=np.int32)
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    index = np.tile(documents, num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       total_tokens: Optional[int] = None) -> np.ndarray:
    """(S + 1, 2): sample k spans from entry k to entry k + 1 (inclusive) of (doc position, offset).

    Token p of the concatenation (in document-index order) lies in the first document whose
    running end exceeds p; the search runs chunk by chunk so memory stays O(samples).
    """
    n_docs = document_index.size
    total = total_tokens
    if total is None:
        total = sum(int(sizes[document_index[a:a + _CHUNK]].sum(dtype=np.int64))
                    for a in range(0, n_docs, _CHUNK))
    num_samples = max(0, (total - 1) // seq_length)
    dtype = np.int32 if n_docs < np.iinfo(np.int32).max else np.int64
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    done = 0  # samples starts placed so far
    carry = 0  # tokens before this chunk
    for a in range(0, n_docs, _CHUNK):
        if done > num_samples:
            break
        lens = sizes[document_index[a:a + _CHUNK]].astype(np.int64)
        ends = np.cumsum(lens)
        ends += carry
        last_end = int(ends[-1]) if ends.size else carry
        # starts p = k * seq_length with carry <= p < last_end belong to this chunk
        k_stop = min(num_samples + 1, -(-last_end // seq_length))
        if k_stop > done:
            p = np.arange(done, k_stop, dtype=np.int64) * seq_length
            j = np.searchsorted(ends, p, side="right")
            out[done:k_stop, 0] = j + a
            out[done:k_stop, 1] = p - (ends[j] - lens[j])
            done = k_stop
        carry = last_end
    out[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return out


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """[0, num_samples) shuffled, then [num_samples, total) shuffled on its own."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(sizes: np.ndarray, documents: Union[range, np.ndarray], seq_length: int, seed: int,
                      num_samples: Optional[int] = None) -> Dict[str, np.ndarray]:
    """document_index, sample_index and shuffle_index for the documents `documents` of a dataset
    whose document d has sizes[d] tokens. Needs no token file: only the lengths."""
    if seq_length < 1:
        raise DataError(f"seq_length={seq_length} must be at least 1")
    if not 0 <= seed < 2**32:
        raise DataError(f"seed={seed} must be in [0, 2**32) (numpy RandomState)")
    if num_samples is not None and num_samples < 0:
        raise DataError(f"num_samples={num_samples} must not be negative")
    documents = np.arange(documents.start, documents.stop, dtype=np.int32) if isinstance(documents, range) \
        else np.asarray(documents, dtype=np.int32)
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    if tokens_per_epoch < seq_length + 1:
        raise DataError(f"{tokens_per_epoch} tokens in {documents.size} documents are fewer than one sample "
                        f"of seq_length + 1 = {seq_length + 1}")
    epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    separate = separate_final_epoch_for(tokens_per_epoch, seq_length, num_samples, epochs)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(np.asarray(sizes), document_index, seq_length, epochs * tokens_per_epoch)
    total = sample_index.shape[0] - 1
    first = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(first, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index,
            "info": np.array([epochs, int(separate), tokens_per_epoch, first], dtype=np.int64)}


def eod_loss_mask(tokens, eod: int):
    """Megatron's --eod-mask-loss for samples of seq_length + 1: 0 where the input token is eod.

    `tokens` is (..., seq_length + 1) (numpy or torch); the mask is (..., seq_length) float,
    aligned with the labels tokens[..., 1:].
    """
    inputs = tokens[..., :-1]
    mask = inputs != eod
    return mask.float() if hasattr(mask, "float") else mask.astype(np.float32)


def gpt_batch(samples: torch.Tensor, eod: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The batch a GPT model trains on, from (mbs, seq_length + 1) samples: inputs `tokens` and
    next-token `labels` (mbs, seq_length), and `loss_mask` (float; with `eod`, Megatron's
    --eod-mask-loss zeroes the positions whose input is eod, and their labels are IGNORE)."""
    # lazy: torch and megalm.models (every model family) only where a batch is made; the rest does without
    import torch
    tokens, labels = samples[:, :-1], samples[:, 1:]
    if eod is None:
        return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(labels.shape)}
    mask = eod_loss_mask(samples, eod)
    return {"tokens": tokens, "labels": labels.masked_fill(mask == 0, IGNORE), "loss_mask": mask}


class GPTDataset:
    """Megatron's GPT samples over sequences [documents.start, documents.stop) of an IndexedDataset
    (its documents, unless the file is sentence-split: see the module docstring).

    len(self) is the number of samples the indices hold (whole epochs: at least num_samples);
    item i is the i-th sample in shuffled order, seq_length + 1 int64 tokens.
    """

    def __init__(self, indexed: IndexedDataset, documents: range, seq_length: int, seed: int,
                 name: str = "train", num_samples: Optional[int] = None,
                 cache_dir: Optional[Union[str, Path]] = None):
        if seq_length < 1:
            raise DataError(f"seq_length={seq_length} must be at least 1")
        if not 0 <= documents.start <= documents.stop <= len(indexed) or documents.step != 1:
            raise DataError(f"{name} split: documents {documents} are not a contiguous range "
                            f"within the {len(indexed)} sequences of {indexed.prefix}")
        self.indexed, self.name, self.seq_length, self.seed = indexed, name, seq_length, seed
        self.documents, self.num_samples = documents, num_samples
        offsets = self._offsets = indexed.offsets  # per sequence, as megatron-core samples GPT data
        sizes = np.diff(offsets)
        self.num_tokens = int(sizes[documents.start:documents.stop].sum())
        need = seq_length + 1
        if self.num_tokens < need:
            raise DataError(
                f"{name} split has {self.num_tokens} tokens in {len(documents)} documents "
                f"(documents {documents.start}..{documents.stop} of {indexed.prefix}), but one "
                f"sample needs seq_length + 1 = {need}; use more data or a different split")
        description = {"version": INDEX_VERSION, "class": "GPTDataset", "dataset": indexed.fingerprint(),
                       "split": name, "documents": [documents.start, documents.stop],
                       "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
                       "threshold": SEPARATE_FINAL_EPOCH_THRESHOLD}
        start = time.perf_counter()
        arrays, self.built_anew = load_or_build(
            Path(cache_dir).expanduser() if cache_dir is not None else None, "gpt_indices", description,
            lambda: build_gpt_indices(sizes, documents, seq_length, seed, num_samples))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        epochs, separate, _, _ = (int(v) for v in arrays["info"])
        self.num_epochs, self.separate_final_epoch = epochs, bool(separate)
        log.info("%s indices: %d samples, %d epoch(s) of %d documents / %d tokens%s, %s in %.2f s",
                 name, len(self), epochs, len(documents), self.num_tokens,
                 ", last epoch shuffled apart" if separate else "",
                 "built" if self.built_anew else "loaded", time.perf_counter() - start)

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(
                f"{self.name} sample {i} is out of range: {self.indexed.prefix} documents "
                f"{self.documents.start}..{self.documents.stop} give {n} samples ({self.num_epochs} "
                f"epoch(s), built for num_samples={self.num_samples})")
        j = int(self.shuffle_index[i])
        d0, o0 = (int(v) for v in self.sample_index[j])
        d1, o1 = (int(v) for v in self.sample_index[j + 1])
        tokens, di, offsets = self.indexed.tokens, self.document_index, self._offsets
        if d0 == d1:
            s = int(offsets[di[d0]]) + o0
            return tokens[s:s + o1 - o0 + 1].astype(np.int64)
        pieces = []
        for pos in range(d0, d1 + 1):  # one step per document touched, a handful per sample
            doc = int(di[pos])
            s = int(offsets[doc])
            a = o0 if pos == d0 else 0
            b = o1 + 1 if pos == d1 else int(offsets[doc + 1]) - s
            pieces.append(tokens[s + a:s + b])
        return np.concatenate(pieces).astype(np.int64)


class MockGPTDataset:
    """Synthetic samples with no files: sample i depends only on (seed, split, i).

    Each sample is an arithmetic progression of ids modulo vocab_size with a random start and
    stride, so the tokens look random across samples yet a model can learn to continue them,
    which makes the loss of a smoke test fall. Without num_samples it is as long as anyone asks.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, name: str = "train",
                 num_samples: Optional[int] = None):
        if num_samples is None:
            num_samples = _MOCK_DEFAULT_SAMPLES
        if vocab_size < 2 or seq_length < 1 or num_samples < 1:
            raise DataError(f"mock dataset needs vocab_size >= 2, seq_length >= 1, num_samples >= 1 "
                            f"(got {vocab_size}, {seq_length}, {num_samples})")
        if name not in _SPLIT_IDS:
            raise DataError(f"mock split name {name!r} is not one of {', '.join(_SPLIT_IDS)}")
        self.vocab_size, self.seq_length, self.seed, self.name = vocab_size, seq_length, seed, name
        self._num_samples = num_samples

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._num_samples:
            raise IndexError(f"mock {self.name} sample {i} is out of range [0, {self._num_samples})")
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.name], int(i)])
        start, stride = rng.integers(0, self.vocab_size), rng.integers(1, min(17, self.vocab_size))
        return (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size


def decoder_pair_sample(a, b, label, seq_length: int, eod: int) -> Dict[str, np.ndarray]:
    """A decoder's classification sample: a <eod> (b <eod>), the longer text trimmed from its end
    first until it fits, padded with <eod>; `last` is the final <eod>'s position, whose hidden state
    has read the whole input (the causal mask), where the classifier reads; `label` an int or a float."""
    a, b = list(a), (list(b) if b is not None else None)
    room = seq_length - (2 if b is not None else 1)
    while len(a) + len(b or []) > room:
        longer = a if b is None or len(a) > len(b) else b
        longer.pop()
    tokens = [*a, eod] + ([*b, eod] if b is not None else [])
    out = np.full(seq_length, eod, dtype=np.int64)
    out[:len(tokens)] = tokens
    return {"tokens": out, "last": np.array(len(tokens) - 1, dtype=np.int64),
            "label": np.array(label, dtype=np.float32 if isinstance(label, float) else np.int64)}


class GPTSamples:
    """GPT's packed token sequences (Megatron's GPTDataset): the default `samples` of build_data.
    Splits and samples go per sequence, as megatron-core's GPT data does (documents, unless the
    file is sentence-split)."""

    split_by = "sequences"

    def __init__(self, model_cfg=None):
        self.num_labels = getattr(model_cfg, "num_labels", 0)
        self.num_choices = getattr(model_cfg, "num_choices", 0)

    def classification(self, tokenizer: Tokenizer, seq_length: int):
        """example -> sample (megalm.data.tasks.classification.Example to decoder_pair_sample's dict; multiple
        choice: context <eod> choice <eod> for each choice, stacked)."""

        def make(example):
            text = tokenizer.encode(example.text)
            if example.choices is not None:
                return stack_choices([decoder_pair_sample(text, tokenizer.encode(c), example.label, seq_length,
                                                          tokenizer.eod) for c in example.choices])
            pair = tokenizer.encode(example.pair) if example.pair is not None else None
            return decoder_pair_sample(text, pair, example.label, seq_length, tokenizer.eod)
        return make

    def mock(self, tokenizer: Tokenizer, seq_length: int, seed: int, name: str, num_samples: Optional[int]):
        return MockGPTDataset(tokenizer.vocab_size, seq_length, seed, name, num_samples)

    def dataset(self, indexed: IndexedDataset, documents: range, *, tokenizer: Tokenizer, seq_length: int,
                seed: int, name: str, num_samples: Optional[int], cache_dir: Path) -> GPTDataset:
        return GPTDataset(indexed, documents, seq_length, seed, name, num_samples, cache_dir)
