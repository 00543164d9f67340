"""megalm's data pipeline against megatron-core 0.16.1's, side by side on the same files.

megatron-core (a dev dependency; its data code and prebuilt helpers run on CPU) builds the
reference through its own BlendedMegatronDatasetBuilder over the .bin/.idx files megalm writes:
the split bookends, the per-dataset sizes of a blend (ceil(ceil(w * N) * 1.005), a blend of
sum(ceil(w * N)) samples) and every GPT sample must be the same, also on a sentence-split file,
which megatron-core splits and samples per sentence for GPT.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalm.config import DataConfig, TokenizerConfig
from megalm.data import IndexedDatasetWriter, build_data
from megalm.data.samples.blended import blend_size, per_dataset_samples
from megalm.data.loader import split_documents

EOD = 999


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    """megatron-core's builders ask torch.distributed for the rank; this process is rank 0 of 1."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)


def _split_matrix(split: str):
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


@pytest.mark.parametrize("split", ["949,50,1", "98,2,0", "1,1,1", "4,2,1", "90,10", "0.7,0.2,0.1", "3,3,4"])
def test_split_bookends_equal_megatron_core(split):
    for n in [1, 2, 3, 7, 10, 99, 100, 101, 1000, 1010, 1011, 4567, 100_003]:
        ours = split_documents(n, split)
        for part, bookend in zip(ours, _split_matrix(split)):
            if bookend is None:  # megatron-core builds no dataset for a zero weight; megalm an empty range
                assert len(part) == 0
            else:
                assert part == range(int(round(bookend[0] * float(n))), int(round(bookend[1] * float(n)))), (n, split)
        assert ours[0].start == 0 and ours[2].stop == n and ours[0].stop == ours[1].start and \
            ours[1].stop == ours[2].start
    # The example the two rules disagree on: older Megatron-LM gave train [0, 959).
    assert split_documents(1010, "949,50,1")[0] == range(0, 958)


def test_blend_sizes_equal_megatron_core():
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.utils import normalize
    rng = np.random.default_rng(0)
    cases = [([0.3, 0.7], 1001), ([1, 3], 400), ([0.2, 0.3, 0.5], 7)]
    cases += [(rng.random(int(rng.integers(2, 6))).tolist(), int(rng.integers(1, 100_000))) for _ in range(200)]
    for weights, n in cases:
        target = [row[0] for row in _get_size_per_split_per_dataset(normalize(weights), [n, 0, 0])]
        built = [row[0] for row in _get_size_per_split_per_dataset(normalize(weights), [n, 0, 0], surplus=0.005)]
        assert per_dataset_samples(weights, n) == built and blend_size(weights, n) == sum(target), (weights, n)
    assert per_dataset_samples([0.3, 0.7], 1001) == [303, 705] and blend_size([0.3, 0.7], 1001) == 1002


def _write(prefix, docs):
    """docs: lists of sentences (lists of ids); one sequence per sentence."""
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in docs:
            w.add_documents(np.concatenate(doc), [len(s) for s in doc], sequences_per_document=[len(doc)])
    return str(prefix)


def _corpus(rng, num_docs, token, sentences):
    """Documents of `sentences` (a range) sentences of `token`-ish ids, each ending in EOD;
    single-sentence documents are longer, so the one-document test split still holds a sample."""
    lengths = (3, 30) if sentences[1] > 2 else (20, 60)
    docs = []
    for _ in range(num_docs):
        doc = [np.full(int(rng.integers(*lengths)), token + int(rng.integers(0, 5)), dtype=np.int64)
               for _ in range(int(rng.integers(*sentences)))]
        doc[-1] = np.append(doc[-1], EOD)
        docs.append(doc)
    return docs


def _megatron_gpt(blend, split, sizes, seq_length, seed, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    tokenizer = SimpleNamespace(eod=EOD, pad=-1, vocab_size=1000, unique_identifiers={"class": "test"})
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
                              path_to_cache=str(cache), tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _megatron_text(dataset, i):
    sample = dataset[i]
    return torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()


@pytest.mark.parametrize("sentences", [(1, 2), (1, 6)], ids=["documents", "sentence-split"])
def test_gpt_samples_equal_megatron_core(tmp_path, sentences):
    """A weighted blend of two corpora at N=1001 (where the two size rules differ) with split
    949,50,1: the blend's length and every train and valid sample equal megatron-core's. With
    several sentences per document, both split and sample per sentence."""
    rng = np.random.default_rng(len(sentences) + sentences[1])
    a = _write(tmp_path / "a", _corpus(rng, 1010, 10, sentences))
    b = _write(tmp_path / "b", _corpus(rng, 700, 20, sentences))
    seq_length, seed, sizes = 16, 1234, [1001, 60, 3]
    train, valid, test = _megatron_gpt(([a, b], [0.3, 0.7]), "949,50,1", sizes, seq_length, seed, tmp_path / "mc")
    cfg = DataConfig(source="indexed", blend=[[0.3, a], [0.7, b]], split="949,50,1",
                     cache_dir=str(tmp_path / "ours"), tokenizer=TokenizerConfig(type="null", vocab_size=1000))
    ours = build_data(cfg, seq_length=seq_length, seed=seed,
                      num_samples=dict(zip(("train", "valid", "test"), sizes)))
    assert len(ours.train) == len(train) == 1002  # sum(ceil(w * N)): 301 + 701
    assert [p.num_samples for p in ours.train.datasets] == [303, 705]
    assert [p.documents for p in ours.train.datasets] == \
        [range(0, int(round(0.949 * n))) for n in (len(ds.dataset) for ds in train.datasets)]
    for mine, theirs in ((ours.train, train), (ours.valid, valid), (ours.test, test)):
        assert len(mine) == len(theirs)
        for i in range(len(theirs)):
            assert mine[i].tolist() == _megatron_text(theirs, i), (theirs.index_split, i)
