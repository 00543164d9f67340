"""What masked-LM samples share: megatron-core's whole-word span choice (`choose_spans`: BERT's n-grams,
T5's geometric spans) with WordPiece's "##" continuation pieces, and the synthetic sentences of the mock
BERT and T5 data. (The special ids they place: megalm.data.tokenizers.specials.)
"""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np

from megalm.data.tokenizers.specials import Specials

MASKING_PROBABILITY = 0.15
MAX_NGRAM = 3
SHORT_SEQ_PROB = 0.1  # Megatron's: a sample is cut to a random shorter length this often
SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


def continuing_pieces(tokenizer) -> Optional[np.ndarray]:
    """continues_word for masked_lm: the ids whose piece starts with "##" (WordPiece's mark of a
    piece inside a word, as megatron-core reads it); None when no piece does."""
    pieces = tokenizer.pieces()
    if pieces is None:
        return None
    marks = np.array([p.startswith("##") for p in pieces], dtype=bool)
    return marks if marks.any() else None


def choose_spans(tokens: List[int], target_length: int, rng: np.random.RandomState, specials: Specials,
                 mask_token: Callable[[np.random.RandomState], Optional[int]], continues_word: Optional[np.ndarray] = None,
                 max_ngram: int = MAX_NGRAM, geometric: bool = False):
    """megatron-core's _create_masked_lm_predictions (whole words, no permutation): (masked tokens,
    the masked spans as lists of positions, in the order chosen).

    Up to 15% of the tokens (of target_length), in spans of n whole words: n drawn with P(n)
    proportional to 1/n up to max_ngram, or (geometric, SpanBERT's and T5's) from a geometric
    distribution with p = 0.2 clipped at max_ngram; a span too long for the budget shrinks, one
    overlapping a chosen one is passed over. `mask_token(rng)` gives each masked position its new
    id (None: keep it), drawing from the sample's generator in megatron-core's order.
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
    ngram_sizes = np.arange(max_ngram, dtype=np.int64) + 1
    probs = 1.0 / ngram_sizes
    probs = probs / probs.sum(keepdims=True)
    # For each candidate word, its 1..max_ngram-word spans (shorter near the end), in shuffled order.
    spans = [[candidates[i:i + n] for n in ngram_sizes] for i in range(len(candidates))]
    rng.shuffle(spans)
    masked = list(tokens)
    chosen: List[List[int]] = []
    count = 0
    taken: set = set()
    for grams in spans:
        if count >= n_maskings:
            break
        if not grams:
            continue
        if geometric:
            n = min(rng.geometric(0.2), max_ngram)
        else:
            p = probs[:len(grams)] / probs[:len(grams)].sum(keepdims=True)
            n = rng.choice(ngram_sizes[:len(grams)], p=p)
        while True:  # the longest span of at most n words that still fits the budget
            positions = sum(grams[n - 1], [])
            n -= 1
            if n_maskings >= count + len(positions):
                break
            if n == 0:
                positions = None
                break
        if positions is None or any(i in taken for i in positions):
            continue
        for i in positions:
            taken.add(i)
            new = mask_token(rng)
            if new is not None:
                masked[i] = new
        count += len(positions)
        chosen.append(positions)
    # (megatron-core shuffles the spans once more here, for its permutation option; nothing draws
    # from the sample's generator after that, so it is left out.)
    return masked, chosen



def mock_sentences(seed: int, name: str, i: int, low: int, high: int, target: int) -> List[List[int]]:
    """Mock sample i's 2-4 "sentences": one arithmetic progression of ids in [low, high) (modulo the
    range), cut into pieces of 2 to target / 2 ids; fixed by (seed, split, i)."""
    g = np.random.default_rng([seed, SPLIT_IDS[name], int(i)])
    span = high - low
    start, stride = int(g.integers(0, span)), int(g.integers(1, min(7, span)))
    lengths = g.integers(2, max(3, target // 2), size=int(g.integers(2, 5)))
    ids = low + (start + stride * np.arange(int(lengths.sum()))) % span
    return [s.tolist() for s in np.split(ids, np.cumsum(lengths)[:-1])]

