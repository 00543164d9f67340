"""megalm.evaluate against an independent computation: the run exported to Hugging Face and
scored by transformers, token by token.

A real run (conftest's `run`: gpt_tiny, GPT-2 layout, trained a few steps on the stdlib corpus with its own
sentencepiece model) is evaluated. The reference never uses megalm's windowing or batching:
perplexity comes from each token's log-probability given exactly the context the rule defines
(the first window reaching token t starts at k * stride, k = max(0, ceil((t - L) / stride))),
summed; cloze and choice accuracies from transformers' argmax and log-likelihood sums per example.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eval_reference import CHOICES, TEXT, hf_logprobs
from megalm.errors import DataError

SEQ = 32


@pytest.mark.parametrize("stride", [1, 5, 16, SEQ])
def test_perplexity_equals_transformers_token_by_token(run, tmp_path, stride):
    from megalm.evaluate import evaluate
    run_dir, hf, tok = run
    (tmp_path / "text.txt").write_text(TEXT)
    got = evaluate(run_dir, "perplexity", tmp_path / "text.txt", stride=stride, batch_size=3)
    ids = [tok.eod] + tok.encode(TEXT)
    assert len(ids) > 3 * SEQ  # several windows
    nll = 0.0
    for t in range(1, len(ids)):
        k = max(0, math.ceil((t - SEQ) / stride))  # the first window that reaches t
        lp, _ = hf_logprobs(hf, ids[k * stride:t], [ids[t]])
        nll -= float(lp[0])
    assert got["tokens"] == len(ids) - 1
    assert got["nll"] == pytest.approx(nll, rel=1e-6)  # megalm computes in fp32, the reference in fp64
    assert got["ppl"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-6)
    words = len(TEXT.strip().split(" "))
    assert got["words"] == words and got["adjusted_ppl"] == pytest.approx(math.exp(nll / words), rel=1e-6)
    written = json.loads((run_dir / "eval" / f"perplexity_text_stride{stride}.json").read_text())
    assert written["nll"] == got["nll"] and written["step"] == 30


def test_windows_cover_every_token_once_and_default_to_disjoint(run, tmp_path):
    from megalm.evaluate import evaluate, windows
    run_dir, _, _ = run
    (tmp_path / "t.txt").write_text(TEXT * 3)
    default = evaluate(run_dir, "perplexity", tmp_path / "t.txt", write=False)
    assert default["stride"] == SEQ
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 9, 9)]
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 5), (4, 8, 7), (6, 9, 9)]
    overlapping = evaluate(run_dir, "perplexity", tmp_path / "t.txt", stride=4, write=False)
    assert overlapping["tokens"] == default["tokens"] and overlapping["windows"] > 7 * default["windows"]
    for n, length, stride in [(2, 4, 1), (100, 32, 1), (100, 32, 7), (100, 32, 32), (33, 32, 32), (34, 32, 5)]:
        targets = [t for s, e, first in windows(n, length, stride) for t in range(first, e + 1)]
        assert targets == list(range(1, n))  # each target once, in order
        assert all(e - s <= length and s <= first - 1 for s, e, first in windows(n, length, stride))


def _jsonl(path: Path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


CLOZE = [{"text": "import os\nimport sys\nimport re"}, {"text": "def f(self):\n    return self"},
         {"text": "for i in range(10):\n    print(i)"}, {"text": "The quick brown fox jumps over the lazy dog"},
         {"text": "class A:\n    def __init__(self):\n        self.x = None"}]


@pytest.mark.parametrize("strict", [True, False])
def test_cloze_equals_transformers_argmax(run, tmp_path, strict):
    from megalm.evaluate import evaluate
    run_dir, hf, tok = run
    path = _jsonl(tmp_path / "lambada.jsonl", CLOZE)
    got = evaluate(run_dir, "cloze", path, strict=strict, batch_size=2)
    hits = []
    for rec in CLOZE:
        text = rec["text"]
        if strict:
            last = text.split()[-1]
            context, target = tok.encode(text[:text.rfind(last)].strip()), tok.encode(" " + last)
            assert len(target) >= 1
        else:
            whole = tok.encode(text)
            context, target = whole[:-1], whole[-1:]
        _, argmax = hf_logprobs(hf, [tok.eod] + context, target)
        hits.append(bool(argmax.all()))
    assert got["examples"] == len(CLOZE) and got["correct"] == sum(hits)
    assert got["accuracy"] == sum(hits) / len(CLOZE)
    # strict and non-strict results are two files, each with its own numbers
    written = run_dir / "eval" / f"cloze_lambada{'' if strict else '_nonstrict'}.json"
    assert json.loads(written.read_text())["strict"] == strict


def test_cloze_rows_are_megatrons(run, tmp_path):
    from megalm.evaluate import cloze_rows
    _, _, tok = run
    path = _jsonl(tmp_path / "l.jsonl", [{"text": "  He said hello  "}])
    (ids, k), = cloze_rows(tok, path, SEQ, strict=True)
    assert ids == [tok.eod] + tok.encode("He said") + tok.encode(" hello") and k == 1 + len(tok.encode("He said"))
    (ids, k), = cloze_rows(tok, path, SEQ, strict=False)
    whole = tok.encode("  He said hello  ")
    assert ids == [tok.eod] + whole and k == len(whole)


@pytest.mark.parametrize("normalize", ["none", "tokens", "chars"])
def test_choice_equals_transformers_log_likelihood(run, tmp_path, normalize):
    from megalm.evaluate import evaluate
    run_dir, hf, tok = run
    got = evaluate(run_dir, "choice", _jsonl(tmp_path / "mc.jsonl", CHOICES), normalize=normalize)
    correct = 0
    for rec in CHOICES:
        context = [tok.eod] + tok.encode(rec["context"])
        scores = []
        for c in rec["choices"]:
            lp, _ = hf_logprobs(hf, context, tok.encode(c))
            scores.append(float(lp.sum()) / {"none": 1, "tokens": len(lp), "chars": len(c)}[normalize])
        correct += int(scores.index(max(scores)) == rec["label"])
    assert got["correct"] == correct and got["examples"] == len(CHOICES)


@pytest.mark.parametrize("task, records, message", [
    ("cloze", [], r"holds no examples"),
    ("cloze", [{"txt": "x"}], r"\.jsonl:1: no 'text' field"),
    ("cloze", [{"text": "a b"}, {"text": "   "}], r"\.jsonl:2: 'text' must be a string with at least one word"),
    ("cloze", [{"text": "word " * 200}], r"\.jsonl:1: \d+ tokens to read .* do not fit model.seq_length=32"),
    ("choice", [{"context": "a", "choices": ["b", "c"], "label": 2}], r":1: 'label' 2 is not an index .* \(0..1\)"),
    ("choice", [{"context": "a", "choices": ["b"], "label": 0}], r":1: 'choices' must be a list of at least two"),
    ("choice", [{"context": "a", "choices": ["b", "c"]}], r":1: no 'label' field"),
])
def test_bad_inputs_name_the_file_and_line(run, tmp_path, task, records, message):
    from megalm.evaluate import evaluate
    run_dir, _, _ = run
    path = _jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=message):
        evaluate(run_dir, task, path, write=False)


def test_cli_prints_a_table_and_errors_are_one_line(run, tmp_path, capsys):
    from megalm.evaluate import main
    run_dir, _, _ = run
    (tmp_path / "t.txt").write_text(TEXT)
    main([str(run_dir), "perplexity", "--data", str(tmp_path / "t.txt"), "--stride", "8"])
    out = capsys.readouterr().out
    assert "adjusted_ppl" in out and "stride" in out and (run_dir / "eval" / "perplexity_t_stride8.json").is_file()
    for argv, message in ([[str(run_dir), "perplexity", "--data", str(tmp_path / "t.txt"), "--stride", "99"],
                           r"--stride=99 must be in \[1, model.seq_length=32\]"],
                          [[str(run_dir), "cloze", "--data", str(tmp_path / "none.jsonl")], r"does not exist"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.startswith("megalm.evaluate: ") and len(err.strip().splitlines()) == 1
        assert __import__("re").search(message, err), err
