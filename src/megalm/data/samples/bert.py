"""BERT samples with megatron-core's semantics (BERTMaskedWordPieceDataset), from sentence-split
corpora (BertDataset) or synthetic (MockBertDataset).

A sample is a run of whole sentences of one document. With the binary head it is cut at a random
sentence into segments A and B (swapped with probability 0.5: the sentence-order target
`is_random`), the longer segment is trimmed one token at a time from a random end until both fit
the target length, and the result is laid out as `[CLS] A [SEP] B [SEP]` with token types 0 / 1.
Masking: 15% of the tokens, in whole-word n-gram spans (n <= 3, P(n) proportional to 1/n), each
masked token replaced by [MASK] 80% of the time, by a random vocabulary id 10% and kept 10%
(the spans are chosen by megalm.data.samples.masking, which T5's samples share).
Every random draw of sample i comes from numpy.random.RandomState(seed + i), in megatron-core's
order, so a sample does not depend on the layout that reads it.

Batch fields: tokens, token_types, padding_mask (1 on real tokens), labels (the original ids at
masked positions, IGNORE elsewhere), loss_mask (1.0 at masked positions), is_random.

BertSamples is how the BERT family makes its samples for build_data: these, and the fine-tuning
samples of classification (pair_sample) and SQuAD (megalm.data.tasks.squad.windows).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from megalm.data.formats.cache import load_or_build
from megalm.data.samples.masking import SHORT_SEQ_PROB, SPLIT_IDS, choose_spans, continuing_pieces, mock_sentences
from megalm.data.tokenizers.specials import Specials, bert_specials
from megalm.data.samples.sentence_index import build_sentence_mapping
from megalm.data.tasks.classification import stack_choices
from megalm.data.tasks.squad import windows
from megalm.errors import DataError
from megalm.ops.labels import IGNORE

_MOCK_DEFAULT_SAMPLES = 1 << 20


def masked_lm(tokens: List[int], target_length: int, rng: np.random.RandomState, specials: Specials,
              token_lookup: Sequence[int], continues_word: Optional[np.ndarray] = None):
    """BERT's masking (megatron-core's defaults: whole words, n-grams up to 3, no permutation), each
    masked token replaced by [MASK] 80% of the time, a random id 10%, kept 10%: (masked tokens,
    sorted masked positions, their original ids)."""
    def bert_mask(rng: np.random.RandomState) -> Optional[int]:
        if rng.random() < 0.8:
            return specials.mask
        if rng.random() >= 0.5:
            return token_lookup[rng.randint(0, len(token_lookup))]
        return None  # kept (and still predicted)
    masked, spans = choose_spans(tokens, target_length, rng, specials, bert_mask, continues_word)
    positions = sorted(i for span in spans for i in span)
    return masked, positions, [tokens[i] for i in positions]


def bert_sample(sentences: List[List[int]], target_length: int, seq_length: int, rng: np.random.RandomState,
                specials: Specials, token_lookup: Sequence[int], binary_head: bool,
                continues_word: Optional[np.ndarray] = None) -> Dict[str, np.ndarray]:
    """One sample from the sentences of a sample-index entry (megatron-core's __getitem__)."""
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
        if name not in SPLIT_IDS:
            raise DataError(f"mock split name {name!r} is not one of {', '.join(SPLIT_IDS)}")
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
        target = self.seq_length - 3
        sentences = mock_sentences(self.seed, self.name, i, self.low, self.vocab_size, target)
        rng = np.random.RandomState((self.seed + i) % 2**32)
        return bert_sample(sentences, target, self.seq_length, rng, self.specials, self.token_lookup, self.binary_head)


class BertDataset:
    """megatron-core's BERTMaskedWordPieceDataset over documents [documents.start, documents.stop)
    of a sentence-split IndexedDataset (preprocess --split-sentences, or data=stdlib_prose).

    The sample index is megatron-core's build_mapping (megalm.data.samples.sentence_index): runs of whole
    sentences of one document up to seq_length - 3 tokens (shorter with probability
    short_seq_prob), at least two sentences with the binary head, shuffled; whole epochs until
    num_samples (None: one epoch). Item i is bert_sample of row i with RandomState(seed + i).
    """

    def __init__(self, indexed, documents: range, seq_length: int, seed: int, name: str = "train",
                 num_samples: Optional[int] = None, *, tokenizer, binary_head: bool = True,
                 short_seq_prob: float = SHORT_SEQ_PROB, cache_dir=None):
        if not 0 <= documents.start <= documents.stop <= indexed.num_documents or documents.step != 1:
            raise DataError(f"{name} split: documents {documents} are not a contiguous range within the "
                            f"{indexed.num_documents} documents of {indexed.prefix}")
        if seq_length < 8:
            raise DataError(f"BERT samples need seq_length >= 8 ([CLS] A [SEP] B [SEP]), got {seq_length}")
        self.indexed, self.documents, self.seq_length, self.seed, self.name = indexed, documents, seq_length, seed, name
        self.num_samples, self.binary_head = num_samples, binary_head
        self.specials = bert_specials(tokenizer)
        self.token_lookup = np.arange(tokenizer.vocab_size)  # megatron-core: every id of the vocabulary
        self.continues_word = continuing_pieces(tokenizer)
        bounds = np.asarray(indexed.doc_idx[documents.start:documents.stop + 1], dtype=np.int64)
        target, min_sentences = seq_length - 3, 2 if binary_head else 1  # room for [CLS] and two [SEP]
        description = {"kind": "bert-sample-index-v1", "files": indexed.fingerprint(), "split": name,
                       "documents": [documents.start, documents.stop], "num_samples": num_samples,
                       "target": target, "short_seq_prob": short_seq_prob, "seed": seed,
                       "min_sentences": min_sentences}
        arrays, self.built_anew = load_or_build(
            cache_dir, "bert_indices", description,
            lambda: {"sample_index": build_sentence_mapping(bounds, indexed.sizes, num_samples, target,
                                                            short_seq_prob, seed, min_sentences)})
        self.sample_index = arrays["sample_index"]  # whole epochs: at least num_samples rows

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        if not 0 <= i < len(self.sample_index):
            raise IndexError(f"{self.name} BERT sample {i} is out of range [0, {len(self.sample_index)})")
        begin, end, target = (int(v) for v in self.sample_index[i])
        sentences = [self.indexed[k].tolist() for k in range(begin, end)]
        rng = np.random.RandomState((self.seed + i) % 2**32)
        return bert_sample(sentences, target, self.seq_length, rng, self.specials, self.token_lookup,
                           self.binary_head, self.continues_word)


def pair_sample(a: List[int], b: Optional[List[int]], label, seq_length: int, specials: Specials) -> Dict[str, np.ndarray]:
    """A classification sample as Megatron lays it out: [CLS] a [SEP] (b [SEP]), token types 0 / 1,
    the longer text trimmed from its end first until it fits, padded; `label` an int or a float."""
    a, b = list(a), (list(b) if b is not None else None)
    room = seq_length - (3 if b is not None else 2)
    while len(a) + len(b or []) > room:
        longer = a if b is None or len(a) > len(b) else b
        longer.pop()
    tokens = [specials.cls, *a, specials.sep] + ([*b, specials.sep] if b is not None else [])
    n = len(tokens)
    out = {"tokens": np.full(seq_length, specials.pad, dtype=np.int64), "token_types": np.zeros(seq_length, np.int64),
           "padding_mask": np.zeros(seq_length, np.int64),
           "label": np.array(label, dtype=np.float32 if isinstance(label, float) else np.int64)}
    out["tokens"][:n] = tokens
    out["token_types"][len(a) + 2:n] = 1
    out["padding_mask"][:n] = 1
    return out


class BertSamples:
    """How the BERT family makes its samples (megalm.data.build_data's `samples`)."""

    split_by = "documents"  # as megatron-core splits masked-LM data

    def __init__(self, model_cfg):
        self.binary_head = model_cfg.binary_head
        self.num_labels = getattr(model_cfg, "num_labels", 0)
        self.num_choices = getattr(model_cfg, "num_choices", 0)

    def mock(self, tokenizer, seq_length: int, seed: int, name: str, num_samples: Optional[int]):
        return MockBertDataset(tokenizer, seq_length, seed, name, num_samples, binary_head=self.binary_head)

    def classification(self, tokenizer, seq_length: int):
        """example -> sample (megalm.data.tasks.classification.Example to pair_sample's dict)."""
        specials = bert_specials(tokenizer)

        def make(example):
            text = tokenizer.encode(example.text)
            if example.choices is not None:  # one [CLS] context [SEP] choice [SEP] per choice: (C, T)
                return stack_choices([pair_sample(text, tokenizer.encode(c), example.label, seq_length, specials)
                                      for c in example.choices])
            pair = tokenizer.encode(example.pair) if example.pair is not None else None
            return pair_sample(text, pair, example.label, seq_length, specials)
        return make

    def qa(self, tokenizer, seq_length: int, doc_stride: int, max_query_length: int):
        """question -> its windows (megalm.data.tasks.squad.windows: [CLS] question [SEP] context window [SEP])."""
        specials = bert_specials(tokenizer)
        return lambda question: windows(question, tokenizer.encode, specials, seq_length, doc_stride, max_query_length)

    def dataset(self, indexed, documents: range, *, tokenizer, seq_length: int, seed: int, name: str,
                num_samples: Optional[int], cache_dir) -> BertDataset:
        return BertDataset(indexed, documents, seq_length, seed, name, num_samples, tokenizer=tokenizer,
                           binary_head=self.binary_head, cache_dir=cache_dir)
