"""megalm.data.samples.sentence_index against megatron-core 0.16.1's compiled build_mapping, side by side.

megatron-core (a dev dependency; its prebuilt helpers_cpp runs on CPU) is the reference: over
random corpora with empty, one-sentence and long-sentence documents, splits that start past
sentence 0, every short_seq_prob regime, min_sentences 1 and 2, and one epoch / a few samples /
several epochs, the rows must be equal value for value and in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
from megatron.core.datasets import helpers

from megalm.data.samples.sentence_index import LONG_SENTENCE, MT19937_64, build_sentence_mapping, mt19937
from megalm.errors import DataError

ONE_EPOCH = None


def _megatron(docs, sizes, num_samples, max_seq_length, short_seq_prob, seed, min_sentences):
    """megatron's build_mapping called as its BERT dataset calls it for None / n samples."""
    if num_samples is None:
        epochs, limit = 1, 2**63
    else:
        epochs, limit = np.iinfo(np.int32).max - 1, num_samples
    out = helpers.build_mapping(docs.astype(np.int64), sizes.astype(np.int32), epochs, limit, max_seq_length,
                                short_seq_prob, seed, False, min_sentences)
    return np.asarray(out).astype(np.int64).reshape(-1, 3)


def _corpus(rng, num_docs, offset=0, long_rate=0.0):
    """(document boundaries starting at sentence `offset`, sentence lengths): documents of 0-14
    sentences (some empty, some of one), lengths 1-80, a share `long_rate` of them 511-2000."""
    counts = rng.integers(0, 15, num_docs)
    counts[rng.random(num_docs) < 0.15] = 0
    counts[rng.random(num_docs) < 0.15] = 1
    docs = offset + np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = rng.integers(1, 81, int(docs[-1]) + int(rng.integers(0, 10))).astype(np.int32)
    long = rng.random(len(sizes)) < long_rate
    sizes[long] = rng.choice([511, LONG_SENTENCE, LONG_SENTENCE + 1, 2000], int(long.sum()))
    return docs, sizes


def _assert_same(docs, sizes, *args):
    ours = build_sentence_mapping(docs, sizes, *args)
    want = _megatron(docs, sizes, *args)
    assert ours.dtype == np.int64 and ours.shape == want.shape, (ours.shape, want.shape, args)
    np.testing.assert_array_equal(ours, want, err_msg=str(args))
    return ours


@pytest.mark.parametrize("short_seq_prob", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("min_sentences", [1, 2])
@pytest.mark.parametrize("num_samples", [ONE_EPOCH, 7, 2000])
def test_equals_megatron(short_seq_prob, min_sentences, num_samples):
    rng = np.random.default_rng([int(short_seq_prob * 10), min_sentences, num_samples or 0])
    for trial in range(6):
        docs, sizes = _corpus(rng, int(rng.integers(1, 120)), offset=int(rng.choice([0, 37])),
                              long_rate=float(rng.choice([0.0, 0.02])))
        seed = int(rng.choice([1, 1234, int(rng.integers(1, 2**31))]))
        max_seq_length = int(rng.choice([2, 16, 128, 512]))
        if not ((np.diff(docs) >= min_sentences).any() or num_samples is None):
            continue
        out = _assert_same(docs, sizes, num_samples, max_seq_length, short_seq_prob, seed, min_sentences)
        if num_samples is not None:
            assert len(out) >= num_samples


def test_samples_need_several_epochs():
    rng = np.random.default_rng(1)
    docs, sizes = _corpus(rng, 30, offset=5, long_rate=0.01)
    one = build_sentence_mapping(docs, sizes, None, 64, 0.1, 99, 2)
    out = _assert_same(docs, sizes, 5 * len(one) + 1, 64, 0.1, 99, 2)
    assert len(out) > 5 * len(one)  # whole epochs: more rows than asked for, all kept
    # With no short samples every epoch is the same set of rows.
    one = build_sentence_mapping(docs, sizes, None, 64, 0.0, 99, 2)
    out = _assert_same(docs, sizes, 3 * len(one) - 1, 64, 0.0, 99, 2)
    assert len(out) == 3 * len(one)
    np.testing.assert_array_equal(np.unique(out, axis=0), np.unique(one, axis=0))


def test_long_sentence_rule():
    # Document 0: three sentences, one of exactly 512 tokens (kept); document 1: one over 512
    # among three (skipped); document 2: a single sentence over 512 (kept: the rule needs two).
    sizes = np.array([LONG_SENTENCE, 3, 4, 3, LONG_SENTENCE + 1, 5, 4000], dtype=np.int32)
    docs = np.array([0, 3, 6, 7], dtype=np.int64)
    out = _assert_same(docs, sizes, None, 16, 0.0, 3, 1)
    assert sorted(map(tuple, out.tolist())) == [(0, 1, 16), (1, 3, 16), (6, 7, 16)]
    out = _assert_same(docs, sizes, None, 16, 0.0, 3, 2)  # two sentences at least, none left alone
    assert out.tolist() == [[0, 3, 16]]


def test_edge_parameters():
    rng = np.random.default_rng(2)
    docs, sizes = _corpus(rng, 50, offset=11, long_rate=0.01)
    for args in [(None, 512, 0.4, 2**31 - 1, 1),  # seed + 1 wraps in megatron's int32
                 (0, 128, 0.5, 5, 1),  # zero samples asked: zero epochs
                 (1, 128, 0.5, 5, 3),
                 (None, 2, 1.0, 8, 1),  # every sample short, target in [2, 2]
                 (None, 300, 0.3, 17, 1)]:  # ratio round(3.33) = 3
        _assert_same(docs, sizes, *args)
    # A one-epoch corpus that gives nothing is empty, as megatron's.
    empty = np.array([4, 4, 4], dtype=np.int64)
    assert _assert_same(empty, sizes, None, 64, 0.1, 1, 1).shape == (0, 3)


def test_short_seq_ratio_rounds_half_away_from_zero():
    """short_seq_prob 0.4 is ratio round(2.5) = 3 in C, 2 under Python's round: the targets differ."""
    rng = np.random.default_rng(3)
    docs, sizes = _corpus(rng, 80)
    out = _assert_same(docs, sizes, None, 512, 0.4, 21, 1)
    assert (out[:, 2] < 512).any()


def test_impossible_corpus_raises_instead_of_hanging():
    sizes = np.array([3, 600, 4, 5, 2, 2], dtype=np.int32)
    docs = np.array([0, 3, 4, 4, 6], dtype=np.int64)  # long sentence, one sentence, empty, two short
    with pytest.raises(DataError, match=r"of 4 documents, 3 have fewer than min_sentences=3 .* 1 have a sentence over 512"):
        build_sentence_mapping(docs, sizes, 10, 64, 0.1, 1, 3)
    with pytest.raises(DataError, match="no document can give a sample"):
        build_sentence_mapping(np.array([0], dtype=np.int64), sizes, 1, 64, 0.1, 1, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed=0), "seed must be in"),
    (dict(seed=2**31), "seed must be in"),
    (dict(max_seq_length=1), "max_seq_length"),
    (dict(short_seq_prob=1.5), "short_seq_prob"),
    (dict(short_seq_prob=-0.1), "short_seq_prob"),
    (dict(short_seq_prob=1e-12), "too small"),
    (dict(min_sentences=0), "min_sentences"),
    (dict(num_samples=-1), "num_samples"),
    (dict(document_indices=np.array([0, 3, 2, 6])), "non-decreasing"),
    (dict(document_indices=np.array([0, 7])), "outside"),
    (dict(sentence_lengths=np.array([1, -2, 3, 4, 5, 6])), r"\[0, 2\*\*31\)"),
])
def test_bad_inputs(kwargs, message):
    args = dict(document_indices=np.array([0, 3, 6]), sentence_lengths=np.arange(1, 7, dtype=np.int32),
                num_samples=None, max_seq_length=16, short_seq_prob=0.1, seed=1, min_sentences=1)
    build_sentence_mapping(**args)  # the base arguments are fine
    with pytest.raises(DataError, match=message):
        build_sentence_mapping(**{**args, **kwargs})


def test_mt19937_64_matches_the_cpp_standard():
    # [rand.predef]: the 10000th output of a default-constructed std::mt19937_64 (seed 5489).
    gen = MT19937_64(5489)
    first = gen.random_raw(9000)
    assert int(np.concatenate([first, gen.random_raw(1000)])[-1]) == 9981545732273789042
    # std::mt19937_64(1235)() three times, printed by a C++ program built with g++.
    assert MT19937_64(1235).random_raw(3).tolist() == [12475983374653888083, 573922149886606219,
                                                       5802434057304372554]
    # Drawing in pieces gives the same stream as drawing at once.
    a, b = MT19937_64(7), MT19937_64(7)
    np.testing.assert_array_equal(np.concatenate([a.random_raw(5), a.random_raw(700), a.random_raw(1)]),
                                  b.random_raw(706))


def test_mt19937_matches_the_cpp_standard():
    # [rand.predef]: the 10000th output of a default-constructed std::mt19937 (seed 5489).
    assert int(mt19937(5489).random_raw(10000)[-1]) == 4123659995
    assert mt19937(1235).random_raw(3).tolist() == [4096379083, 3613105954, 4261150722]


def test_shuffle_of_a_large_mapping():
    """Thousands of rows: the shuffle runs over several twister blocks and still matches."""
    rng = np.random.default_rng(4)
    counts = rng.integers(1, 4, 20000)
    docs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = rng.integers(1, 200, int(docs[-1])).astype(np.int32)
    out = _assert_same(docs, sizes, None, 128, 0.1, 4321, 1)
    assert len(out) > 20000 and not (np.diff(out[:, 0]) > 0).all()  # shuffled, not in corpus order
