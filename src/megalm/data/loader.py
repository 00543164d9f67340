"""From a DataConfig to datasets, and from datasets to this rank's micro-batches."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from megalm.config import DataConfig, split_weights
from megalm.data.corpora import StdlibCorpus, locked, stable_hash, stdlib_corpus
from megalm.data.gpt_dataset import GPTDataset, MockGPTDataset
from megalm.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from megalm.data.tokenizer import NullTokenizer, Tokenizer, build_tokenizer, load_tokenizer

log = logging.getLogger("megalm.data")

Dataset = Union[GPTDataset, MockGPTDataset]
_SPLITS = ("train", "valid", "test")
_CORPUS_FORMAT = "tokens-v1"  # bump when the tokenized layout changes, to invalidate caches
_ENCODE_BATCH_BYTES = 4_000_000  # text per encode_batch call: enough work for all threads


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: Dataset
    valid: Dataset
    test: Optional[Dataset] = None
    """None when the split gives the test part no weight."""


def split_documents(num_documents: int, split: str) -> List[range]:
    """Contiguous (train, valid, test) document ranges in proportion to the split weights."""
    weights = np.asarray(split_weights(split) + [0.0] * 2)[:3]
    cuts = np.rint(np.cumsum(weights) / weights.sum() * num_documents).astype(int)
    bounds = [0] + [int(c) for c in cuts[:-1]] + [num_documents]
    return [range(bounds[k], bounds[k + 1]) for k in range(3)]


def build_data(cfg: DataConfig, *, seq_length: int, seed: int) -> DataBundle:
    """The tokenizer and the train/valid(/test) datasets that `cfg` describes."""
    cache_dir = Path(cfg.cache_dir).expanduser()
    if cfg.source == "mock":
        # No text here: only the id range of the configured tokenizer matters.
        tokenizer: Tokenizer = NullTokenizer(cfg.tokenizer.vocab_size)
        sets = [MockGPTDataset(tokenizer.vocab_size, seq_length, seed, name) for name in _SPLITS]
        return DataBundle(tokenizer, sets[0], sets[1], sets[2])
    if cfg.source == "stdlib":
        if cfg.tokenizer.type != "sentencepiece":
            raise ValueError(f"data.source=stdlib is text and needs tokenizer.type=sentencepiece "
                             f"(got {cfg.tokenizer.type!r})")
        corpus = stdlib_corpus(cfg.max_corpus_mb)
        log.info("corpus: %d stdlib files, %.1f MB", len(corpus), corpus.num_bytes / 1e6)
        tokenizer = build_tokenizer(cfg.tokenizer, corpus, cache_dir)
        indexed = tokenize_corpus(corpus, tokenizer, cache_dir)
    elif cfg.source == "indexed":
        paths = list(cfg.paths)
        if len(paths) != 1:
            raise ValueError(f"data.source=indexed takes one prefix in data.paths for now (got "
                             f"{len(paths)}); blending several datasets comes later")
        tokenizer = build_tokenizer(cfg.tokenizer)
        indexed = IndexedDataset(Path(paths[0]).expanduser())
    else:
        raise ValueError(f"data.source={cfg.source!r} is not one of stdlib, mock, indexed")

    ranges = split_documents(indexed.num_documents, cfg.split)
    sets: List[Optional[GPTDataset]] = []
    for name, docs in zip(_SPLITS, ranges):
        empty_test = name == "test" and len(docs) == 0
        sets.append(None if empty_test else GPTDataset(indexed, docs, seq_length, seed, name))
    log.info("splits: %s", ", ".join(f"{n} {len(r)} docs / {len(s) if s else 0} samples"
                                     for n, r, s in zip(_SPLITS, ranges, sets)))
    return DataBundle(tokenizer, sets[0], sets[1], sets[2])


def tokenize_corpus(corpus: StdlibCorpus, tokenizer: Tokenizer, cache_dir: Path) -> IndexedDataset:
    """Tokenize every document (+ eod) into cache_dir/corpora/<hash>/tokens.bin/.idx, once."""
    key = stable_hash(_CORPUS_FORMAT, corpus.fingerprint(), tokenizer.identity)
    root = cache_dir / "corpora"
    entry = root / key
    prefix = entry / "tokens"
    with locked(root / f"{key}.lock"):
        if (entry / "tokens.idx").is_file():
            log.info("tokens: reusing %s.bin/.idx", prefix)
            return IndexedDataset(prefix)
        start = time.perf_counter()
        log.info("tokens: tokenizing %d documents (%.1f MB)", len(corpus), corpus.num_bytes / 1e6)
        # Saved next to the tokens so the folder is self-contained for source=indexed.
        tokenizer.save_to(entry)
        num_tokens = 0
        with IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size)) as writer:
            batch: List[str] = []
            size = 0
            for text in corpus.texts():
                batch.append(text)
                size += len(text)
                if size >= _ENCODE_BATCH_BYTES:
                    num_tokens += _write_batch(writer, tokenizer, batch)
                    batch, size = [], 0
            num_tokens += _write_batch(writer, tokenizer, batch)
        seconds = time.perf_counter() - start
        (entry / "stats.json").write_text(json.dumps(
            {"documents": len(corpus), "bytes": corpus.num_bytes, "tokens": num_tokens,
             "seconds": round(seconds, 2), "tokenizer": tokenizer.identity}, indent=1))
        log.info("tokens: %d tokens (%.2f bytes/token) in %.1f s", num_tokens,
                 corpus.num_bytes / max(num_tokens, 1), seconds)
    return IndexedDataset(prefix)


def _write_batch(writer: IndexedDatasetWriter, tokenizer: Tokenizer, texts: List[str]) -> int:
    count = 0
    for ids in tokenizer.encode_batch(texts):
        ids.append(tokenizer.eod)
        writer.add_document(ids)
        count += len(ids)
    return count


class MicroBatchLoader:
    """This data-parallel rank's micro-batches, with Megatron's pretraining-sampler order.

    The global batch starting at consumed sample c holds samples [c, c + G). Micro-batch j of
    it gives rank r the samples c + j*mbs*dp + r*mbs + [0, mbs). Every rank walks the same
    global order, so resuming from `consumed_samples` continues exactly where training was.
    """

    def __init__(self, dataset: Sequence, *, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0):
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} and dp_size={dp_size} must be at least 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        per_step = micro_batch_size * dp_size
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ValueError(f"global_batch_size={global_batch_size} is not a positive multiple of "
                             f"micro_batch_size({micro_batch_size}) * dp_size({dp_size}) = {per_step}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must not be negative")
        self.dataset = dataset
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.num_micro_batches = global_batch_size // per_step

    def indices(self) -> List[List[int]]:
        """Sample indices of this rank's micro-batches in the next global batch."""
        mbs, c = self.micro_batch_size, self.consumed_samples
        base = c + self.dp_rank * mbs
        return [list(range(base + j * mbs * self.dp_size, base + j * mbs * self.dp_size + mbs))
                for j in range(self.num_micro_batches)]

    def next_batch(self) -> List[torch.Tensor]:
        """This rank's micro-batches of the next global batch, each (mbs, seq_length + 1)."""
        batches = [torch.from_numpy(np.stack([self.dataset[i] for i in idx]).astype(np.int64))
                   for idx in self.indices()]
        self.consumed_samples += self.global_batch_size
        return batches

    def __iter__(self):
        while True:
            yield self.next_batch()


__all__ = ["DataBundle", "MicroBatchLoader", "build_data", "load_tokenizer", "split_documents",
           "tokenize_corpus"]
