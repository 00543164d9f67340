"""From a DataConfig to the tokenizer and the train / valid / test datasets: build_data.

source (mock | the stdlib's code or its docstrings' sentences tokenized into .bin/.idx | your
.bin/.idx files | fine-tuning examples) -> split by weights ("949,50,1") -> the family's sample
indices per split and dataset (GPT's by default) -> Megatron's greedy blend when several datasets
are weighted -> DataBundle. Each split is built for the number of samples training will draw
(`num_samples`, see `num_samples_for`), as Megatron does.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from megalm.config import DataConfig
from megalm.data.preprocessing.cached_tokens import tokenize_corpus
from megalm.data.corpora.stdlib import StdlibCorpus, StdlibDocstrings, stdlib_corpus
from megalm.data.formats.cache import stable_hash
from megalm.data.formats.indexed import IndexedDataset
from megalm.data.provenance import check_corpus_tokenizer
from megalm.data.samples.blended import BlendedDataset, blend_size, per_dataset_samples
from megalm.data.samples.gpt import GPTDataset, GPTSamples, MockGPTDataset, eod_loss_mask, gpt_batch
from megalm.data.spec import blend_spec, split_weights
from megalm.data.tasks.classification import ClassificationDataset, read_examples as read_classification_examples
from megalm.data.tasks.sft import SFTDataset, pack_examples, read_examples, read_records
from megalm.data.tasks.squad import read_squad
from megalm.data.tokenizers.base import NullTokenizer, Tokenizer
from megalm.data.tokenizers.build import build_tokenizer
from megalm.errors import DataError

log = logging.getLogger("megalm.data")

Dataset = Union[GPTDataset, MockGPTDataset, BlendedDataset]
_SPLITS = ("train", "valid", "test")
SOURCES = ("stdlib", "stdlib_prose", "mock", "indexed", "sft", "classification", "qa")
STDLIB_SOURCES = ("stdlib", "stdlib_prose")



@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: Dataset
    valid: Dataset
    test: Optional[Dataset] = None
    """None when the split gives the test part no documents."""
    eod_mask_loss: bool = False
    """data.eod_mask_loss: loss_mask() zeroes positions whose input is end-of-document."""

    def loss_mask(self, micro_batch: torch.Tensor) -> Optional[torch.Tensor]:
        """(mbs, seq_length) float mask for a (mbs, seq_length + 1) micro-batch; None = no masking."""
        if not self.eod_mask_loss:
            return None
        return eod_loss_mask(micro_batch, self.tokenizer.eod)

    def batch(self, micro_batch) -> Dict[str, torch.Tensor]:
        """The batch dict a model trains on from a loader's micro-batch: GPT samples (mbs,
        seq_length + 1) become tokens / labels / loss_mask (gpt_batch); a dataset of dict samples
        gives its collated dict unchanged."""
        if isinstance(micro_batch, dict):
            return micro_batch
        return gpt_batch(micro_batch, self.tokenizer.eod if self.eod_mask_loss else None)


def num_samples_for(max_steps: int, global_batch_size: int, eval_interval: int, eval_steps: int
                    ) -> Dict[str, int]:
    """Megatron's sample counts: train = steps x batch; valid = evaluations x eval_steps x batch
    (evaluations = max_steps // eval_interval + 1, or 2 with eval_interval 0: start and end);
    test = eval_steps x batch."""
    evaluations = max_steps // eval_interval + 1 if eval_interval > 0 else 2
    return {"train": max_steps * global_batch_size,
            "valid": evaluations * eval_steps * global_batch_size,
            "test": eval_steps * global_batch_size}


def split_documents(num_documents: int, split: str) -> List[range]:
    """Contiguous (train, valid, test) document ranges in proportion to the split weights.

    megatron-core's rule: the weights are normalized, their running sums are the bookends
    (0, w0, w0 + w1, 1), and each bookend b becomes document round(b * num_documents). (Older
    Megatron-LM rounded each part's size and shifted the boundaries to end at N: 949,50,1 over
    1010 documents gave train [0, 959) where megatron-core gives [0, 958).)
    """
    weights = (split_weights(split) + [0.0] * 2)[:3]
    normalized = (np.asarray(weights, dtype=np.float64) / np.sum(np.asarray(weights, dtype=np.float64))).tolist()
    bookends = [0.0]
    for w in normalized:
        bookends.append(bookends[-1] + w)  # in this order, so the floats are megatron-core's
    bounds = [int(round(b * float(num_documents))) for b in bookends]
    return [range(bounds[k], bounds[k + 1]) for k in range(3)]


def _requested(num_samples: Optional[Mapping[str, Optional[int]]]) -> Dict[str, Optional[int]]:
    num_samples = dict(num_samples or {})
    unknown = set(num_samples) - set(_SPLITS)
    if unknown:
        raise DataError(f"num_samples has unknown split(s) {sorted(unknown)}; use {', '.join(_SPLITS)}")
    for name, n in num_samples.items():
        if n is not None and (not isinstance(n, (int, np.integer)) or n < 0):
            raise DataError(f"num_samples[{name!r}]={n!r} must be a non-negative integer or None")
    return {name: (None if num_samples.get(name) is None else int(num_samples[name])) for name in _SPLITS}


def _token_range(indexed: IndexedDataset, cache_dir: Path) -> Tuple[int, int]:
    """The (min, max) token id of a .bin, scanned once and cached by the files' identity."""
    root = cache_dir / "token_ranges"
    path = root / f"{stable_hash('token-range-v1', indexed.fingerprint(), length=24)}.json"
    try:
        lo, hi = json.loads(path.read_text())["range"]
        return int(lo), int(hi)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    start = time.perf_counter()
    lo, hi = indexed.token_range()
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{time.time_ns()}")
    tmp.write_text(json.dumps({"range": [lo, hi], "files": indexed.fingerprint()}))
    tmp.replace(path)
    log.info("vocab check: %s holds ids %d..%d (%d tokens scanned in %.1f s)", indexed.bin_path, lo, hi,
             indexed.num_tokens, time.perf_counter() - start)
    return lo, hi


def build_data_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer `cfg` asks for, before any corpus is tokenized (a stdlib model is trained once, cached)."""
    if cfg.source == "mock":
        # No text here: only the id range of the configured tokenizer matters.
        return NullTokenizer(cfg.tokenizer.vocab_size)
    if cfg.source in STDLIB_SOURCES:
        if cfg.tokenizer.type not in ("sentencepiece", "huggingface"):
            raise DataError(f"data.source={cfg.source} is text and needs tokenizer.type=sentencepiece or huggingface "
                            f"(got {cfg.tokenizer.type!r})")
        return build_tokenizer(cfg.tokenizer, _stdlib_text(cfg), Path(cfg.cache_dir).expanduser())
    if cfg.source in ("indexed", "sft", "classification", "qa"):
        return build_tokenizer(cfg.tokenizer)
    raise DataError(f"data.source={cfg.source!r} is not one of {', '.join(SOURCES)}")


def _stdlib_text(cfg: DataConfig) -> Union[StdlibCorpus, StdlibDocstrings]:
    code = stdlib_corpus(cfg.max_corpus_mb)
    return StdlibDocstrings(code) if cfg.source == "stdlib_prose" else code


def build_data(cfg: DataConfig, *, seq_length: int, seed: int,
               num_samples: Optional[Mapping[str, Optional[int]]] = None,
               tokenizer: Optional[Tokenizer] = None, samples: Optional[Any] = None) -> DataBundle:
    """The tokenizer and the train/valid(/test) datasets that `cfg` describes.

    num_samples: samples each split must provide ({"train": ..., "valid": ..., "test": ...}, see
    num_samples_for); a split left out (or None) gets one epoch of its documents. `tokenizer`: the
    one build_data_tokenizer(cfg) gave, when the caller already has it. `samples`: how the model
    family makes its samples (Family.samples: `split_by` "sequences" | "documents", `mock(...)`
    and `dataset(...)` as GPTSamples has them); None: GPT's packed token sequences.
    """
    requested = _requested(num_samples)
    cache_dir = Path(cfg.cache_dir).expanduser()
    if tokenizer is None:
        tokenizer = build_data_tokenizer(cfg)
    samples = samples if samples is not None else GPTSamples()
    if cfg.source == "mock":
        sets = [samples.mock(tokenizer, seq_length, seed, name, requested[name] or None) for name in _SPLITS]
        return DataBundle(tokenizer, sets[0], sets[1], sets[2], eod_mask_loss=cfg.eod_mask_loss)
    if cfg.source == "sft":
        return _sft_data(cfg, tokenizer, seq_length, seed, requested, samples)
    if cfg.source == "classification":
        return _classification_data(cfg, tokenizer, seq_length, seed, requested, samples)
    if cfg.source == "qa":
        return _qa_data(cfg, tokenizer, seq_length, seed, requested, samples)
    sources = corpus_sources(cfg, tokenizer, cache_dir)
    sets: List[Optional[Dataset]] = []
    for k, name in enumerate(_SPLITS):
        sets.append(_build_split(cfg, name, k, sources, samples, tokenizer, seq_length, seed, requested[name],
                                 cache_dir))
    log.info("splits: %s", ", ".join(f"{n} {len(s) if s is not None else 0} samples"
                                     for n, s in zip(_SPLITS, sets)))
    return DataBundle(tokenizer, sets[0], sets[1], sets[2], eod_mask_loss=cfg.eod_mask_loss)


def _sft_data(cfg: DataConfig, tokenizer: Tokenizer, seq_length: int, seed: int,
              requested: Mapping[str, Optional[int]], samples: Any = None) -> DataBundle:
    """Supervised fine-tuning: the examples of data.paths split in file order (data/tasks/sft.py); a family
    with samples of its own (`samples.sft(tokenizer, seq_length)`: T5's source / target pairs) makes
    each example's sample itself."""
    if samples is not None and hasattr(samples, "sft"):
        examples = read_records(cfg.paths, samples.sft(tokenizer, seq_length), cfg.pair_suffixes)
    else:
        examples = read_examples(cfg.paths, tokenizer, seq_length, cfg.chat_template, cfg.pair_suffixes)
    parts = split_documents(len(examples), cfg.split)

    def rows(part: range):
        chosen = [examples[j] for j in part]
        return pack_examples(chosen, seq_length, tokenizer.eod) if cfg.packing else chosen

    sets = [SFTDataset(rows(part), name, seed, requested[name]) if len(part) or name != "test"
            else None for name, part in zip(_SPLITS, parts)]
    log.info("sft: %d examples from %d file(s); %s", len(examples), len(cfg.paths),
             ", ".join(f"{n} {len(p)} examples" for n, p in zip(_SPLITS, parts)))
    return DataBundle(tokenizer, sets[0], sets[1], sets[2])


def _classification_data(cfg: DataConfig, tokenizer: Tokenizer, seq_length: int, seed: int,
                         requested: Mapping[str, Optional[int]], samples: Any) -> DataBundle:
    """data.paths for training, data.valid_paths for validation (empty: data.split of data.paths)."""
    if not hasattr(samples, "classification"):
        raise DataError("data.source=classification: this model family has no classification samples")
    make = samples.classification(tokenizer, seq_length)
    train = read_classification_examples(cfg.paths, cfg.task, cfg.labels, samples.num_labels, samples.num_choices)
    if cfg.valid_paths:
        valid = read_classification_examples(cfg.valid_paths, cfg.task, cfg.labels, samples.num_labels,
                                             samples.num_choices)
    else:
        parts = split_documents(len(train), cfg.split)
        train, valid = [train[j] for j in parts[0]], [train[j] for j in parts[1]]
    log.info("classification (%s): %d training and %d validation examples", cfg.task, len(train), len(valid))
    return DataBundle(tokenizer, ClassificationDataset(train, make, "train", seed, requested["train"]),
                      ClassificationDataset(valid, make, "valid", seed, requested["valid"]), None)


def _qa_data(cfg: DataConfig, tokenizer: Tokenizer, seq_length: int, seed: int,
             requested: Mapping[str, Optional[int]], samples: Any) -> DataBundle:
    """SQuAD files: data.paths for training, data.valid_paths for validation (empty: data.split of the
    questions); every window of every question is a sample."""
    if not hasattr(samples, "qa"):
        raise DataError("data.source=qa: this model family has no extractive-QA samples")
    make = samples.qa(tokenizer, seq_length, cfg.doc_stride, cfg.max_query_length)
    train = [q for p in cfg.paths for q in read_squad(p)]
    if cfg.valid_paths:
        valid = [q for p in cfg.valid_paths for q in read_squad(p)]
    else:
        parts = split_documents(len(train), cfg.split)
        train, valid = [train[j] for j in parts[0]], [train[j] for j in parts[1]]
    sets = []
    for name, questions in (("train", train), ("valid", valid)):
        windows = [w.sample for q in questions for w in make(q)]
        sets.append(ClassificationDataset(windows, lambda sample: sample, name, seed, requested[name]))
        log.info("qa: %d %s questions in %d windows", len(questions), name, len(windows))
    return DataBundle(tokenizer, sets[0], sets[1], None)


def corpus_sources(cfg: DataConfig, tokenizer: Tokenizer, cache_dir: Path) -> List[Tuple[float, IndexedDataset]]:
    """(weight, tokenized corpus) of each dataset `cfg` names: the stdlib tokenized (cached), or
    the user's .bin/.idx files checked against the tokenizer."""
    if cfg.source in STDLIB_SOURCES:
        text = _stdlib_text(cfg)
        log.info("corpus: %s of %d stdlib files", "docstrings" if cfg.source == "stdlib_prose" else "the sources",
                 len(text))
        return [(1.0, tokenize_corpus(text, tokenizer, cache_dir, split_sentences=cfg.source == "stdlib_prose"))]
    if cfg.source != "indexed":
        raise DataError(f"data.source={cfg.source!r} is not one of {', '.join(SOURCES)}")
    pairs = blend_spec(cfg)
    for w, prefix in pairs:
        if w == 0:
            log.info("blend: %s has weight 0 and is not used", prefix)
    sources = [(w, IndexedDataset(Path(prefix).expanduser())) for w, prefix in pairs if w > 0]
    for _, indexed in sources:
        check_corpus_tokenizer(indexed.prefix, tokenizer)
    if cfg.check_vocab:
        for _, indexed in sources:
            indexed.check_vocab(tokenizer.vocab_size, _token_range(indexed, cache_dir))
    return sources


def _build_split(cfg: DataConfig, name: str, k: int, sources: Sequence[Tuple[float, IndexedDataset]], samples: Any,
                 tokenizer: Tokenizer, seq_length: int, seed: int, num_samples: Optional[int],
                 cache_dir: Path) -> Optional[Dataset]:
    # megatron-core splits GPT data per sequence and BERT data per document
    ranges = [split_documents(len(ix) if samples.split_by == "sequences" else ix.num_documents, cfg.split)[k]
              for _, ix in sources]
    if name == "test" and all(len(r) == 0 for r in ranges):
        return None

    def make(indexed: IndexedDataset, documents: range, n: Optional[int]):
        return samples.dataset(indexed, documents, tokenizer=tokenizer, seq_length=seq_length, seed=seed, name=name,
                               num_samples=n, cache_dir=cache_dir)

    if len(sources) == 1:
        return make(sources[0][1], ranges[0], num_samples)
    weights = [w for w, _ in sources]
    if num_samples is None:  # one epoch of each, and as long a blend as they can all feed
        parts = [make(ix, r, None) for (_, ix), r in zip(sources, ranges)]
        total = sum(weights)
        size = min(int(math.floor((len(p) - 1) / (w / total))) for p, w in zip(parts, weights))
        size = max(size, 1)
    else:
        size = blend_size(weights, num_samples)
        parts = [make(ix, r, n) for (_, ix), r, n in zip(sources, ranges, per_dataset_samples(weights, num_samples))]
    description = [[p.indexed.fingerprint(), [p.documents.start, p.documents.stop], p.num_samples, len(p)]
                   for p in parts]
    return BlendedDataset(parts, weights, size, name, cache_dir,
                          description=[type(parts[0]).__name__, seq_length, seed] + description)
