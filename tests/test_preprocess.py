"""Preprocessing raw text into .bin/.idx, merging, tokenizers (sentencepiece, HF tokenizer.json, null)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megalm.config import DataConfig, TokenizerConfig
from megalm.data import (HuggingFaceTokenizer, IndexedDataset, build_data, build_tokenizer, load_tokenizer,
                         padded_vocab_size, stdlib_corpus)
from megalm.data.preprocessing import pipeline as pp
from megalm.data.provenance import (check_corpus_tokenizer, describe, read_provenance, sidecar_path,
                                   tokenizer_record)
from megalm.data.corpora.sentences import split_sentences
from megalm.data.tokenizers.training import train as train_tokenizer
from megalm.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
NASTY = ("def f(x):\n\tif x:\n\t\treturn  x   \n\n\n    # trailing   \r\n"
         "s = 'héllo wörld ☃ 日本語 \U0001F600 \u2581 a\u2581\u2581b \u00a0\u3000 e\u0301'\n"
         "\x00\x01\x7f\ufeff   \t \t\n")


@pytest.fixture(scope="module")
def texts():
    corpus = stdlib_corpus()
    files = [f for f in corpus.files if 500 < f[1] < 6_000][:120]
    out = list(type(corpus)(corpus.root, files).texts())
    out[3] = ""  # an empty document, skipped
    out[10] = NASTY
    out[20] = ""
    return out


@pytest.fixture(scope="module")
def jsonl(texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    with open(path, "w") as f:
        for k, t in enumerate(texts):
            f.write(json.dumps({"id": k, "text": t, "title": f"document {k}"}) + "\n")
            if k == 5:
                f.write("\n")  # blank lines are not documents
    return path


@pytest.fixture(scope="module")
def sp_dir(jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(jsonl)], str(out), vocab_size=500)
    return out


@pytest.fixture(scope="module")
def sp_cfg(sp_dir):
    return TokenizerConfig(type="sentencepiece", model=str(sp_dir / "tokenizer.model"))


def files_of(prefix):
    return [Path(str(prefix) + s).read_bytes() for s in (".bin", ".idx")]


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def error_line(stderr: str) -> str:
    """The one line stderr holds besides log records: the error, with no traceback around it."""
    lines = [line for line in stderr.splitlines() if not re.match(r"\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) ", line)]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------- preprocessing

def test_round_trip_and_workers_give_identical_bytes(jsonl, texts, sp_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megalm.data.preprocess")
    one = pp.preprocess([str(jsonl)], str(tmp_path / "w1"), tokenizer=sp_cfg, append_eod=True, workers=1,
                        chunk_mb=0.02)
    two = pp.preprocess([str(jsonl)], str(tmp_path / "w2"), tokenizer=sp_cfg, append_eod=True, workers=2,
                        chunk_mb=0.02)
    assert files_of(tmp_path / "w1_text_document") == files_of(tmp_path / "w2_text_document")
    assert one.documents == two.documents == len(texts) and one.bytes == two.bytes == jsonl.stat().st_size - 1
    assert one.skipped_empty == {"text": 2} and one.written == {"text": len(texts) - 2}
    assert "skipped 2 empty document(s) in 'text'" in caplog.text
    assert "docs/s" in caplog.text and "MB/s" in caplog.text
    tok = build_tokenizer(sp_cfg)
    ds = IndexedDataset(tmp_path / "w1_text_document")
    kept = [t for t in texts if t]
    assert ds.num_documents == len(kept) and ds.dtype == np.uint16
    for d, text in enumerate(kept):
        ids = ds.get_document(d).tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text
    assert one.tokens["text"] == ds.num_tokens


def test_several_keys_give_one_output_each(jsonl, texts, tmp_path):
    tok_dir = tmp_path / "tok"
    train_tokenizer([str(jsonl)], str(tok_dir), vocab_size=400, json_keys=["title"])
    cfg = TokenizerConfig(model=str(tok_dir / "tokenizer.model"))
    stats = pp.preprocess([str(jsonl)], str(tmp_path / "out"), json_keys=["text", "title"], tokenizer=cfg)
    assert stats.outputs == {"text": f"{tmp_path}/out_text_document", "title": f"{tmp_path}/out_title_document"}
    titles = IndexedDataset(tmp_path / "out_title_document")
    tok = build_tokenizer(cfg)
    assert [tok.decode(titles.get_document(d)) for d in range(titles.num_documents)] == \
        [f"document {k}" for k in range(len(texts))]
    assert IndexedDataset(tmp_path / "out_text_document").num_documents == len(texts) - 2


@pytest.mark.parametrize("mode", ["paragraph", "line", "file"])
def test_plain_text_documents(tmp_path, sp_cfg, mode):
    a = tmp_path / "a.txt"
    a.write_text("first paragraph\nstill first\n\n\nsecond ☃\n\nthird\n")
    b = tmp_path / "b.txt"
    b.write_text("only one line")
    stats = pp.preprocess([str(tmp_path / "*.txt")], str(tmp_path / "t"), tokenizer=sp_cfg, text_document=mode)
    want = {"paragraph": ["first paragraph\nstill first", "second ☃", "third", "only one line"],
            "line": ["first paragraph", "still first", "second ☃", "third", "only one line"],
            "file": [a.read_text(), b.read_text()]}[mode]
    ds, tok = IndexedDataset(tmp_path / "t_text_document"), build_tokenizer(sp_cfg)
    assert [tok.decode(ds.get_document(d)) for d in range(ds.num_documents)] == want
    assert stats.skipped_empty["text"] == (3 if mode == "line" else 0)  # the blank lines


def test_merge_equals_preprocessing_the_concatenation(jsonl, sp_cfg, tmp_path):
    lines = jsonl.read_text().splitlines(keepends=True)
    (tmp_path / "part1.jsonl").write_text("".join(lines[:50]))
    (tmp_path / "part2.jsonl").write_text("".join(lines[50:]))
    for k in (1, 2):
        pp.preprocess([str(tmp_path / f"part{k}.jsonl")], str(tmp_path / f"p{k}"), tokenizer=sp_cfg, append_eod=True)
    pp.preprocess([str(tmp_path / "part*.jsonl")], str(tmp_path / "whole"), tokenizer=sp_cfg, append_eod=True)
    merged = pp.merge([str(tmp_path / "p*_text_document")], str(tmp_path / "merged_text_document"))
    assert files_of(tmp_path / "merged_text_document") == files_of(tmp_path / "whole_text_document")
    assert merged.num_documents == IndexedDataset(tmp_path / "p1_text_document").num_documents + \
        IndexedDataset(tmp_path / "p2_text_document").num_documents
    assert oct(os.stat(tmp_path / "merged_text_document.idx").st_mode & 0o777) != oct(0o600)
    int32 = tmp_path / "wide"
    from megalm.data import IndexedDatasetWriter
    with IndexedDatasetWriter(int32, np.int32) as w:
        w.add_document([1, 2])
    with pytest.raises(ValueError, match=r"different token dtypes: .*p1_text_document \(uint16\), .*wide \(int32\)"):
        pp.merge([str(tmp_path / "p1_text_document"), str(int32)], str(tmp_path / "bad"))
    assert not (tmp_path / "bad.idx").exists()


def test_bad_input_names_the_file_and_line(tmp_path, sp_cfg):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    with pytest.raises(pp.PreprocessError, match=r"bad\.jsonl:3: not a JSON line"):
        pp.preprocess([str(bad)], str(tmp_path / "o"), tokenizer=sp_cfg)
    bad.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(pp.PreprocessError, match=r"bad\.jsonl:2: no key 'text' \(it has 'body'\)"):
        pp.preprocess([str(bad)], str(tmp_path / "o"), tokenizer=sp_cfg)
    bad.write_text('{"text": "1 2 3"}\n{"text": "4 70000 5"}\n')
    with pytest.raises(pp.PreprocessError, match=r"bad\.jsonl:2: token id 70000 in 'text' is outside the "
                                                 r"vocabulary of 1000 ids"):
        pp.preprocess([str(bad)], str(tmp_path / "o"), tokenizer=TokenizerConfig(type="null", vocab_size=1000))
    bad.write_text('{"text": "1 2 3"}\n{"text": "4 five"}\n')
    with pytest.raises(pp.PreprocessError, match=r"bad\.jsonl:2: 'text': the null tokenizer reads space-separated"):
        pp.preprocess([str(bad)], str(tmp_path / "o"), tokenizer=TokenizerConfig(type="null", vocab_size=1000),
                      workers=2)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        pp.preprocess([str(tmp_path / "nothing*.jsonl")], str(tmp_path / "o"), tokenizer=sp_cfg)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl does not exist"):
        pp.preprocess([str(tmp_path / "missing.jsonl")], str(tmp_path / "o"), tokenizer=sp_cfg)
    # nothing was left behind, not even temporaries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_interrupted_preprocessing_leaves_nothing(jsonl, sp_cfg, tmp_path, monkeypatch):
    real, calls = pp.encode_chunk, []

    def dying(chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("Ctrl-C")
        return real(chunk)

    monkeypatch.setattr(pp, "encode_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess([str(jsonl)], str(tmp_path / "o"), tokenizer=sp_cfg, chunk_mb=0.02)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moment", ["as the workers start", "with chunks in flight"])
def test_killed_cli_leaves_no_complete_looking_output(tmp_path, sp_dir, moment):
    """SIGTERM as soon as the output's temporary appears (the workers are still starting: the case
    that hung multiprocessing.Pool), or to the whole process group once tokens are being written (a
    scheduler's stop: the workers die too). Either way the run stops with nothing finished-looking."""
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": ("def spam(eggs):\n    return eggs * 2  # ham\n" * 40)}) + "\n"
    big.write_text(line * 20000)  # ~35 MB: seconds of work; it is stopped long before the end
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), "--input", str(big),
                             "--output-prefix", str(out / "c"), "--tokenizer-model", str(sp_dir / "tokenizer.model"),
                             "--workers", "2", "--chunk-mb", "0.1"], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        started = (lambda: True) if moment == "as the workers start" else \
            (lambda: any(p.stat().st_size > 0 for p in out.glob(".c_text_document.bin.*")))
        deadline = time.monotonic() + 300  # generous: a loaded machine starts Python slowly
        while not (list(out.glob(".c_text_document.bin.*")) and started()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.005)
        if moment == "as the workers start":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # a hang: leave no processes behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert err.rstrip().splitlines()[-1] == "megalm.data.preprocess: interrupted; no output was written"
    assert list(out.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        IndexedDataset(out / "c_text_document")


def test_cli_entry_points_agree(jsonl, tmp_path):
    tok = tmp_path / "tok"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tokenizer.py"), "--input", str(jsonl),
                        "--vocab-size", "450", "--output", str(tok)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["vocab_size"] == 450 and (tok / "tokenizer.model").is_file()
    common = ["--input", str(jsonl), "--json-keys", "text", "--append-eod", "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", str(tok / "tokenizer.model")]
    a = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), *common, "--output-prefix",
                        str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    b = subprocess.run([sys.executable, "-m", "megalm.data.preprocess", *common, "--workers", "2",
                        "--output-prefix", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    assert files_of(tmp_path / "a_text_document") == files_of(tmp_path / "b_text_document")
    m = subprocess.run([sys.executable, "-m", "megalm.data.preprocess", "--merge", str(tmp_path / "a_text_document"),
                        str(tmp_path / "b_text_document"), "--output-prefix", str(tmp_path / "ab")],
                       capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr[-2000:]
    assert IndexedDataset(tmp_path / "ab").num_documents == 2 * IndexedDataset(tmp_path / "a_text_document").num_documents
    e = subprocess.run([sys.executable, "-m", "megalm.data.preprocess", "--input", str(tmp_path / "none.jsonl"),
                        "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "null"],
                       capture_output=True, text=True, timeout=120)
    assert e.returncode == 1
    assert e.stderr.splitlines()[0] == \
        f"megalm.data.preprocess: not found: input file {tmp_path}/none.jsonl does not exist"


@pytest.mark.parametrize("inputs, extra, want", [
    pytest.param({}, [], "not found: input file {dir}/a.jsonl does not exist", id="a missing input"),
    pytest.param({"a.jsonl": '{"text": ""}\n'}, [],
                 "data: sentencepiece has nothing to train on: the corpus has no non-blank lines", id="no text"),
    pytest.param({"a.jsonl": '{"text": "some words"}\n'}, ["--type", "bytelevel-bpe", "--special-tokens", "[CLS]"],
                 "invalid config: --special-tokens [CLS] is for --type sentencepiece only", id="special tokens"),
    pytest.param({"a.jsonl": '{"text": "some words"}\n'}, ["--vocab-size", "0"],
                 "invalid config: --vocab-size 0 must be at least 1", id="no vocabulary"),
    pytest.param({"a.jsonl": '{"text": "' + "".join(map(chr, range(0x3b1, 0x3c9))) + ' abcdefghijklmnopqrstuvwxyz"}\n'},
                 ["--vocab-size", "20"], "invalid config: a 20-piece vocabulary is too small for this corpus: its "
                 "characters and special pieces alone need {need}; set the vocabulary size (data.tokenizer.vocab_size, "
                 "or train_tokenizer's --vocab-size) to at least {need}", id="too small a vocabulary"),
])
def test_train_tokenizer_user_errors_are_one_line_and_exit_1(tmp_path, inputs, extra, want):
    src, out = tmp_path / "in", tmp_path / "tok"
    src.mkdir()
    for name, text in inputs.items():
        (src / name).write_text(text)
    r = subprocess.run([sys.executable, "-m", "megalm.data.train_tokenizer", "--input", str(src / "a.jsonl"),
                        "--vocab-size", "300", "--output", str(out), *extra], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    line = error_line(r.stderr)
    need = re.search(r"alone need (\d+);", line)  # sentencepiece's count of the pieces the corpus needs
    assert line == "megalm.data.train_tokenizer: " + want.format(dir=src, need=need and need.group(1))
    assert not out.exists()


def test_train_tokenizer_refuses_an_output_that_is_a_file_before_training(jsonl, tmp_path):
    (tmp_path / "taken").write_text("a file")
    r = subprocess.run([sys.executable, "-m", "megalm.data.train_tokenizer", "--input", str(jsonl), "--vocab-size",
                        "300", "--output", str(tmp_path / "taken")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert error_line(r.stderr) == (f"megalm.data.train_tokenizer: invalid config: --output {tmp_path / 'taken'} is "
                                    "a file; name a folder to write the tokenizer into")
    assert "training" not in r.stderr  # refused before any training


EMPTY = '{"text": ""}\n\n{"text": ""}\n'  # two documents of nothing, and a blank line


@pytest.mark.parametrize("inputs, extra, want", [
    pytest.param({"a.jsonl": "", "b.jsonl": "\n\n"}, [],
                 "data: no documents to write to {out}/c_text_document: {dir}/a.jsonl, {dir}/b.jsonl: 0 records "
                 "read (blank lines are not documents); no output was written", id="no records"),
    pytest.param({"a.jsonl": EMPTY}, ["--workers", "2"],
                 "data: no documents to write to {out}/c_text_document: {dir}/a.jsonl: 2 record(s) read, all 2 "
                 "skipped as empty ('text' tokenizes to nothing); no output was written", id="only empty documents"),
    pytest.param({"a.jsonl": '{"text": "fine"}\n{"text": oops}\n'}, ["--workers", "2"],
                 "data: {dir}/a.jsonl:2: not a JSON line (Expecting value: line 1 column 10 (char 9))",
                 id="a bad JSON line"),
    pytest.param({}, [], "not found: input file {dir}/a.jsonl does not exist", id="a missing input"),
    pytest.param({"a.jsonl": EMPTY}, ["--merge", "x"], "invalid config: --merge and --input do not go together",
                 id="merge with input"),
])
def test_cli_user_errors_are_one_line_and_exit_1(tmp_path, sp_dir, inputs, extra, want):
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for name, text in inputs.items():
        (src / name).write_text(text)
    r = cli("--input", *(sorted(src / n for n in inputs) or [src / "a.jsonl"]), "--output-prefix", out / "c",
            "--tokenizer-model", sp_dir / "tokenizer.model", *extra)
    assert r.returncode == 1, r.stderr[-3000:]
    assert error_line(r.stderr) == "megalm.data.preprocess: " + want.format(out=out, dir=src)
    assert not out.exists() or list(out.iterdir()) == []  # nothing, not even an empty dataset


def test_outputs_record_their_tokenizer_and_merges_refuse_two_tokenizers(jsonl, sp_cfg, tmp_path):
    sp = build_tokenizer(sp_cfg)
    stats = pp.preprocess([str(jsonl)], str(tmp_path / "sp"), tokenizer=sp_cfg, append_eod=True)
    prefix = tmp_path / "sp_text_document"
    record, ds = read_provenance(prefix), IndexedDataset(prefix)
    assert record["tokenizer"]["identity"] == sp.identity and record["tokenizer"]["vocab_size"] == sp.vocab_size
    assert (record["documents"], record["tokens"]) == (ds.num_documents, ds.num_tokens) == \
        (stats.written["text"], stats.tokens["text"])
    check_corpus_tokenizer(prefix, sp)  # what training does with the record
    null_cfg = TokenizerConfig(type="null", vocab_size=sp.vocab_size)  # same size and dtype, other ids
    with pytest.raises(DataError, match=f"was tokenized with {sp.identity}"):
        check_corpus_tokenizer(prefix, build_tokenizer(null_cfg))
    # A merge of corpora from one tokenizer carries its record over.
    pp.merge([str(prefix), str(prefix)], str(tmp_path / "twice"))
    twice = read_provenance(tmp_path / "twice")
    assert twice["tokenizer"] == record["tokenizer"] and twice["documents"] == 2 * ds.num_documents
    # Two tokenizers: refused (a merge without a record would hide the mix from training).
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
    pp.preprocess([str(tmp_path / "ids.jsonl")], str(tmp_path / "null"), tokenizer=null_cfg)
    assert read_provenance(tmp_path / "null_text_document")["tokenizer"]["identity"] == f"null:{sp.vocab_size}"
    r = subprocess.run([sys.executable, "-m", "megalm.data.preprocess", "--merge", str(prefix),
                        str(tmp_path / "null_text_document"), "--output-prefix", str(tmp_path / "mixed")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert error_line(r.stderr) == ("megalm.data.preprocess: data: cannot merge corpora made by different tokenizers: "
                                    f"{prefix}: {describe(tokenizer_record(sp))}; {tmp_path}/null_text_document: "
                                    "null:500 (500 ids). Preprocess them again with one tokenizer")
    assert not list(tmp_path.glob("mixed*")) and not sidecar_path(tmp_path / "mixed").exists()


# ---------------------------------------------------------------- tokenizers

def test_padded_vocab_size_is_megatrons():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(32000, 128, 1) == 32000
    assert padded_vocab_size(32001, 128, 2) == 32256
    with pytest.raises(ValueError):
        padded_vocab_size(100, 0, 1)


def gpt2_style_json(texts, vocab_size=500) -> str:
    """A GPT-2 byte-level BPE tokenizer.json, trained here with the tokenizers trainer."""
    from megalm.data.tokenizers.training import train_bytelevel_bpe
    return train_bytelevel_bpe(iter(texts), vocab_size)


def llama_style_json(texts, vocab_size=600) -> str:
    """A Llama-2-style tokenizer.json: BPE with byte fallback, '▁' for spaces, <s> prepended."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    base.train_from_iterator([line for t in texts for line in t.split("\n")], trainer)
    spec = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok.to_str()


def test_hf_gpt2_tokenizer_json_round_trip(texts, tmp_path):
    path = tmp_path / "gpt2" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(gpt2_style_json(texts))
    tok = build_tokenizer(TokenizerConfig(type="huggingface", model=str(path)))
    assert isinstance(tok, HuggingFaceTokenizer) and tok.eod_token == "<|endoftext|>" and tok.vocab_size == 500
    for text in [NASTY, "", " leading", "\u2581", "x<|endoftext|>y"] + texts[:20]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode_batch(texts[:10]) == tok.encode_batch(texts[:10], num_threads=1) == \
        [tok.encode(t) for t in texts[:10]]
    back = load_tokenizer(tok.save_to(tmp_path / "saved"))
    assert (back.identity, back.eod, back.vocab_size) == (tok.identity, tok.eod, tok.vocab_size)
    assert load_tokenizer(path.parent).identity == tok.identity  # a bare tokenizer.json folder loads too
    with pytest.raises(ValueError, match=r"'<eot>' is not in its vocabulary"):
        HuggingFaceTokenizer(path, eod_token="<eot>")


def test_hf_llama_tokenizer_json(texts, tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(llama_style_json(texts))
    plain = HuggingFaceTokenizer(path)
    assert plain.eod_token == "</s>" and plain.eod == 2
    for text in ["Hello world\n  indented ☃ 日本", " lead", "", "tabs\tand\r\nnewlines"] + texts[:10]:
        assert plain.decode(plain.encode(text)) == text
    with_bos = HuggingFaceTokenizer(path, add_special_tokens=True)
    ids = with_bos.encode("hi there")
    assert ids[0] == 1 and ids[1:] == plain.encode("hi there") and with_bos.identity != plain.identity


def test_preprocess_and_train_with_a_hf_tokenizer(jsonl, texts, tmp_path):
    tok_dir = tmp_path / "hf"
    from megalm.data.tokenizers.training import train
    tok = train([str(jsonl)], str(tok_dir), vocab_size=700, kind="bytelevel-bpe")
    cfg = TokenizerConfig(type="huggingface", model=str(tok_dir))
    pp.preprocess([str(jsonl)], str(tmp_path / "hf"), tokenizer=cfg, append_eod=True, workers=2, chunk_mb=0.05)
    ds = IndexedDataset(tmp_path / "hf_text_document")
    kept = [t for t in texts if t]
    assert [tok.decode(ds.get_document(d)[:-1]) for d in range(ds.num_documents)] == kept
    data = build_data(DataConfig(source="indexed", paths=[str(tmp_path / "hf_text_document")], split="90,10,0",
                                 cache_dir=str(tmp_path / "cache"), tokenizer=cfg), seq_length=64, seed=1,
                      num_samples={"train": 200, "valid": 10})
    assert data.tokenizer.identity == tok.identity and len(data.train) >= 200
    assert data.train[0].shape == (65,) and data.train[199].max() < tok.vocab_size


# ---------------------------------------------------------------- sentence splitting (--split-sentences)

def test_split_sentences_keeps_abbreviations_joins_wrapped_lines_and_stops_at_blank_lines():
    text = ("Dr. Smith arrived at\nnoon. He left at 3 p.m. on Friday, said Mr. Jones.\n\nNotes\n \t\n"
            "- first item\r\n\r\n  The U.S. economy grew.   It was 4.5 percent.\n\n\n")
    want = ["Dr. Smith arrived at noon.", "He left at 3 p.m. on Friday, said Mr. Jones.", "Notes", "- first item",
            "The U.S. economy grew.", "It was 4.5 percent."]
    assert split_sentences(text) == want
    assert split_sentences(text) == want  # the same text, the same sentences
    assert split_sentences("") == split_sentences(" \n\n\t") == split_sentences("\x00\x01") == []


def test_split_sentences_without_blingfire_says_what_to_install(monkeypatch, jsonl, sp_cfg, tmp_path):
    monkeypatch.setitem(sys.modules, "blingfire", None)  # import blingfire now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'megalm\[sentences\]'"):
        split_sentences("One. Two.")
    with pytest.raises(ConfigError, match=r"pip install 'megalm\[sentences\]'"):
        pp.preprocess([str(jsonl)], str(tmp_path / "s"), tokenizer=sp_cfg, split_sentences=True)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def sentence_docs(texts, tmp_path_factory):
    """Documents for splitting: prose, the stdlib texts (two empty), and one that splits into nothing."""
    docs = ["Dr. Smith arrived at\nnoon. He left at 3 p.m.\n\nHeading\n\nA new paragraph. And more.",
            "\x00\x01 \x02",  # blingfire drops control characters: no sentence, skipped as empty
            "Only one sentence here"] + texts[:80]
    path = tmp_path_factory.mktemp("sent") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path, docs


def expected_sentences(docs, tok, append_eod):
    """Per kept document: the ids of each non-empty sentence, straight from split_sentences + encode."""
    out = []
    for text in docs:
        seqs = [ids for ids in (tok.encode(s) for s in split_sentences(text)) if ids]
        if seqs:
            if append_eod:
                seqs[-1] = seqs[-1] + [tok.eod]
            out.append(seqs)
    return out


@pytest.mark.parametrize("append_eod", [False, True])
def test_split_sentences_writes_one_sequence_per_sentence(sentence_docs, sp_cfg, tmp_path, append_eod):
    path, docs = sentence_docs
    tok = build_tokenizer(sp_cfg)
    stats = pp.preprocess([str(path)], str(tmp_path / "s"), tokenizer=sp_cfg, append_eod=append_eod,
                          split_sentences=True, chunk_mb=0.01)
    prefix = tmp_path / "s_text_sentence"
    assert stats.outputs == {"text": str(prefix)} and pp.output_prefix_for("x", "text", True) == "x_text_sentence"
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        [f"s_text_sentence{s}" for s in (".bin", ".idx", ".megalm.json")]
    want = expected_sentences(docs, tok, append_eod)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [seq for doc in want for seq in doc]
    assert ds.doc_idx.tolist() == np.cumsum([0] + [len(doc) for doc in want]).tolist()
    assert ds.num_documents == len(want) < len(ds)  # several sentences per document
    assert want[0] == [tok.encode(s) + ([tok.eod] if append_eod and k == 4 else []) for k, s in enumerate(
        ["Dr. Smith arrived at noon.", "He left at 3 p.m.", "Heading", "A new paragraph.", "And more."])]
    sentences = [s for text in docs for s in split_sentences(text)]
    decoded = [tok.decode(ds[i][:-1] if append_eod and i + 1 in ds.doc_idx else ds[i]) for i in range(len(ds))]
    assert decoded == [s for s in sentences if tok.encode(s)]
    # eod exactly at the end of each document's last sentence, nowhere else
    eod_at = np.flatnonzero(np.asarray(ds.tokens) == tok.eod).tolist()
    assert eod_at == ((ds.document_offsets()[1:] - 1).tolist() if append_eod else [])
    # counts: documents, not sentences (one record splits into nothing, two are empty texts)
    assert stats.documents == len(docs) and stats.skipped_empty == {"text": 3}
    assert stats.written == {"text": len(want)} and stats.sequences == {"text": len(ds)}
    assert stats.tokens["text"] == ds.num_tokens
    record = read_provenance(prefix)
    assert (record["documents"], record["sentences"], record["tokens"]) == (len(want), len(ds), ds.num_tokens)


def test_split_sentences_is_byte_identical_for_any_workers_and_megatron_reads_it(sentence_docs, sp_dir, sp_cfg,
                                                                                  tmp_path):
    path, _ = sentence_docs
    pp.preprocess([str(path)], str(tmp_path / "w1"), tokenizer=sp_cfg, append_eod=True, split_sentences=True,
                  workers=1, chunk_mb=0.01)
    r = cli("--input", path, "--output-prefix", tmp_path / "w2", "--tokenizer-model", sp_dir / "tokenizer.model",
            "--append-eod", "--split-sentences", "--workers", "2", "--chunk-mb", "0.01")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"w2_text_sentence: \d+ documents \(\d+ sentences\)", r.stderr)
    assert files_of(tmp_path / "w1_text_sentence") == files_of(tmp_path / "w2_text_sentence")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexed
    ours, theirs = IndexedDataset(tmp_path / "w1_text_sentence"), MIndexed(str(tmp_path / "w1_text_sentence"))
    assert theirs.sequence_lengths.tolist() == ours.sizes.tolist()
    assert theirs.document_indices.tolist() == ours.doc_idx.tolist()
    assert len(theirs) == len(ours) > ours.num_documents
    assert all(theirs[i].tolist() == ours[i].tolist() for i in range(len(ours)))


def test_merging_sentence_outputs_keeps_every_document_boundary(sentence_docs, sp_cfg, tmp_path):
    path, _ = sentence_docs
    lines = path.read_text().splitlines(keepends=True)
    (tmp_path / "part1.jsonl").write_text("".join(lines[:30]))
    (tmp_path / "part2.jsonl").write_text("".join(lines[30:]))
    for k in (1, 2):
        pp.preprocess([str(tmp_path / f"part{k}.jsonl")], str(tmp_path / f"p{k}"), tokenizer=sp_cfg,
                      append_eod=True, split_sentences=True)
    pp.preprocess([str(tmp_path / "part*.jsonl")], str(tmp_path / "whole"), tokenizer=sp_cfg, append_eod=True,
                  split_sentences=True)
    merged = pp.merge([str(tmp_path / "p1_text_sentence"), str(tmp_path / "p2_text_sentence")],
                      str(tmp_path / "merged"))
    a, b = IndexedDataset(tmp_path / "p1_text_sentence"), IndexedDataset(tmp_path / "p2_text_sentence")
    assert merged.doc_idx.tolist() == a.doc_idx.tolist() + (b.doc_idx[1:] + len(a)).tolist()
    assert merged.num_documents == a.num_documents + b.num_documents and len(merged) > merged.num_documents
    assert files_of(tmp_path / "merged") == files_of(tmp_path / "whole_text_sentence")
    assert read_provenance(tmp_path / "merged")["documents"] == merged.num_documents


def test_writer_takes_documents_of_several_sequences(tmp_path):
    from megalm.data import IndexedDatasetWriter
    with IndexedDatasetWriter(tmp_path / "w") as w:
        w.add_document([7])
        w.add_documents(np.arange(6), [2, 1, 3], sequences_per_document=[2, 1])
        w.add_documents(np.arange(3), [1, 2])  # one sequence per document
        with pytest.raises(DataError, match="at least one sequence and add up to the 2 sequences"):
            w.add_documents(np.arange(3), [1, 2], sequences_per_document=[3])
        with pytest.raises(DataError, match="at least one sequence"):
            w.add_documents(np.arange(3), [1, 2], sequences_per_document=[0, 2])
        assert (w.num_documents, w.num_sequences) == (5, 6)
    ds = IndexedDataset(tmp_path / "w")
    assert ds.sizes.tolist() == [1, 2, 1, 3, 1, 2] and ds.doc_idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert ds.get_document(1).tolist() == [0, 1, 2] and ds.get_document(2).tolist() == [3, 4, 5]


def test_sentences_that_tokenize_to_nothing_are_dropped(sp_cfg, tmp_path, monkeypatch):
    """split_sentences never gives a blank sentence, but a tokenizer may still map a sentence to no
    ids: such sentences are left out, and a document of nothing else is skipped as empty."""
    from megalm.data.corpora import sentences
    monkeypatch.setattr(sentences, "split_sentences", lambda text: text.split("|"))  # keeps "" sentences
    (tmp_path / "in.jsonl").write_text('{"text": "One.||Two."}\n{"text": "|"}\n{"text": "Three."}\n')
    stats = pp.preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "s"), tokenizer=sp_cfg, append_eod=True,
                          split_sentences=True)
    tok, ds = build_tokenizer(sp_cfg), IndexedDataset(tmp_path / "s_text_sentence")
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode("One."), tok.encode("Two.") + [tok.eod],
                                                       tok.encode("Three.") + [tok.eod]]
    assert ds.doc_idx.tolist() == [0, 2, 3]
    assert (stats.written, stats.sequences, stats.skipped_empty) == ({"text": 2}, {"text": 3}, {"text": 1})
