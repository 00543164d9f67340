"""BERT on real sentence-split corpora: megalm's samples equal megatron-core's, file to sample.

The corpus is real English (docstrings of the Python standard library), tokenized by a real
WordPiece tokenizer.json trained here with the `tokenizers` package, split into sentences and
written by `preprocess --split-sentences`. megatron-core 0.16.1's BlendedMegatronDatasetBuilder
builds BERTMaskedWordPieceDataset over the same files (its compiled build_mapping, its masking);
megalm's build_data with BERT's samples must give the same splits, sample counts and every field
of every sample: split bookends per document, the sample index, segments, whole-word masking.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalm.config import DataConfig, TokenizerConfig
from megalm.data import IndexedDataset, build_data, build_tokenizer
from megalm.data.preprocessing import pipeline as pp
from megalm.data.samples.bert import BertDataset, BertSamples
from megalm.data.tokenizers.specials import bert_specials
from megalm.data.samples.masking import continuing_pieces
from megalm.data.corpora.stdlib import StdlibDocstrings, stdlib_corpus
from megalm.errors import DataError
from megalm.ops.losses import IGNORE

SEQ = 64


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    """megatron-core's dataset builders ask torch.distributed for the rank; this process is rank 0 of 1."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(sentence-split prefix, tokenizer.json folder): about 0.4 MB of docstrings as JSON lines."""
    from tokenizers.implementations import BertWordPieceTokenizer
    root = tmp_path_factory.mktemp("bert_corpus")
    texts = list(StdlibDocstrings(stdlib_corpus(max_corpus_mb=4)).texts())
    assert len(texts) > 100
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=3000, min_frequency=2)
    (root / "tok").mkdir()
    wordpiece.save(str(root / "tok" / "tokenizer.json"))
    tok_cfg = TokenizerConfig(type="huggingface", model=str(root / "tok"))
    pp.preprocess([str(root / "docs.jsonl")], str(root / "docs"), tokenizer=tok_cfg, split_sentences=True,
                  workers=2)
    return root / "docs_text_sentence", tok_cfg


def _megatron_bert(prefix, tokenizer, split, sizes, seed, binary_head, cache):
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    s = bert_specials(tokenizer)
    pieces = tokenizer.pieces()
    mc_tok = SimpleNamespace(cls=s.cls, sep=s.sep, mask=s.mask, pad=s.pad, vocab_size=tokenizer.vocab_size,
                             inv_vocab=dict(enumerate(pieces)), unique_identifiers={"class": "wordpiece"})
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=SEQ, blend=([str(prefix)], None), split=split, path_to_cache=str(cache),
        tokenizer=mc_tok, masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=3,
        masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, classification_head=binary_head)
    return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, sizes, lambda: True, config).build()


def _assert_same_sample(ours, theirs, pad, where):
    n = int(ours["padding_mask"].sum())
    # megatron-core writes id 0 over [PAD] and counts any [PAD] id as padding (even one its 10%
    # random replacement drew); megalm's padding is the sample's length. [PAD] is id 0 here.
    assert pad == 0
    np.testing.assert_array_equal(ours["tokens"], theirs["text"], err_msg=where)
    np.testing.assert_array_equal(ours["token_types"], theirs["types"], err_msg=where)
    real = ours["tokens"] != pad
    np.testing.assert_array_equal(ours["padding_mask"][real], theirs["padding_mask"][real])
    assert (ours["padding_mask"][:n] == 1).all() and (ours["padding_mask"][n:] == 0).all()
    np.testing.assert_array_equal(ours["loss_mask"], theirs["loss_mask"], err_msg=where)
    masked = ours["loss_mask"] > 0
    np.testing.assert_array_equal(ours["labels"][masked], theirs["labels"][masked], err_msg=where)
    assert (ours["labels"][~masked] == IGNORE).all()
    assert int(ours["is_random"]) == theirs["is_random"]


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_samples_equal_megatron_core(corpus, tmp_path, binary_head):
    prefix, tok_cfg = corpus
    tokenizer = build_tokenizer(tok_cfg)
    indexed = IndexedDataset(prefix)
    assert len(indexed) > 3 * indexed.num_documents  # really sentence-split
    assert continuing_pieces(tokenizer) is not None  # "##" pieces: whole-word masking is exercised
    seed, sizes, split = 1234, [900, 40, 8], "90,8,2"
    train, valid, test = _megatron_bert(prefix, tokenizer, split, sizes, seed, binary_head, tmp_path / "mc")
    cfg = DataConfig(source="indexed", paths=[str(prefix)], split=split, cache_dir=str(tmp_path / "ours"),
                     tokenizer=tok_cfg)
    data = build_data(cfg, seq_length=SEQ, seed=seed, num_samples=dict(zip(("train", "valid", "test"), sizes)),
                      samples=BertSamples(SimpleNamespace(binary_head=binary_head)))
    pad = bert_specials(tokenizer).pad
    for ours, theirs in ((data.train, train), (data.valid, valid), (data.test, test)):
        assert isinstance(ours, BertDataset)
        assert ours.documents == range(int(theirs.indices[0]), int(theirs.indices[-1]) + 1)  # split per document
        np.testing.assert_array_equal(ours.sample_index, np.asarray(theirs.sample_index))
        assert len(ours) == len(theirs) >= sizes[["train", "valid", "test"].index(ours.name)]
        for i in range(len(theirs)):
            _assert_same_sample(ours[i], theirs[i], pad, f"{ours.name} sample {i}")
    # What the test exercised: trimmed samples, swapped segments, [MASK] and random replacements.
    first = [data.train[i] for i in range(200)]
    assert any(s["padding_mask"].sum() >= SEQ - 1 for s in first)  # samples trimmed to the target length
    assert any(s["is_random"] for s in first) == binary_head
    mask_id = bert_specials(tokenizer).mask
    assert sum(int((s["tokens"] == mask_id).sum()) for s in first) > 100


def test_bert_dataset_needs_bert_tokens_and_sentences(corpus, tmp_path):
    prefix, _ = corpus
    plain = build_tokenizer(TokenizerConfig(type="null", vocab_size=4000))
    indexed = IndexedDataset(prefix)
    ok = BertDataset(indexed, range(0, 5), SEQ, 1, num_samples=None, tokenizer=plain)  # null ids: fixed specials
    assert len(ok) > 0
    with pytest.raises(DataError, match=r"documents range\(0, \d+\) are not a contiguous range within the \d+ "):
        BertDataset(indexed, range(0, indexed.num_documents + 1), SEQ, 1, tokenizer=plain)
    # A file of one sequence per document cannot give two-sentence samples: the error says why.
    from megalm.data import IndexedDatasetWriter
    with IndexedDatasetWriter(tmp_path / "docs") as w:
        for k in range(20):
            w.add_document(list(range(10, 30 + k)))
    with pytest.raises(DataError, match="20 have fewer than min_sentences=2 sentences"):
        BertDataset(IndexedDataset(tmp_path / "docs"), range(0, 20), SEQ, 1, num_samples=10, tokenizer=plain)


# ---------------------------------------------------------------- special tokens

def test_sentencepiece_special_tokens_are_reserved_and_found(tmp_path):
    from megalm.data.tokenizers.specials import BERT_SPECIAL_TOKENS
    from megalm.data.train_tokenizer import main as train_tokenizer_main
    texts = list(StdlibDocstrings(stdlib_corpus(max_corpus_mb=1)).texts())
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert train_tokenizer_main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "bert"),
                                 "--vocab-size", "800", "--special-tokens", *BERT_SPECIAL_TOKENS]) == 0
    assert train_tokenizer_main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "plain"),
                                 "--vocab-size", "800"]) == 0
    tok = build_tokenizer(TokenizerConfig(model=str(tmp_path / "bert" / "tokenizer.model")))
    s = bert_specials(tok)
    assert [tok.pieces()[i] for i in (s.cls, s.sep, s.mask, s.pad)] == BERT_SPECIAL_TOKENS
    assert len({s.cls, s.sep, s.mask, s.pad, tok.eod}) == 5
    # text never becomes a special id: a literal "[MASK]" in a document stays text
    assert s.mask not in tok.encode("fill the [MASK] here [CLS]") and tok.token_to_id("[NOPE]") is None
    plain = build_tokenizer(TokenizerConfig(model=str(tmp_path / "plain" / "tokenizer.model")))
    with pytest.raises(DataError, match=r"lacks \[CLS\], \[SEP\], \[MASK\], \[PAD\] .*--special-tokens "
                                        r"\[CLS\] \[SEP\] \[MASK\] \[PAD\]"):
        bert_specials(plain)


def test_wordpiece_tokenizer_json_gives_bert_tokens_and_word_pieces(corpus):
    _, tok_cfg = corpus
    tok = build_tokenizer(tok_cfg)
    s = bert_specials(tok)
    assert [tok.pieces()[i] for i in (s.cls, s.sep, s.mask, s.pad)] == ["[CLS]", "[SEP]", "[MASK]", "[PAD]"]
    assert tok.eod == s.sep  # a WordPiece vocabulary has no end-of-text token: [SEP] ends a document
    marks = continuing_pieces(tok)
    ids = tok.encode("tokenization unbelievably")
    assert marks[ids].tolist() == [tok.pieces()[i].startswith("##") for i in ids] and marks[ids].any()


# ---------------------------------------------------------------- the embedded prose corpus

def test_stdlib_docstrings_are_prose_in_source_order():
    from megalm.data.corpora.stdlib import docstrings
    source = ('"""Module."""\nif True:\n    def f():\n        """F.\n\n        Indented more."""\n'
              'class A:\n    """A."""\n    async def g(self):\n        """G."""\n    x = """not a docstring"""\n')
    assert docstrings(source) == ["Module.", "F.\n\nIndented more.", "A.", "G."]
    assert docstrings("def broken(:\n") == [] and docstrings("x = 1\n") == []
    corpus = StdlibDocstrings(stdlib_corpus(max_corpus_mb=1))
    texts = list(corpus.texts())
    assert 0 < len(texts) <= len(corpus) and all(t.strip() for t in texts)
    assert corpus.fingerprint() != stdlib_corpus(max_corpus_mb=1).fingerprint()


def test_bert_trains_on_the_stdlib_prose(tmp_path):
    """model=bert_tiny data=stdlib_prose through megalm.train: the tokenizer is trained with BERT's
    tokens, the docstrings are split into sentences, and the MLM loss falls."""
    from configs import load
    from megalm.train import run
    from megalm.validation import validate
    over = ["model=bert_tiny", "model.vocab_size=1024", "data=stdlib_prose", "data.max_corpus_mb=1",
            "data.tokenizer.vocab_size=1000", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=40",
            "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "trainer.eval_interval=0",
            "trainer.eval_steps=2", "trainer.log_interval=1", "trainer.progress_bar=false", "optimizer.lr=3e-3",
            "optimizer.warmup_steps=2", "cluster.peak_flops=1e12", "checkpoint.save=false", "trainer.num_threads=1"]
    cfg = load(*over)
    validate(cfg, 1)
    run(cfg, tmp_path / "run", 1)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lm = [r["lm_loss"] for r in recs if "lm_loss" in r]
    val = [r["val_lm_loss"] for r in recs if "val_lm_loss" in r]
    assert len(lm) == 40 and len(val) == 2
    assert np.mean(lm[-5:]) < np.mean(lm[:5]) - 0.5 and val[-1] < val[0]
    (stats,) = (tmp_path / "cache" / "corpora").glob("*/stats.json")
    counts = json.loads(stats.read_text())
    assert counts["sentences"] > 3 * counts["documents"] > 0


def test_bert_refuses_the_code_corpus_and_seed_zero():
    from configs import load
    from megalm.errors import ConfigError
    from megalm.validation import validate
    with pytest.raises(ConfigError, match=r"data.source=stdlib is Python code.*use data=stdlib_prose"):
        validate(load("model=bert_tiny", "data=stdlib"), 1)
    with pytest.raises(ConfigError, match=r"trainer.seed=0: BERT's sample index .* \[1, 2\*\*31\)"):
        validate(load("model=bert_tiny", "data=stdlib_prose", "trainer.seed=0"), 1)
    validate(load("model=bert_tiny", "data=mock", "trainer.seed=0"), 1)  # mock samples take any seed


def test_a_given_tokenizer_must_hold_the_special_tokens_the_config_names(corpus):
    _, tok_cfg = corpus
    ok = TokenizerConfig(type="huggingface", model=tok_cfg.model, special_tokens=["[CLS]", "[MASK]"])
    assert build_tokenizer(ok).token_to_id("[MASK]") is not None
    bad = TokenizerConfig(type="huggingface", model=tok_cfg.model, special_tokens=["[CLS]", "<extra_id_0>"])
    with pytest.raises(DataError, match=r"names <extra_id_0>, which .*tokenizer.json does not have.*"
                                        r"special_tokens=\[\]"):
        build_tokenizer(bad)
