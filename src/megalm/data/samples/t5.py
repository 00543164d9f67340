"""T5 span-corruption samples with megatron-core's semantics (T5MaskedWordPieceDataset), from
sentence-split corpora (T5Dataset) or synthetic (MockT5Dataset).

A sample is a run of whole sentences of one document (megatron-core's sample index, as BERT's,
with at least one sentence and room for 2 more tokens), flattened and cut to its target length.
15% of its tokens are masked in spans of whole words whose length n is drawn from a geometric
distribution (p = 0.2) clipped at 10. Each span becomes one sentinel in the encoder's input; the
decoder's input is `[BOS]` then, for each span in order, its sentinel and its tokens; the decoder's
target is the same shifted by one, ending in `[EOS]`:

    tokens    a b c d e f g h           spans (c d), (g)
    encoder   a b <extra_id_0> e f <extra_id_1> h
    decoder   [BOS] <extra_id_0> c d <extra_id_1> g
    labels    <extra_id_0> c d <extra_id_1> g [EOS]

Sentinels are the tokenizer's `<extra_id_0>`, `<extra_id_1>`, ... in that order. Every random draw
of sample i comes from numpy.random.RandomState(seed + i), in megatron-core's order, so a sample
does not depend on the layout that reads it.

Batch fields: tokens and padding_mask (the encoder's, padded to model.seq_length),
decoder_tokens, labels (IGNORE on padding) and loss_mask (1.0 on the decoder's real tokens), all
padded to model.decoder_seq_length.

Fine-tuning pairs (data=sft: JSON lines of {"prompt": source, "response": target}) become the same
fields: the encoder reads the source, the decoder `[BOS] target` and learns `target [EOS]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from megalm.data.formats.cache import load_or_build
from megalm.data.samples.masking import SHORT_SEQ_PROB, choose_spans, continuing_pieces, mock_sentences
from megalm.data.tokenizers.specials import Specials
from megalm.data.samples.sentence_index import build_sentence_mapping
from megalm.errors import DataError
from megalm.ops.labels import IGNORE

MAX_NGRAM = 10  # megatron-core's T5: spans of up to 10 words, geometric lengths
_SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}
_MOCK_DEFAULT_SAMPLES = 1 << 20
NUM_SENTINELS = 100
SENTINEL = "<extra_id_{}>"
T5_SPECIAL_TOKENS = ["<pad>", *(SENTINEL.format(k) for k in range(NUM_SENTINELS))]
"""What megalm reserves in a sentencepiece model it trains for T5 (its <s> and </s> are BOS and EOS)."""
SPECIAL_NAMES = {"bos": ("<s>", "[BOS]", "<bos>", "[CLS]"), "eos": ("</s>", "[EOS]", "<eos>", "[SEP]"),
                 "pad": ("<pad>", "[PAD]", "<PAD>")}


@dataclass(frozen=True)
class T5Specials:
    """The ids T5 samples need from the tokenizer."""
    bos: int
    eos: int
    pad: int
    sentinels: Sequence[int]


def t5_specials(tokenizer) -> T5Specials:
    """BOS, EOS, PAD and the sentinels <extra_id_0>, <extra_id_1>, ... (as many as it has in a row) of
    the tokenizer. A tokenizer without a vocabulary (mock or pre-tokenized data) uses PAD 0, BOS 1,
    EOS 2 and the top 100 ids as sentinels, <extra_id_0> the highest (Hugging Face T5's order)."""
    if tokenizer.pieces() is None:
        V = tokenizer.vocab_size
        if V < NUM_SENTINELS + 8:
            raise DataError(f"T5 samples over a vocabulary without names keep its top {NUM_SENTINELS} ids as "
                            f"sentinels: the vocabulary of {V} needs at least {NUM_SENTINELS + 8}")
        return T5Specials(bos=1, eos=2, pad=0, sentinels=tuple(V - 1 - k for k in range(NUM_SENTINELS)))
    found = {}
    for role, names in SPECIAL_NAMES.items():
        ids = [i for i in map(tokenizer.token_to_id, names) if i is not None]
        if ids:
            found[role] = ids[0]
    sentinels = []
    while (i := tokenizer.token_to_id(SENTINEL.format(len(sentinels)))) is not None:
        sentinels.append(i)
    missing = [names[0] for role, names in SPECIAL_NAMES.items() if role not in found]
    if not sentinels:
        missing.append(f"{SENTINEL.format(0)}, {SENTINEL.format(1)}, ...")
    if missing:
        raise DataError(
            f"T5 samples need BOS, EOS, PAD and sentinel tokens; the {tokenizer.identity} tokenizer"
            f"{f' ({tokenizer.origin})' if tokenizer.origin else ''} lacks {'; '.join(missing)}: use a sentencepiece "
            f"model trained with them (tokenizer.special_tokens when megalm trains it: data=stdlib_prose_t5 has "
            f"<pad> and {NUM_SENTINELS} sentinels), or a T5 tokenizer.json")
    return T5Specials(bos=found["bos"], eos=found["eos"], pad=found["pad"], sentinels=tuple(sentinels))


def t5_sample(sentences: List[List[int]], target_length: int, seq_length: int, decoder_length: int,
              rng: np.random.RandomState, specials: T5Specials,
              continues_word: Optional[np.ndarray] = None) -> Dict[str, np.ndarray]:
    """One span-corruption sample from the sentences of a sample-index entry (megatron-core's
    T5MaskedWordPieceDataset.__getitem__)."""
    tokens = [t for s in sentences for t in s][:target_length]
    # T5 replaces each masked token by [MASK] (no draw); the spans become sentinels below.
    no_cls = Specials(cls=-1, sep=-1, mask=-1, pad=specials.pad)
    _, spans = choose_spans(tokens, target_length, rng, no_cls, lambda _: None, continues_word,
                            max_ngram=MAX_NGRAM, geometric=True)
    spans.sort(key=lambda span: span[0])
    if len(spans) > len(specials.sentinels):
        raise DataError(f"a T5 sample has {len(spans)} masked spans but the tokenizer has "
                        f"{len(specials.sentinels)} sentinels")
    encoder, decoder_in, decoder_out, begin = [], [specials.bos], [], 0
    for sentinel, span in zip(specials.sentinels, spans):
        encoder += tokens[begin:span[0]] + [sentinel]
        labels = [tokens[i] for i in span]
        decoder_in += [sentinel, *labels]
        decoder_out += [sentinel, *labels]
        begin = span[-1] + 1
    encoder += tokens[begin:]
    decoder_out.append(specials.eos)
    if len(encoder) > seq_length or len(decoder_in) > decoder_length:
        raise DataError(f"a T5 sample of {len(encoder)} encoder and {len(decoder_in)} decoder tokens does not fit "
                        f"model.seq_length={seq_length} and model.decoder_seq_length={decoder_length}: raise "
                        "model.decoder_seq_length (15% of the encoder's tokens, and a sentinel a span, go there)")
    return _fields(encoder, decoder_in, decoder_out, seq_length, decoder_length, specials.pad)


def _fields(encoder: List[int], decoder_in: List[int], decoder_out: List[int], seq_length: int, decoder_length: int,
            pad: int) -> Dict[str, np.ndarray]:
    """The batch fields of one sample, padded: the encoder's tokens and mask, the decoder's input,
    targets (IGNORE on padding) and loss mask."""
    n, d = len(encoder), len(decoder_in)
    out = {"tokens": np.full(seq_length, pad, dtype=np.int64),
           "padding_mask": np.zeros(seq_length, dtype=np.int64),
           "decoder_tokens": np.full(decoder_length, pad, dtype=np.int64),
           "labels": np.full(decoder_length, IGNORE, dtype=np.int64),
           "loss_mask": np.zeros(decoder_length, dtype=np.float32)}
    out["tokens"][:n] = encoder
    out["padding_mask"][:n] = 1
    out["decoder_tokens"][:d] = decoder_in
    out["labels"][:d] = decoder_out
    out["loss_mask"][:d] = 1.0
    return out


class MockT5Dataset:
    """Synthetic T5 samples with no files: sample i depends only on (seed, split, i).

    Each sample has 2-4 "sentences", each an arithmetic progression of ids (modulo the
    vocabulary, between the special ids and the sentinels) continuing the previous one, so a model
    can learn to fill in the spans; then t5_sample's span corruption. For quick runs and the
    layout tests; real corpora go through T5Dataset.
    """

    def __init__(self, tokenizer, seq_length: int, decoder_length: int, seed: int, name: str = "train",
                 num_samples: Optional[int] = None):
        if name not in _SPLIT_IDS:
            raise DataError(f"mock split name {name!r} is not one of {', '.join(_SPLIT_IDS)}")
        self.seq_length, self.decoder_length, self.seed, self.name = seq_length, decoder_length, seed, name
        self.specials = t5_specials(tokenizer)
        self.num_samples = num_samples or _MOCK_DEFAULT_SAMPLES
        self.low = max(self.specials.bos, self.specials.eos, self.specials.pad) + 1
        self.high = min(self.specials.sentinels)
        if seq_length < 8 or self.high - self.low < 2:
            raise DataError(f"mock T5 data needs seq_length >= 8 and ids between the special ids and the "
                            f"sentinels (got {seq_length}, ids {self.low}..{self.high - 1})")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock {self.name} sample {i} is out of range [0, {self.num_samples})")
        target = self.seq_length - 2
        sentences = mock_sentences(self.seed, self.name, i, self.low, self.high, target)
        rng = np.random.RandomState((self.seed + i) % 2**32)
        return t5_sample(sentences, target, self.seq_length, self.decoder_length, rng, self.specials)


class T5Dataset:
    """megatron-core's T5MaskedWordPieceDataset over documents [documents.start, documents.stop) of
    a sentence-split IndexedDataset (preprocess --split-sentences, or data=stdlib_prose_t5).

    The sample index is megatron-core's build_mapping (megalm.data.samples.sentence_index) with targets of
    seq_length - 2 tokens (shorter with probability short_seq_prob) and at least one sentence;
    whole epochs until num_samples (None: one epoch). Item i is t5_sample of row i with
    RandomState(seed + i).
    """

    def __init__(self, indexed, documents: range, seq_length: int, decoder_length: int, seed: int,
                 name: str = "train", num_samples: Optional[int] = None, *, tokenizer,
                 short_seq_prob: float = SHORT_SEQ_PROB, cache_dir=None):
        if not 0 <= documents.start <= documents.stop <= indexed.num_documents or documents.step != 1:
            raise DataError(f"{name} split: documents {documents} are not a contiguous range within the "
                            f"{indexed.num_documents} documents of {indexed.prefix}")
        if seq_length < 8:
            raise DataError(f"T5 samples need seq_length >= 8, got {seq_length}")
        self.indexed, self.documents, self.seed, self.name = indexed, documents, seed, name
        self.seq_length, self.decoder_length, self.num_samples = seq_length, decoder_length, num_samples
        self.specials = t5_specials(tokenizer)
        self.continues_word = continuing_pieces(tokenizer)
        bounds = np.asarray(indexed.doc_idx[documents.start:documents.stop + 1], dtype=np.int64)
        target = seq_length - 2  # megatron-core's room for one BOS and one EOS
        description = {"kind": "t5-sample-index-v1", "files": indexed.fingerprint(), "split": name,
                       "documents": [documents.start, documents.stop], "num_samples": num_samples,
                       "target": target, "short_seq_prob": short_seq_prob, "seed": seed, "min_sentences": 1}
        arrays, self.built_anew = load_or_build(
            cache_dir, "t5_indices", description,
            lambda: {"sample_index": build_sentence_mapping(bounds, indexed.sizes, num_samples, target,
                                                            short_seq_prob, seed, 1)})
        self.sample_index = arrays["sample_index"]

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        if not 0 <= i < len(self.sample_index):
            raise IndexError(f"{self.name} T5 sample {i} is out of range [0, {len(self.sample_index)})")
        begin, end, target = (int(v) for v in self.sample_index[i])
        sentences = [self.indexed[k].tolist() for k in range(begin, end)]
        rng = np.random.RandomState((self.seed + i) % 2**32)
        return t5_sample(sentences, target, self.seq_length, self.decoder_length, rng, self.specials,
                         self.continues_word)


def pair_sample(source: List[int], target: List[int], seq_length: int, decoder_length: int, specials: T5Specials,
                where: str = "a pair") -> Dict[str, np.ndarray]:
    """A fine-tuning sample of a (source, target) pair: the encoder reads the source, the decoder
    `[BOS] target` and learns `target [EOS]`; nothing is cut (a pair too long is an error naming it)."""
    if not source:
        raise DataError(f"{where}: the source is empty: the encoder needs at least one token")
    if not target:
        raise DataError(f"{where}: the target is empty: nothing to learn")
    if len(source) > seq_length or len(target) + 1 > decoder_length:
        raise DataError(f"{where}: a source of {len(source)} tokens and a target of {len(target)} (+ [EOS]) do not "
                        f"fit model.seq_length={seq_length} and model.decoder_seq_length={decoder_length}")
    return _fields(source, [specials.bos, *target], [*target, specials.eos], seq_length, decoder_length, specials.pad)


class T5Samples:
    """How the T5 family makes its samples (megalm.data.build_data's `samples`)."""

    split_by = "documents"  # as megatron-core splits masked-LM data

    def __init__(self, model_cfg):
        self.decoder_length = model_cfg.decoder_seq_length

    def mock(self, tokenizer, seq_length: int, seed: int, name: str, num_samples: Optional[int]):
        return MockT5Dataset(tokenizer, seq_length, self.decoder_length, seed, name, num_samples)

    def sft(self, tokenizer, seq_length: int):
        """(JSON record, where) -> pair_sample: {"prompt": source, "response": target} (data=sft; the
        source and target of a translation)."""
        specials = t5_specials(tokenizer)

        def make(record, where: str) -> Dict[str, np.ndarray]:
            if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
                raise DataError(f"{where}: an encoder-decoder example is {{\"prompt\": the source, \"response\": the "
                                f"target}}, both strings (a chat of 'messages' needs a decoder model)")
            return pair_sample(tokenizer.encode(record["prompt"]), tokenizer.encode(record["response"]), seq_length,
                               self.decoder_length, specials, where)
        return make

    def dataset(self, indexed, documents: range, *, tokenizer, seq_length: int, seed: int, name: str,
                num_samples: Optional[int], cache_dir) -> T5Dataset:
        return T5Dataset(indexed, documents, seq_length, self.decoder_length, seed, name, num_samples,
                         tokenizer=tokenizer, cache_dir=cache_dir)
