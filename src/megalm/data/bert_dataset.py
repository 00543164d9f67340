"""BERT samples with megatron-core's semantics (BERTMaskedWordPieceDataset).

A sample is a run of whole sentences of one document. With the binary head it is cut at a random
sentence into segments A and B (swapped with probability 0.5: the sentence-order target
`is_random`), the longer segment is trimmed one token at a time from a random end until both fit
the target length, and the result is laid out as `[CLS] A [SEP] B [SEP]` with token types 0 / 1.
Masking: 15% of the tokens, in whole-word n-gram spans (n <= 3, P(n) proportional to 1/n), each
masked token replaced by [MASK] 80% of the time, by a random vocabulary id 10% and kept 10%.
Every random draw of sample i comes from numpy.random.RandomState(seed + i), in megatron-core's
order, so a sample does not depend on the layout that reads it.

Batch fields: tokens, token_types, padding_mask (1 on real tokens), labels (the original ids at
masked positions, IGNORE elsewhere), loss_mask (1.0 at masked positions), is_random.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from megalm.errors import DataError

MASKING_PROBABILITY = 0.15
MAX_NGRAM = 3
_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}
_MOCK_DEFAULT_SAMPLES = 1 << 20


@dataclass(frozen=True)
class Specials:
    """The ids BERT samples need from the tokenizer."""
    cls: int
    sep: int
    mask: int
    pad: int


def bert_specials(tokenizer) -> Specials:
    """The tokenizer's [CLS] / [SEP] / [MASK] / [PAD] ids. A tokenizer without them (the null
    tokenizer of pre-tokenized or mock data) uses ids 1, 2, 3 and 0, as the mock data does."""
    ids = [getattr(tokenizer, name, None) for name in ("cls", "sep", "mask", "pad")]
    if all(i is not None for i in ids):
        return Specials(*ids)
    if type(tokenizer).__name__ == "NullTokenizer":
        return Specials(cls=1, sep=2, mask=3, pad=0)
    raise DataError(f"BERT samples need [CLS], [SEP], [MASK] and [PAD] tokens, which the {tokenizer.identity} "
                    "tokenizer does not have; use a WordPiece tokenizer.json or a sentencepiece model trained with them")


def masked_lm(tokens: List[int], target_length: int, rng: np.random.RandomState, specials: Specials,
              token_lookup: Sequence[int], continues_word: Optional[np.ndarray] = None):
    """megatron-core's _create_masked_lm_predictions (defaults: whole words, n-grams up to 3, no
    permutation): (masked tokens, sorted masked positions, their original ids).

    `continues_word[id]`: the id continues the previous token's word (WordPiece "##"); None: every
    token starts a word."""
    candidates: List[List[int]] = []
    for i, t in enumerate(tokens):
        if t == specials.cls or t == specials.sep:
            continue
        if continues_word is not None and continues_word[t] and candidates:
            candidates[-1].append(i)  # whole-word masking: a "##" piece joins its word
        else:
            candidates.append([i])
    n_maskings = min(MASKING_PROBABILITY * target_length, max(1, int(round(len(tokens) * MASKING_PROBABILITY))))
    ngram_sizes = np.arange(MAX_NGRAM, dtype=np.int64) + 1
    probs = 1.0 / ngram_sizes
    probs = probs / probs.sum(keepdims=True)
    # For each candidate word, its 1..MAX_NGRAM-word spans (fewer near the end), in shuffled order.
    spans = [[candidates[i:i + n] for n in ngram_sizes] for i in range(len(candidates))]
    rng.shuffle(spans)
    masked = list(tokens)
    chosen: List[tuple] = []
    taken: set = set()
    for grams in spans:
        if len(chosen) >= n_maskings:
            break
        if not grams:
            continue
        p = probs[:len(grams)] / probs[:len(grams)].sum(keepdims=True)
        n = rng.choice(ngram_sizes[:len(grams)], p=p)
        while True:  # the longest span of at most n words that still fits the budget
            positions = sum(grams[n - 1], [])
            n -= 1
            if n_maskings >= len(chosen) + len(positions):
                break
            if n == 0:
                positions = None
                break
        if positions is None or any(i in taken for i in positions):
            continue
        for i in positions:
            taken.add(i)
            if rng.random() < 0.8:
                masked[i] = specials.mask
            elif rng.random() >= 0.5:
                masked[i] = token_lookup[rng.randint(0, len(token_lookup))]
            # else: the token is kept (and still predicted)
            chosen.append((i, tokens[i]))
    # (megatron-core shuffles the spans once more here, for its permutation option; nothing draws
    # from the sample's generator after that, so it is left out.)
    chosen.sort(key=lambda pair: pair[0])
    return masked, [i for i, _ in chosen], [t for _, t in chosen]


def bert_sample(sentences: List[List[int]], target_length: int, seq_length: int, rng: np.random.RandomState,
                specials: Specials, token_lookup: Sequence[int], binary_head: bool,
                continues_word: Optional[np.ndarray] = None) -> Dict[str, np.ndarray]:
    """One sample from the sentences of a sample-index entry (megatron-core's __getitem__)."""
    from megalm.models.losses import IGNORE
    pivot, is_random = len(sentences), False
    if binary_head:
        if len(sentences) < 2:
            raise DataError(f"a BERT sample with the binary head needs two sentences, got {len(sentences)}")
        pivot = 1
        if len(sentences) >= 3:
            pivot = rng.randint(low=1, high=len(sentences))
        is_random = rng.random() < 0.5
    a = [t for s in sentences[:pivot] for t in s]
    b = [t for s in sentences[pivot:] for t in s]
    if is_random:
        a, b = b, a
    while len(a) + len(b) > target_length:  # trim the longer segment from a random end
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            del longer[-1]
    tokens = [specials.cls, *a, specials.sep]
    types = [0] * (len(a) + 2)
    if b:
        tokens += [*b, specials.sep]
        types += [1] * (len(b) + 1)
    tokens, positions, originals = masked_lm(tokens, target_length, rng, specials, token_lookup, continues_word)
    n = len(tokens)
    if n > seq_length:
        raise DataError(f"a BERT sample of {n} tokens does not fit model.seq_length={seq_length}")
    out = {"tokens": np.full(seq_length, specials.pad, dtype=np.int64),
           "token_types": np.zeros(seq_length, dtype=np.int64),
           "padding_mask": np.zeros(seq_length, dtype=np.int64),
           "labels": np.full(seq_length, IGNORE, dtype=np.int64),
           "loss_mask": np.zeros(seq_length, dtype=np.float32),
           "is_random": np.array(int(is_random), dtype=np.int64)}
    out["tokens"][:n] = tokens
    out["token_types"][:n] = types
    out["padding_mask"][:n] = 1
    out["labels"][positions] = originals
    out["loss_mask"][positions] = 1.0
    return out


class MockBertDataset:
    """Synthetic BERT samples with no files: sample i depends only on (seed, split, i).

    Each sample has 2-4 "sentences", each an arithmetic progression of ids (modulo the
    vocabulary, above the special ids) continuing the previous one, so a model can learn to fill
    in masked tokens; then the Megatron layout and masking of bert_sample. For quick runs and the
    layout tests; real corpora go through BertDataset.
    """

    def __init__(self, tokenizer, seq_length: int, seed: int, name: str = "train",
                 num_samples: Optional[int] = None, binary_head: bool = True):
        if name not in _SPLIT_IDS:
            raise DataError(f"mock split name {name!r} is not one of {', '.join(_SPLIT_IDS)}")
        self.vocab_size, self.seq_length, self.seed, self.name = tokenizer.vocab_size, seq_length, seed, name
        self.specials, self.binary_head = bert_specials(tokenizer), binary_head
        self.num_samples = num_samples or _MOCK_DEFAULT_SAMPLES
        low = max(self.specials.cls, self.specials.sep, self.specials.mask, self.specials.pad) + 1
        if seq_length < 8 or self.vocab_size < low + 2:
            raise DataError(f"mock BERT data needs seq_length >= 8 and more than {low + 1} ids "
                            f"(got {seq_length}, {self.vocab_size})")
        self.low = low
        self.token_lookup = np.arange(self.vocab_size)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock {self.name} sample {i} is out of range [0, {self.num_samples})")
        g = np.random.default_rng([self.seed, _SPLIT_IDS[self.name], int(i)])
        span = self.vocab_size - self.low
        start, stride = int(g.integers(0, span)), int(g.integers(1, min(7, span)))
        target = self.seq_length - 3
        lengths = g.integers(2, max(3, target // 2), size=int(g.integers(2, 5)))
        ids = self.low + (start + stride * np.arange(int(lengths.sum()))) % span
        sentences = [s.tolist() for s in np.split(ids, np.cumsum(lengths)[:-1])]
        rng = np.random.RandomState((self.seed + i) % 2**32)
        return bert_sample(sentences, target, self.seq_length, rng, self.specials, self.token_lookup, self.binary_head)


class BertSamples:
    """How the BERT family makes its samples (megalm.data.build_data's `samples`)."""

    def __init__(self, model_cfg):
        self.binary_head = model_cfg.binary_head

    def mock(self, tokenizer, seq_length: int, seed: int, name: str, num_samples: Optional[int]):
        return MockBertDataset(tokenizer, seq_length, seed, name, num_samples, binary_head=self.binary_head)

    def corpus(self, data_cfg, tokenizer, seq_length: int, seed: int, num_samples, cache_dir):
        raise DataError(f"data.source={data_cfg.source!r}: BERT trains on sentence-split corpora, which megalm's "
                        "data pipeline does not read yet; use data=mock")
