"""megalm as an lm-evaluation-harness model, offline: a harness task over a local file runs end to
end, and the model's log-likelihoods equal transformers' on the exported weights."""

from __future__ import annotations

import json

import pytest
from lm_eval.api.instance import Instance

from eval_reference import CHOICES, TEXT, TRAILING, hf_logprobs


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def _instances(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i, metadata=("t", i, 1)) for i, a in enumerate(args)]


def test_loglikelihood_equals_transformers(run):
    from megalm.evaluate.harness import MegalmLM
    run_dir, hf, tok = run
    lm = MegalmLM(str(run_dir), batch_size=2)
    pairs = [("import os\nimport", " sys"), ("The quick brown ", "fox"), ("", "def f():"),
             ("x = 1\n" * 20, " y")]  # the last one's context is longer than the model takes
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    for (context, cont), (lp, greedy) in zip(pairs, got):
        stripped = context.rstrip()
        cont = context[len(stripped):] + cont  # trailing spaces move to the continuation
        ctx = ([tok.eod] + tok.encode(stripped))
        target = tok.encode(cont)
        ctx = ctx[-(32 + 1 - len(target)):]
        ref, hits = hf_logprobs(hf, ctx, target)
        assert lp == pytest.approx(float(ref.sum()), rel=1e-6) and greedy == bool(hits.all())


def test_rolling_loglikelihood_is_the_perplexity_tasks_sum(run, tmp_path):
    from megalm.evaluate import evaluate
    from megalm.evaluate.harness import MegalmLM
    run_dir, _, _ = run
    (tmp_path / "t.txt").write_text(TEXT)
    want = evaluate(run_dir, "perplexity", tmp_path / "t.txt", write=False)["nll"]
    (got,) = MegalmLM(str(run_dir)).loglikelihood_rolling(_instances("loglikelihood_rolling", [(TEXT,)]))
    assert -got == pytest.approx(want, rel=1e-9)


def test_generate_until_stops_at_the_stop_strings(run):
    from megalm.evaluate.generation import complete
    from megalm.evaluate.harness import MegalmLM
    run_dir, _, tok = run
    lm = MegalmLM(str(run_dir))
    (free,) = lm.generate_until(_instances("generate_until", [("def f(", {"until": [], "max_gen_toks": 12})]))
    assert free == complete(lm.model, tok, "def f(", max_new_tokens=12, stop=[], seq_length=32,
                            vocab_size=tok.vocab_size)
    assert free  # something was generated
    stop = free[len(free) // 2:len(free) // 2 + 1]
    (cut,) = lm.generate_until(_instances("generate_until", [("def f(", {"until": [stop], "max_gen_toks": 12})]))
    assert cut == free[:free.index(stop)]


def test_megalm_choice_scores_the_rows_the_harness_model_scores(run, tmp_path):
    """`megalm.evaluate choice` splits each (context, choice) as the harness model does, a context's trailing
    whitespace moved into the continuation, so both score the same tokens on any data."""
    from megalm.evaluate.harness import MegalmLM
    from megalm.evaluate.likelihood import choice_rows
    run_dir, _, tok = run
    lm = MegalmLM(str(run_dir), batch_size=2)
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHOICES + TRAILING))
    rows, _ = choice_rows(tok, data, lm.seq_length)
    assert rows == [lm._row(rec["context"], c) for rec in CHOICES + TRAILING for c in rec["choices"]]
    ids, start = rows[len([c for rec in CHOICES for c in rec["choices"]])]  # "import os\nimport " + "sys"
    assert ids[:start] == [tok.eod] + tok.encode("import os\nimport") and ids[start:] == tok.encode(" sys")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_local_harness_task_runs_offline_and_agrees_with_megalm_choice(run, tmp_path, tp):
    from megalm.evaluate import evaluate
    from megalm.evaluate.harness import run_harness
    run_dir, _, _ = run
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHOICES * 3 + TRAILING * 2))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_mc.yaml").write_text(
        "task: megalm_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ntarget_delimiter: ''\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    results = run_harness(run_dir, ["megalm_local_mc"], include_path=str(tasks), tp=tp)
    acc = results["results"]["megalm_local_mc"]["acc,none"]
    assert acc == evaluate(run_dir, "choice", data, write=False)["accuracy"]
    written = json.loads((run_dir / "eval" / "harness.json").read_text())
    assert written["results"]["megalm_local_mc"]["acc,none"] == acc and written["tp"] == tp


PAIRS = [("import os\nimport", " sys"), ("The quick brown ", "fox"), ("x = 1\n" * 20, " y")]


def _requests_at_layouts(run_dir):
    """On each rank: the harness's three request kinds at tp2 and at pp2."""
    from megalm.evaluate.harness import MegalmLM
    from eval_layouts import LAYOUTS
    out = []
    for tp, pp, _ in LAYOUTS[:2]:  # the harness model runs at tp / pp; lm_eval divides requests itself
        lm = MegalmLM(str(run_dir), batch_size=2, tp=tp, pp=pp)
        out.append((lm.loglikelihood(_instances("loglikelihood", PAIRS)),
                    lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(TEXT,)])),
                    lm.generate_until(_instances("generate_until", [("def f(", {"until": ["\n\n"], "max_gen_toks": 8})]))))
    return out


def test_requests_at_tp2_and_pp2_equal_the_single_process(run, tmp_path):
    from megalm.evaluate.harness import MegalmLM, run_harness
    from megalm.evaluate.layout import on_ranks
    from megalm.errors import ConfigError
    run_dir, _, _ = run
    lm = MegalmLM(str(run_dir), batch_size=2)
    want = (lm.loglikelihood(_instances("loglikelihood", PAIRS)),
            lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(TEXT,)])),
            lm.generate_until(_instances("generate_until", [("def f(", {"until": ["\n\n"], "max_gen_toks": 8})])))
    for ll, rolling, generated in on_ranks(2, "cpu", _requests_at_layouts, run_dir):
        assert [g for _, g in ll] == [g for _, g in want[0]]
        assert [lp for lp, _ in ll] == pytest.approx([lp for lp, _ in want[0]], rel=1e-5)
        assert rolling == pytest.approx(want[1], rel=1e-5) and generated == want[2]
    with pytest.raises(ConfigError, match=r"tp=2 x pp=1 runs the model over 2 ranks"):
        MegalmLM(str(run_dir), tp=2)
    with pytest.raises(ConfigError, match=r"--tp 3 must divide the model's 4 attention heads"):
        run_harness(run_dir, ["x"], tp=3)


def test_tasks_in_the_include_path_alone_skip_the_harness_index(tmp_path):
    """When --include-path holds every task asked for, only that folder is indexed (the harness's ~15,000 own
    task files take seconds); a task from outside it brings the harness's own index back."""
    from lm_eval.tasks import TaskManager
    from megalm.evaluate.harness import _task_manager
    (tmp_path / "mine.yaml").write_text("task: megalm_mine\ndataset_path: json\noutput_type: multiple_choice\n")
    built = []

    class Recording(TaskManager):
        def __init__(self, **kwargs):
            built.append(kwargs.get("include_defaults", True))
            super().__init__(**{**kwargs, "include_defaults": False})  # the full index is not needed to test the choice

    local = _task_manager(Recording, ["megalm_mine"], str(tmp_path))
    assert built == [False] and "megalm_mine" in local.all_tasks
    built.clear()
    _task_manager(Recording, ["megalm_mine", "hellaswag"], str(tmp_path))
    assert built == [False, True]
    built.clear()
    _task_manager(Recording, ["hellaswag"], None)
    assert built == [True]


def test_an_unknown_task_is_named_with_the_closest_before_the_model_loads(tmp_path, capsys):
    """A misspelt task is one line naming it and the closest known name (the --include-path folder's or the
    harness's own), said before the run is loaded: not the harness's KeyError once the model is up."""
    from megalm.evaluate.harness import main
    (tmp_path / "mine.yaml").write_text("task: megalm_mine\ndataset_path: json\noutput_type: multiple_choice\n")
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "no_run"), "--tasks", "megalm_mine,megalm_mien", "--include-path", str(tmp_path),
              "--limit", "2"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and err == (
        "megalm.evaluate.harness: invalid config: --tasks megalm_mien: not a task, group or tag the harness knows "
        "(did you mean megalm_mine?); `lm-eval ls tasks` lists them"), err
