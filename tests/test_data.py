"""Data pipeline: indexed format, tokenizers, packing, sampling order, build_data end to end."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from megalm.config import DataConfig, TokenizerConfig
from megalm.data import (GPTDataset, IndexedDataset, IndexedDatasetWriter, MicroBatchLoader,
                         MockGPTDataset, NullTokenizer, SentencePieceTokenizer, build_data,
                         load_tokenizer, split_documents, stdlib_corpus)
from megalm.data.tokenizers import sentencepiece as tokenizer_module


def random_docs(rng, n, high, max_len=50):
    return [rng.integers(0, high, size=rng.integers(0, max_len)).tolist() for _ in range(n)]


def write(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return IndexedDataset(prefix)


# ---------------------------------------------------------------- indexed format

@pytest.mark.parametrize("dtype,high", [(np.uint16, 65535), (np.int32, 2**31 - 1)])
def test_indexed_round_trip(tmp_path, dtype, high):
    docs = random_docs(np.random.default_rng(0), 200, high)
    ds = write(tmp_path / "d", docs, dtype)
    assert len(ds) == ds.num_documents == 200
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.doc_idx.tolist() == list(range(201))
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc
        assert ds.get_document(i).tolist() == doc
    assert ds[-1].tolist() == docs[-1]
    with pytest.raises(IndexError):
        ds[200]


def test_indexed_golden_bytes(tmp_path):
    docs = [[1, 2, 3], [4], [], [65535, 0]]
    write(tmp_path / "g", docs, np.uint16)
    # Built from the format description alone, independently of the writer.
    golden = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
              + struct.pack("<Q", 4) + struct.pack("<Q", 5)
              + struct.pack("<4i", 3, 1, 0, 2)
              + struct.pack("<4q", 0, 6, 8, 8)
              + struct.pack("<5q", 0, 1, 2, 3, 4))
    assert (tmp_path / "g.idx").read_bytes() == golden
    assert (tmp_path / "g.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 65535, 0)

    write(tmp_path / "h", [[7, -1]], np.int32)
    golden32 = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 1, 2) + struct.pack("<i", 2)
                + struct.pack("<q", 0) + struct.pack("<2q", 0, 1))
    assert (tmp_path / "h.idx").read_bytes() == golden32
    assert (tmp_path / "h.bin").read_bytes() == struct.pack("<2i", 7, -1)


def test_indexed_reader_errors(tmp_path):
    prefix = tmp_path / "e"
    with pytest.raises(FileNotFoundError, match=r"e\.idx"):
        IndexedDataset(prefix)
    write(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    good = (tmp_path / "e.idx").read_bytes()

    def with_idx(data):
        (tmp_path / "e.idx").write_bytes(data)
        return lambda: IndexedDataset(prefix)

    with pytest.raises(ValueError, match="bad magic b'NOTMEGA"):
        with_idx(b"NOTMEGA\x00\x00" + good[9:])()
    with pytest.raises(ValueError, match="version 2 is not supported"):
        with_idx(good[:9] + struct.pack("<Q", 2) + good[17:])()
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        with_idx(good[:17] + b"\x09" + good[18:])()
    with pytest.raises(ValueError, match=r"\d+ bytes, but a header of 2 sequences"):
        with_idx(good[:-4])()
    with pytest.raises(ValueError, match="shorter than the 34-byte header"):
        with_idx(good[:20])()
    with_idx(good)
    (tmp_path / "e.bin").write_bytes((tmp_path / "e.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"e\.bin: 8 bytes, but .* describes 5 tokens of uint16 = 10 bytes"):
        IndexedDataset(prefix)
    (tmp_path / "e.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"e\.bin does not exist"):
        IndexedDataset(prefix)


def test_interrupted_write_leaves_no_index(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    w.add_document([1, 2, 3])
    assert not (tmp_path / "x.idx").exists() and not (tmp_path / "x.bin").exists()
    w.abort()
    assert list(tmp_path.iterdir()) == []

    # Failing halfway through rewriting keeps the previous complete pair intact.
    write(tmp_path / "y", [[9, 9]], np.uint16)
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "y", np.uint16) as w:
            w.add_document([1])
            raise RuntimeError("killed")
    assert IndexedDataset(tmp_path / "y")[0].tolist() == [9, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["y.bin", "y.idx"]


def test_writer_rejects_ids_outside_dtype(tmp_path):
    with IndexedDatasetWriter(tmp_path / "r", np.uint16) as w:
        with pytest.raises(ValueError, match=r"\[0, 70000\] do not fit .*uint16"):
            w.add_document([0, 70000])


# ---------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


@pytest.fixture(scope="module")
def small_corpus(corpus):
    small = [f for f in corpus.files if 2_000 < f[1] < 15_000][:15]
    return type(corpus)(corpus.root, small)


@pytest.fixture(scope="module")
def sp_tok(small_corpus, tmp_path_factory):
    return SentencePieceTokenizer.train(small_corpus, 600, tmp_path_factory.mktemp("cache"))


NASTY = ("def f(x):\n\tif x:\n\t\treturn  x   \n\n\n    # trailing   \r\n"
         "s = 'héllo wörld ☃ 日本語 \U0001F600 \u2581 a\u2581\u2581b \u00a0\u3000 e\u0301'\n"
         "\x00\x01\x7f\ufeff   \t \t\n")


def test_sentencepiece_round_trip_is_exact(sp_tok, corpus):
    for text in (NASTY, "", " ", "\n", "\u2581", "  leading spaces", "\t\ttabs"):
        assert sp_tok.decode(sp_tok.encode(text)) == text
    # Real files the tokenizer never saw: non-ASCII ones, plus one re-indented with tabs
    # (this stdlib has no tab characters at all, but user code does).
    unseen = corpus.subset(100, len(corpus))
    texts = list(unseen.subset(0, 4).texts())
    texts += [t for t in unseen.texts() if not t.isascii() and len(t) > 500][:3]
    texts += [texts[0].replace("    ", "\t"), NASTY]
    assert "\t" in texts[-1] and sum(not t.isascii() for t in texts) >= 3
    batch = sp_tok.encode_batch(texts)
    for text, ids in zip(texts, batch):
        assert ids == sp_tok.encode(text)
        assert sp_tok.decode(ids) == text
        assert sp_tok.eod not in ids and all(0 <= i < sp_tok.vocab_size for i in ids)
    assert sp_tok.decode(sp_tok.encode("a") + [sp_tok.eod]) == "a"
    # Indentation is learned as whitespace pieces rather than one byte per space.
    assert len(sp_tok.encode(" " * 8)) < 8


def test_tokenizer_cache_is_reused(small_corpus, tmp_path, monkeypatch):
    first = SentencePieceTokenizer.train(small_corpus, 400, tmp_path)
    (model,) = (tmp_path / "tokenizers").glob("*/tokenizer.model")
    stamp = model.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been reused")

    monkeypatch.setattr(tokenizer_module.spm.SentencePieceTrainer, "train", no_training)
    second = SentencePieceTokenizer.train(small_corpus, 400, tmp_path)
    assert second.identity == first.identity and model.stat().st_mtime_ns == stamp
    with pytest.raises(AssertionError):  # a different vocab size is a different cache entry
        SentencePieceTokenizer.train(small_corpus, 401, tmp_path)


def test_save_and_load_tokenizers(sp_tok, tmp_path):
    back = load_tokenizer(sp_tok.save_to(tmp_path / "sp"))
    assert isinstance(back, SentencePieceTokenizer)
    assert (back.identity, back.vocab_size, back.eod) == (sp_tok.identity, sp_tok.vocab_size, sp_tok.eod)
    assert back.encode(NASTY) == sp_tok.encode(NASTY)

    null = NullTokenizer(1000)
    assert (null.eod, null.encode("5 6 7"), null.decode([5, 6, 7])) == (999, [5, 6, 7], "5 6 7")
    back = load_tokenizer(null.save_to(tmp_path / "null"))
    assert isinstance(back, NullTokenizer) and back.vocab_size == 1000
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "nothing")


def test_tokenizer_files_and_sidecars_get_the_mode_of_other_files(sp_tok, tmp_path):
    """Written through a temporary file (mkstemp: 0600) and renamed, they get the mode open() gives a new file
    here (0666 less the umask), as the rest of a run directory or a corpus has."""
    import os
    from megalm.data.provenance import sidecar_path, write_provenance
    (tmp_path / "plain").write_text("x")
    want = os.stat(tmp_path / "plain").st_mode & 0o777
    folder = sp_tok.save_to(tmp_path / "sp")
    written = [p for p in folder.iterdir() if p.is_file()]
    assert written and all(os.stat(p).st_mode & 0o777 == want for p in written)
    write_provenance(tmp_path / "corpus", sp_tok, documents=1)
    assert os.stat(sidecar_path(tmp_path / "corpus")).st_mode & 0o777 == want


def test_a_sentencepiece_model_given_as_its_folder_or_as_the_wrong_file(sp_tok, tmp_path):
    """tokenizer.model may name the folder train_tokenizer (or a run) wrote; a folder without a model, or a JSON
    file, is refused saying what was given and what to give."""
    folder = sp_tok.save_to(tmp_path / "sp")
    assert SentencePieceTokenizer(folder).identity == sp_tok.identity
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"sentencepiece model {tmp_path / 'empty'} is a folder without a "
                                                 "tokenizer.model"):
        SentencePieceTokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match=rf"{folder / 'tokenizer.json'} is not a sentencepiece model \(\d+ bytes do "
                                         r"not parse as one\); it is JSON: a Hugging Face tokenizer.json takes "
                                         r"data.tokenizer.type=huggingface"):
        SentencePieceTokenizer(folder / "tokenizer.json")


def test_corpus_order_and_limit(corpus):
    rels = [rel for rel, _ in corpus.files]
    assert rels != sorted(rels)
    assert not any("site-packages" in r or "__pycache__" in r for r in rels)
    assert all(r.endswith(".py") for r in rels)
    small = stdlib_corpus(0.2)
    assert small.files == corpus.files[:len(small)] and small.num_bytes <= 200_000
    assert small.fingerprint() == stdlib_corpus(0.2).fingerprint() != corpus.fingerprint()


# ---------------------------------------------------------------- packing

# The sample index against a token-by-token reference, epochs and shuffling: tests/test_data_gpt.py.

def test_too_small_split_names_the_numbers(tmp_path):
    ds = write(tmp_path / "s", [[1, 2, 3], [4, 5]], np.uint16)
    with pytest.raises(ValueError, match=r"valid split has 5 tokens in 2 documents.*needs seq_length \+ 1 = 9"):
        GPTDataset(ds, range(0, 2), seq_length=8, seed=0, name="valid")


def test_split_documents():
    assert split_documents(100, "98,2,0") == [range(0, 98), range(98, 100), range(100, 100)]
    assert split_documents(10, "1,1") == [range(0, 5), range(5, 10), range(10, 10)]
    assert split_documents(7, "4,2,1") == [range(0, 4), range(4, 6), range(6, 7)]
    # megatron-core's rounding: each cumulative bookend (0, 1/3, 2/3, 1) rounds on its own
    # (tests/test_megatron_core_data.py checks it against megatron-core itself).
    assert split_documents(10, "1,1,1") == [range(0, 3), range(3, 7), range(7, 10)]
    assert split_documents(1000, "949,50,1") == [range(0, 949), range(949, 999), range(999, 1000)]
    with pytest.raises(ValueError, match="data.split"):
        split_documents(10, "1,x")


# ---------------------------------------------------------------- sampling order

class Identity:
    """Sample i is [i, i, ...], so batches show exactly which samples they hold."""

    def __getitem__(self, i):
        return np.full(3, i, dtype=np.int64)


def test_loader_resume_is_exact():
    mock = MockGPTDataset(vocab_size=500, seq_length=8, seed=5)
    kw = dict(micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2)
    straight = MicroBatchLoader(mock, **kw)
    expected = [straight.next_batch() for _ in range(6)]
    first = MicroBatchLoader(mock, **kw)
    got = [first.next_batch() for _ in range(2)]
    assert first.consumed_samples == 16
    resumed = MicroBatchLoader(mock, consumed_samples=first.consumed_samples, **kw)
    got += [resumed.next_batch() for _ in range(4)]
    for a, b in zip(expected, got):
        assert len(a) == len(b) == 2
        for x, y in zip(a, b):
            assert x.dtype == torch.int64 and x.shape == (2, 9) and torch.equal(x, y)


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_sharding_covers_each_global_batch(dp):
    mbs, gbs = 2, 16
    loaders = [MicroBatchLoader(Identity(), micro_batch_size=mbs, global_batch_size=gbs,
                                dp_rank=r, dp_size=dp, consumed_samples=40) for r in range(dp)]
    for step in range(3):
        seen = []
        for r, loader in enumerate(loaders):
            micro = loader.next_batch()
            assert len(micro) == gbs // (mbs * dp)
            for j, mb in enumerate(micro):
                ids = mb[:, 0].tolist()
                start = 40 + step * gbs + j * mbs * dp + r * mbs
                assert ids == list(range(start, start + mbs))
                seen += ids
        assert sorted(seen) == list(range(40 + step * gbs, 40 + (step + 1) * gbs))
    with pytest.raises(ValueError, match=r"global_batch_size=12 .* micro_batch_size\(2\) \* dp_size\(4\) = 8"):
        MicroBatchLoader(Identity(), micro_batch_size=2, global_batch_size=12, dp_size=4)


class Watched:
    """Identity's samples, recording which thread read each index; `wanted` is set once index `watch` is read."""

    def __init__(self, length=10 ** 6, watch=None):
        import threading
        self.length, self.watch, self.threads, self.wanted = length, watch, {}, threading.Event()

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        import threading
        self.threads[i] = threading.current_thread().name
        if i == self.watch:
            self.wanted.set()
        return np.full(3, i, dtype=np.int64)


def test_prefetcher_builds_ahead_in_loader_order_and_resumes_exactly():
    from megalm.data.loader import Prefetcher
    kw = dict(micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2)
    plain = MicroBatchLoader(Identity(), **kw)
    expected = [plain.next_batch()[0][:, 0].tolist() for _ in range(6)]
    data = Watched(watch=3 * 8 + 2)  # this rank's first sample of the 4th global batch
    loader = Prefetcher(MicroBatchLoader(data, **kw), depth=2)
    got = [loader.next_batch()[0][:, 0].tolist() for _ in range(2)]
    assert loader.consumed_samples == 16  # what was handed out, not what was built ahead
    # While the step holds batch 2, batches 3 and 4 are built in the background, unasked.
    assert data.wanted.wait(timeout=120), "the prefetcher did not build the batches after the one handed out"
    assert set(data.threads.values()) == {"megalm-prefetch"}  # every sample was read in the background
    assert loader.consumed_samples == 16
    # A resume at the state a checkpoint would hold drops what was built ahead and continues exactly.
    resumed = Prefetcher(MicroBatchLoader(Identity(), **kw), depth=3)
    resumed.consumed_samples = loader.consumed_samples
    got += [resumed.next_batch()[0][:, 0].tolist() for _ in range(4)]
    assert got == expected
    resumed.consumed_samples = 8  # set again mid-run: from global batch 1 on
    assert resumed.next_batch()[0][:, 0].tolist() == expected[1]
    loader.close(), resumed.close()


def test_prefetcher_raises_running_out_where_the_loader_would():
    from megalm.data.loader import DataExhaustedError, Prefetcher
    kw = dict(micro_batch_size=2, global_batch_size=4)
    plain, ahead = MicroBatchLoader(Watched(length=10), **kw), Prefetcher(MicroBatchLoader(Watched(length=10), **kw), 3)
    for _ in range(2):  # samples 0-7; the third batch would need 8-11 of 10
        assert [torch.equal(a, b) for a, b in zip(plain.next_batch(), ahead.next_batch())] == [True, True]
    for loader in (plain, ahead):
        with pytest.raises(DataExhaustedError, match="built for 10 samples.*needs samples 8..11"):
            loader.next_batch()
        assert loader.consumed_samples == 8
    with pytest.raises(DataExhaustedError):  # still the same batch, not a hang
        ahead.next_batch()
    with pytest.raises(ValueError, match="data.prefetch=0"):
        Prefetcher(plain, 0)


def test_mock_source_is_deterministic(tmp_path):
    cfg = DataConfig(source="mock", cache_dir=str(tmp_path), tokenizer=TokenizerConfig(vocab_size=300))
    a = build_data(cfg, seq_length=16, seed=7)
    b = build_data(cfg, seq_length=16, seed=7)
    c = build_data(cfg, seq_length=16, seed=8)
    assert a.tokenizer.vocab_size == 300 and len(a.train) >= 1000 and len(a.valid) >= 1000
    for i in (0, 1, 999, 10**6):
        x = a.train[i]
        assert x.shape == (17,) and x.dtype == np.int64 and 0 <= x.min() and x.max() < 300
        assert np.array_equal(x, b.train[i])
        assert not np.array_equal(x, c.train[i]) and not np.array_equal(x, a.valid[i])
    assert list(tmp_path.iterdir()) == []  # mock writes nothing


# ---------------------------------------------------------------- end to end

def test_build_data_stdlib_end_to_end(tmp_path, monkeypatch):
    cfg = DataConfig(source="stdlib", cache_dir=str(tmp_path / "cache"), max_corpus_mb=0.3,
                     split="80,20,0", tokenizer=TokenizerConfig(vocab_size=700))
    bundle = build_data(cfg, seq_length=32, seed=1)
    tok = bundle.tokenizer
    assert tok.vocab_size == 700 and bundle.test is None
    assert len(bundle.train) > 0 and len(bundle.valid) > 0
    sample = bundle.train[0]
    assert sample.shape == (33,) and sample.max() < tok.vocab_size

    # Every cached document decodes back to its source file, followed by eod.
    corpus = stdlib_corpus(0.3)
    (idx,) = (tmp_path / "cache" / "corpora").glob("*/tokens.idx")
    indexed = IndexedDataset(idx.with_suffix(""))
    assert indexed.num_documents == len(corpus)
    for d, text in enumerate(corpus.texts()):
        ids = indexed.get_document(d).tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text

    # A second build reuses tokenizer and tokens: nothing is trained or rewritten.
    stamp = idx.stat().st_mtime_ns
    monkeypatch.setattr(tokenizer_module.spm.SentencePieceTrainer, "train",
                        lambda *a, **k: pytest.fail("retrained"))
    again = build_data(cfg, seq_length=32, seed=1)
    assert idx.stat().st_mtime_ns == stamp and np.array_equal(again.valid[3], bundle.valid[3])
    assert not again.train.built_anew  # the sample indices come from the cache too

    # The stdlib corpus goes through the Megatron GPT dataset: asking for more samples than one
    # epoch holds builds more epochs over the same cached tokens.
    one_epoch = len(bundle.train)
    more = build_data(cfg, seq_length=32, seed=1, num_samples={"train": 3 * one_epoch, "valid": 5})
    assert more.train.num_epochs == 3 and len(more.train) >= 3 * one_epoch and len(more.valid) >= 5
    assert idx.stat().st_mtime_ns == stamp

    # The cache folder is a self-contained indexed dataset.
    indexed_cfg = DataConfig(source="indexed", paths=[str(idx.with_suffix(""))], split="80,20,0",
                             cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(model=str(idx.parent / "tokenizer.model")))
    direct = build_data(indexed_cfg, seq_length=32, seed=1)
    assert direct.tokenizer.identity == tok.identity
    assert np.array_equal(direct.train[5], bundle.train[5])
    indexed_cfg.paths = ["a", "b"]
    with pytest.raises(ValueError, match="blending"):
        build_data(indexed_cfg, seq_length=32, seed=1)
