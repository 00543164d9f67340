"""GPT sample indices (Megatron semantics), their cache, blending, build_data and the loader."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from megalm.config import DataConfig, TokenizerConfig
from megalm.data import (BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetWriter, MicroBatchLoader,
                         build_data, build_gpt_indices, eod_loss_mask, num_samples_for, parse_blend)
from megalm.data.formats import cache as cache_module
from megalm.data.samples import gpt as gpt_module
from megalm.data.samples.blended import blending_indices, blending_indices_reference, per_dataset_samples
from megalm.data.loader import DataExhaustedError
from megalm.data.spec import blend_spec

EOD = 999


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return IndexedDataset(prefix)


def random_docs(rng, n, max_len=30, eod=EOD, empty_every=0):
    docs = []
    for k in range(n):
        body = rng.integers(0, eod, size=rng.integers(0, max_len)).tolist()
        docs.append([] if empty_every and k % empty_every == 0 else body + [eod])
    return docs


def reference_samples(docs, document_index, seq):
    """Token by token: concatenate the documents in document-index order, cut overlapping samples."""
    stream = [t for d in document_index for t in docs[int(d)]]
    n = (len(stream) - 1) // seq
    return [stream[k * seq:k * seq + seq + 1] for k in range(n)]


# ---------------------------------------------------------------- Megatron's index construction

@pytest.mark.parametrize("num_samples,expect_epochs,expect_separate", [
    (None, 1, False),  # one epoch
    (40, 1, False),  # fits in one epoch
    (100, 2, True),  # 92 samples an epoch: 8 of the second are used, shuffled apart
    (260, 3, False),  # 76 of the third's 92 used (>= 80%): all three shuffled together
    (200, 3, True),  # 16 of the third used: shuffled apart
])
def test_sample_index_matches_token_by_token_reference(tmp_path, num_samples, expect_epochs, expect_separate):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 60, empty_every=7)  # empty documents too, document 0 among them
    ds = write(tmp_path / "p", docs)
    docs_range, seq, seed = range(0, 47), 7, 3
    gpt = GPTDataset(ds, docs_range, seq_length=seq, seed=seed, name="train", num_samples=num_samples)
    per_epoch = sum(len(docs[d]) for d in docs_range)
    assert (gpt.num_epochs, gpt.separate_final_epoch) == (expect_epochs, expect_separate)
    assert len(gpt) == (expect_epochs * per_epoch - 1) // seq >= (num_samples or 0)

    di = np.asarray(gpt.document_index)
    counts = np.bincount(di, minlength=60)
    assert counts[docs_range.start:docs_range.stop].tolist() == [expect_epochs] * len(docs_range)
    n = len(docs_range)
    if expect_separate:  # the last epoch is a permutation of its own
        assert sorted(di[-n:].tolist()) == list(docs_range)
    # Megatron's draws: one RandomState(seed) shuffles the tiled documents, then the samples.
    rs = np.random.RandomState(seed)
    tiled = [np.tile(np.arange(n, dtype=np.int32), expect_epochs - expect_separate)]
    if expect_separate:
        tiled.append(np.arange(n, dtype=np.int32))
    for part in tiled:
        rs.shuffle(part)
    assert np.array_equal(di, np.concatenate(tiled) + docs_range.start)

    ref = reference_samples(docs, di, seq)
    assert len(ref) == len(gpt)
    shuffle = np.asarray(gpt.shuffle_index)
    for i in range(len(gpt)):
        sample = gpt[i]
        assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
        assert sample.tolist() == ref[int(shuffle[i])]

    # The shuffle index permutes the samples within its groups: all of them, or the last epoch apart.
    total = len(gpt)
    first = ((expect_epochs - 1) * per_epoch - 1) // seq if expect_separate else total
    assert sorted(shuffle[:first].tolist()) == list(range(first))
    assert sorted(shuffle[first:].tolist()) == list(range(first, total))
    first_shuffle = np.arange(first, dtype=np.uint32)
    rs.shuffle(first_shuffle)
    assert np.array_equal(shuffle[:first], first_shuffle)
    with pytest.raises(IndexError, match=f"train sample {total} is out of range.*{total} samples"):
        gpt[total]


def test_separate_final_epoch_follows_megatrons_threshold():
    from megalm.data.samples.gpt import num_epochs_for, separate_final_epoch_for
    tokens, seq = 1001, 10  # 100 samples per epoch
    assert num_epochs_for(tokens, seq, None) == 1
    assert num_epochs_for(tokens, seq, 100) == 1  # 100 * 10 + 1 tokens: exactly one epoch
    assert num_epochs_for(tokens, seq, 101) == 2
    # epoch 2 contributes num_samples - 100 samples; separated below int(0.8 * 100) = 80
    assert separate_final_epoch_for(tokens, seq, 179, 2) is True
    assert separate_final_epoch_for(tokens, seq, 180, 2) is False
    assert separate_final_epoch_for(tokens, seq, 150, 1) is False


def test_samples_are_sequence_plus_one_and_cross_documents(tmp_path):
    docs = [[1, 2, EOD], [3, EOD], [], [4, 5, 6, 7, EOD]]
    gpt = GPTDataset(write(tmp_path / "x", docs), range(0, 4), seq_length=3, seed=0)
    stream = [t for d in np.asarray(gpt.document_index) for t in docs[int(d)]]
    got = sorted(gpt[i].tolist() for i in range(len(gpt)))
    assert got == sorted(stream[k * 3:k * 3 + 4] for k in range((len(stream) - 1) // 3))
    assert len(gpt) == 3  # 10 tokens: samples start at 0, 3, 6; the tail is dropped


def test_large_corpus_indices_span_two_epochs_with_whole_samples():
    # A million documents of random lengths (mean 100): no .bin, only the lengths. How fast this
    # builds (at a billion tokens) is measured by `python -m megalm.data.benchmark index`.
    rng = np.random.default_rng(0)
    sizes = rng.geometric(1 / 100, size=1_000_000).astype(np.int32)
    assert 0.99e8 < sizes.sum(dtype=np.int64) < 1.01e8
    out = build_gpt_indices(sizes, range(0, sizes.size), seq_length=2048, seed=1234,
                            num_samples=int(1.5 * sizes.sum(dtype=np.int64) / 2048))
    epochs, separate, per_epoch, _ = out["info"].tolist()
    assert (epochs, separate) == (2, 1)  # half of the second epoch is used: shuffled apart
    assert out["document_index"].shape == (2 * sizes.size,) and out["document_index"].dtype == np.int32
    assert out["sample_index"].shape == ((2 * per_epoch - 1) // 2048 + 1, 2)
    # spot-check a few samples' lengths against the concatenated lengths
    di, si = out["document_index"], out["sample_index"].astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes[di], dtype=np.int64)])
    for k in (0, 1, 12345, si.shape[0] - 2):
        a = starts[si[k, 0]] + si[k, 1]
        b = starts[si[k + 1, 0]] + si[k + 1, 1]
        assert b - a == 2048


# ---------------------------------------------------------------- cache

def test_index_cache_is_reused_and_stale_entries_ignored(tmp_path, monkeypatch):
    ds = write(tmp_path / "c", random_docs(np.random.default_rng(2), 50))
    cache = tmp_path / "cache"
    first = GPTDataset(ds, range(0, 40), seq_length=8, seed=1, num_samples=100, cache_dir=cache)
    assert first.built_anew
    expected = [first[i].copy() for i in range(len(first))]
    (entry,) = [p for p in (cache / "gpt_indices").iterdir() if p.is_dir()]
    assert sorted(p.name for p in entry.iterdir()) == ["description.json", "document_index.npy", "info.npy",
                                                        "sample_index.npy", "shuffle_index.npy"]
    description = json.loads((entry / "description.json").read_text())["description"]
    assert description["seq_length"] == 8 and description["num_samples"] == 100

    def no_build(*a, **k):
        raise AssertionError("the cached indices should have been loaded")

    monkeypatch.setattr(gpt_module, "build_gpt_indices", no_build)
    again = GPTDataset(IndexedDataset(tmp_path / "c"), range(0, 40), seq_length=8, seed=1, num_samples=100,
                       cache_dir=cache)
    assert not again.built_anew
    assert all(np.array_equal(again[i], expected[i]) for i in range(len(first)))
    with pytest.raises(AssertionError, match="cached"):  # anything that defines them is part of the key
        GPTDataset(ds, range(0, 40), seq_length=8, seed=2, num_samples=100, cache_dir=cache)
    with pytest.raises(AssertionError, match="cached"):
        GPTDataset(ds, range(0, 40), seq_length=8, seed=1, num_samples=101, cache_dir=cache)
    monkeypatch.undo()

    # A half-written entry: truncated array, and a builder's hidden leftover folder.
    del first, again  # (their memory maps point into the files about to be damaged)
    (entry / "sample_index.npy").write_bytes((entry / "sample_index.npy").read_bytes()[:50])
    leftover = entry.parent / f".{entry.name}.dead"
    leftover.mkdir()
    (leftover / "document_index.npy").write_bytes(b"partial")
    rebuilt = GPTDataset(ds, range(0, 40), seq_length=8, seed=1, num_samples=100, cache_dir=cache)
    assert rebuilt.built_anew and not leftover.exists()
    assert all(np.array_equal(rebuilt[i], expected[i]) for i in range(len(expected)))

    # The data changing on disk (size/mtime) is a different key.
    write(tmp_path / "c", random_docs(np.random.default_rng(3), 50))
    changed = GPTDataset(IndexedDataset(tmp_path / "c"), range(0, 40), seq_length=8, seed=1, num_samples=100,
                         cache_dir=cache)
    assert changed.built_anew


def test_interrupted_index_build_leaves_no_entry(tmp_path, monkeypatch):
    ds = write(tmp_path / "i", random_docs(np.random.default_rng(4), 30))
    cache = tmp_path / "cache"
    real_save, calls = np.save, []

    def dying_save(f, arr, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed while writing")
        return real_save(f, arr, **kw)

    monkeypatch.setattr(cache_module.np, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        GPTDataset(ds, range(0, 30), seq_length=4, seed=0, cache_dir=cache)
    monkeypatch.undo()
    assert [p.name for p in (cache / "gpt_indices").iterdir() if not p.name.endswith(".lock")] == []
    assert GPTDataset(ds, range(0, 30), seq_length=4, seed=0, cache_dir=cache).built_anew


def test_ranks_wait_and_load_what_the_first_built(tmp_path):
    write(tmp_path / "r", random_docs(np.random.default_rng(5), 200))  # the files the ranks read
    code = ("import sys; from megalm.data import IndexedDataset, GPTDataset; "
            f"g = GPTDataset(IndexedDataset({str(tmp_path / 'r')!r}), range(0, 200), 16, 7, num_samples=5000, "
            f"cache_dir={str(tmp_path / 'cache')!r}); print(int(g.built_anew), len(g), int(g[3].sum()))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["0", "0", "1"]  # exactly one built; the others loaded
    assert len({tuple(o[1:]) for o in outs}) == 1


# ---------------------------------------------------------------- blending

@pytest.mark.parametrize("k", [2, 3, 5])
def test_blending_equals_megatrons_sequential_loop(k):
    rng = np.random.default_rng(k)
    for trial in range(3):
        weights = (rng.random(k) ** 2 + 1e-3).tolist()
        for size in (1, 7, 5000):
            got = blending_indices(weights, size)
            want = blending_indices_reference(weights, size)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
            assert got[0].dtype == np.int16 and got[1].dtype == np.int64


def _max_lag(weights, dataset_index):
    w = np.asarray(weights, float) / sum(weights)
    n = np.arange(1, dataset_index.size + 1)
    return max(float(np.max(np.abs(np.cumsum(dataset_index == i) - w[i] * n))) for i in range(w.size))


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.01, 0.99], [1, 1], [0.2, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25]])
def test_blend_shares_stay_within_one_sample_at_every_prefix(weights):
    dataset_index, sample_index = blending_indices(weights, 20_000)
    assert _max_lag(weights, dataset_index) < 1.0
    for i in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert np.array_equal(sample_index[dataset_index == i], np.arange(np.sum(dataset_index == i)))


def test_blend_of_a_million_keeps_the_shares_and_matches_the_reference():
    # Its speed at ten million is measured by `python -m megalm.data.benchmark blend`.
    dataset_index, sample_index = blending_indices([0.3, 0.7], 1_000_000)
    assert _max_lag([0.3, 0.7], dataset_index) < 1.0
    ref_dataset, ref_sample = blending_indices_reference([0.3, 0.7], 20_000)
    assert np.array_equal(dataset_index[:20_000], ref_dataset) and np.array_equal(sample_index[:20_000], ref_sample)


def test_per_dataset_sizes_have_megatrons_margin():
    # megatron-core's ceil(ceil(w * N) * 1.005) (against megatron-core itself: tests/test_megatron_core_data.py)
    assert per_dataset_samples([0.3, 0.7], 1000) == [math.ceil(300 * 1.005), math.ceil(700 * 1.005)]
    assert per_dataset_samples([1, 3], 400) == [101, 302]
    assert per_dataset_samples([0.3, 0.7], 1001) == [math.ceil(301 * 1.005), math.ceil(701 * 1.005)] == [303, 705]


def test_blend_forms_and_bad_weights():
    nested = parse_blend([[0.3, "a"], [0.7, "b"]])
    assert nested == parse_blend(["0.3", "a", "0.7", "b"]) == parse_blend([0.3, "a", 0.7, "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_blend(["only"]) == [(1.0, "only")]
    with pytest.raises(ValueError, match=r"weight -0.5 of b is negative"):
        parse_blend([[0.3, "a"], [-0.5, "b"]])
    with pytest.raises(ValueError, match=r"all weights are zero \(0.0 a, 0.0 b\)"):
        parse_blend([0, "a", 0, "b"])
    with pytest.raises(ValueError, match="alternates weight and prefix, but it has 3 entries"):
        parse_blend([0.3, "a", "b"])
    with pytest.raises(ValueError, match=r"weight 'x' is not a number"):
        parse_blend(["x", "a", "0.5", "b"])
    with pytest.raises(ValueError, match=r"must be \[weight, prefix\]"):
        parse_blend([[0.3, "a", 1]])
    with pytest.raises(ValueError, match="not both"):
        blend_spec(DataConfig(source="indexed", paths=["a"], blend=[[1, "b"]]))
    assert blend_spec(DataConfig(source="indexed", paths=["0.5", "a", "0.5", "b"])) == [(0.5, "a"), (0.5, "b")]
    with pytest.raises(ValueError, match="data.blend"):
        blend_spec(DataConfig(source="indexed", paths=["a", "b"]))


def test_blend_from_yaml_and_the_hydra_cli():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        nested = compose("config", overrides=["data=indexed", "data.blend=[[0.3,/data/a_text_document],"
                                              "[0.7,/data/b_text_document]]"])
        flat = compose("config", overrides=["data=indexed", "data.blend=[0.3,/data/a_text_document,"
                                            "0.7,/data/b_text_document]"])
        quoted = compose("config", overrides=["data=indexed", "data.blend=['0.3','/data/a','0.7','/data/b']"])
    want = [(0.3, "/data/a_text_document"), (0.7, "/data/b_text_document")]
    for dcfg in (nested, flat):
        cfg = OmegaConf.to_object(dcfg)
        assert parse_blend(cfg.data.blend) == want
        assert parse_blend(dcfg.data.blend) == want  # also straight from the DictConfig
    assert parse_blend(OmegaConf.to_object(quoted).data.blend) == [(0.3, "/data/a"), (0.7, "/data/b")]
    yaml = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.create(
        "blend:\n  - [0.3, /data/a]\n  - [0.7, /data/b]\n"))
    assert parse_blend(OmegaConf.to_object(yaml).blend) == [(0.3, "/data/a"), (0.7, "/data/b")]


# ---------------------------------------------------------------- build_data over real files

@pytest.fixture
def two_corpora(tmp_path):
    rng = np.random.default_rng(6)
    a = write(tmp_path / "a_text_document", [[7] * int(n) + [EOD] for n in rng.integers(5, 40, 300)])
    b = write(tmp_path / "b_text_document", [[8] * int(n) + [EOD] for n in rng.integers(5, 40, 300)])
    return a, b


def test_build_data_blends_with_megatron_sizes(tmp_path, two_corpora):
    a, b = two_corpora
    cfg = DataConfig(source="indexed", blend=[[0.3, a.prefix], [0.7, b.prefix]], split="90,10,0",
                     cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(type="null", vocab_size=1000))
    wanted = num_samples_for(max_steps=50, global_batch_size=8, eval_interval=25, eval_steps=2)
    assert wanted == {"train": 400, "valid": 3 * 2 * 8, "test": 16}
    data = build_data(cfg, seq_length=16, seed=3, num_samples=wanted)
    assert data.test is None and isinstance(data.train, BlendedDataset)
    # megatron-core's blend holds sum(ceil(w * N)) samples: 120 + 280 = 400 and 15 + 34 = 49 (> 48)
    assert len(data.train) == 400 and len(data.valid) == 49
    parts = data.train.datasets
    assert [p.num_samples for p in parts] == [math.ceil(0.3 * 400 * 1.005), math.ceil(0.7 * 400 * 1.005)]
    assert all(len(p) >= p.num_samples for p in parts)
    from_a = np.array([7 in data.train[i] for i in range(400)])
    # every sample comes whole from one dataset: its tokens are all 7/eod or all 8/eod
    for i in range(400):
        assert set(data.train[i].tolist()) <= ({7, EOD} if data.train.dataset_index[i] == 0 else {8, EOD})
    counts = np.cumsum(np.asarray(data.train.dataset_index) == 0)
    assert np.max(np.abs(counts - 0.3 * np.arange(1, 401))) < 1.0
    assert from_a.sum() == counts[-1]
    # The same call again loads every index from the cache.
    again = build_data(cfg, seq_length=16, seed=3, num_samples=wanted)
    assert not again.train.built_anew and not any(p.built_anew for p in again.train.datasets)
    assert all(np.array_equal(again.train[i], data.train[i]) for i in range(0, 400, 37))


def test_loader_refuses_samples_that_were_not_built(tmp_path, two_corpora):
    a, _ = two_corpora
    cfg = DataConfig(source="indexed", paths=[a.prefix], split="90,10,0", cache_dir=str(tmp_path / "cache"),
                     tokenizer=TokenizerConfig(type="null", vocab_size=1000))
    data = build_data(cfg, seq_length=16, seed=3)  # no num_samples: one epoch
    n = len(data.train)
    loader = MicroBatchLoader(data.train, micro_batch_size=4, global_batch_size=8, consumed_samples=(n // 8) * 8)
    with pytest.raises(DataExhaustedError, match=rf"train dataset was built for {n} samples, but the global "
                                                 rf"batch at consumed_samples={(n // 8) * 8} needs"):
        loader.next_batch()
    bigger = build_data(cfg, seq_length=16, seed=3, num_samples={"train": 3 * n})
    assert len(bigger.train) >= 3 * n and bigger.train.num_epochs >= 3


def test_resume_mid_epoch_and_dp_sharding_on_a_real_blend(tmp_path, two_corpora):
    a, b = two_corpora
    cfg = DataConfig(source="indexed", blend=[0.5, a.prefix, 0.5, b.prefix], split="90,10,0",
                     cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(type="null", vocab_size=1000))
    data = build_data(cfg, seq_length=8, seed=4, num_samples={"train": 96})
    kw = dict(micro_batch_size=2, global_batch_size=8)
    for dp in (1, 2, 4):
        straight = [MicroBatchLoader(data.train, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
        steps = [[l.next_batch() for _ in range(12)] for l in straight]
        # every global batch is split disjointly and completely over the ranks
        for step in range(12):
            rows = [tuple(row.tolist()) for r in range(dp) for mb in steps[r][step] for row in mb]
            want = [tuple(data.train[i].tolist()) for i in range(step * 8, step * 8 + 8)]
            assert sorted(rows) == sorted(want) and len(rows) == 8
        # stopping after 5 steps (mid-epoch) and resuming from consumed_samples repeats and drops nothing
        resumed = [MicroBatchLoader(data.train, dp_rank=r, dp_size=dp, consumed_samples=5 * 8, **kw)
                   for r in range(dp)]
        for r in range(dp):
            for step in range(5, 12):
                got = resumed[r].next_batch()
                assert all(torch.equal(x, y) for x, y in zip(got, steps[r][step]))
    with pytest.raises(DataExhaustedError):
        MicroBatchLoader(data.train, consumed_samples=96, **kw).next_batch()


def test_eod_loss_mask_follows_megatron(tmp_path):
    batch = torch.tensor([[5, EOD, 6, 7, EOD], [EOD, 1, 2, 3, 4]])
    mask = eod_loss_mask(batch, EOD)
    # positions whose *input* is eod (predicting the next document's first token) are masked
    assert mask.tolist() == [[1, 0, 1, 1], [0, 1, 1, 1]] and mask.dtype == torch.float32
    assert eod_loss_mask(batch.numpy(), EOD).tolist() == mask.tolist()
    cfg = DataConfig(source="mock", eod_mask_loss=True, tokenizer=TokenizerConfig(type="null", vocab_size=1000))
    data = build_data(cfg, seq_length=4, seed=0)
    assert data.loss_mask(batch).tolist() == mask.tolist()
    cfg.eod_mask_loss = False
    assert build_data(cfg, seq_length=4, seed=0).loss_mask(batch) is None


# ---------------------------------------------------------------- bad input

def test_bad_inputs_name_the_file_and_the_numbers(tmp_path):
    base = dict(source="indexed", cache_dir=str(tmp_path / "cache"), split="90,10,0",
                tokenizer=TokenizerConfig(type="null", vocab_size=100))
    with pytest.raises(FileNotFoundError, match=r"missing\.idx does not exist"):
        build_data(DataConfig(paths=[str(tmp_path / "missing")], **base), seq_length=8, seed=0)
    big = write(tmp_path / "big", [[1, 2, 3]] * 50 + [[1, 250, 3]] + [[1, 2]] * 10)
    with pytest.raises(ValueError, match=r"big\.bin: token id 250 at token 151 \(document 50, 1 tokens in\) is "
                                         r"outside the tokenizer's vocabulary of 100 ids \(the file holds ids 1..250\)"):
        build_data(DataConfig(paths=[big.prefix], **base), seq_length=8, seed=0)
    small = write(tmp_path / "small", [[1, 2, 3, 4], [5, 6]] * 5)
    with pytest.raises(ValueError, match=r"valid split has 2 tokens in 1 documents \(documents 9..10 of .*small\), "
                                         r"but one sample needs seq_length \+ 1 = 9"):
        build_data(DataConfig(paths=[small.prefix], **base), seq_length=8, seed=0)
    with pytest.raises(ValueError, match=r"weight -1.0 of .*small is negative"):
        build_data(DataConfig(blend=[[1, small.prefix], [-1, small.prefix]], **base), seq_length=2, seed=0)
    with pytest.raises(ValueError, match="all weights are zero"):
        build_data(DataConfig(blend=[[0, small.prefix], [0, small.prefix]], **base), seq_length=2, seed=0)
    # the vocabulary scan is cached by the files' identity
    ranges = list((tmp_path / "cache" / "token_ranges").glob("*.json"))
    assert ranges and all(json.loads(p.read_text())["range"] for p in ranges)


def test_empty_documents_are_readable_and_skipped_by_samples(tmp_path):
    ds = write(tmp_path / "e", [[], [1, 2, 3, EOD], [], [], [4, 5, EOD], []])
    assert ds.num_documents == 6 and ds.document_lengths().tolist() == [0, 4, 0, 0, 3, 0]
    gpt = GPTDataset(ds, range(0, 6), seq_length=2, seed=0)
    stream = [t for d in np.asarray(gpt.document_index) for t in ds.get_document(int(d)).tolist()]
    assert sorted(gpt[i].tolist() for i in range(len(gpt))) == sorted(
        stream[k * 2:k * 2 + 3] for k in range((len(stream) - 1) // 2))
