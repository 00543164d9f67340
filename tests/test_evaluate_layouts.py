"""megalm.evaluate at tensor-parallel, pipeline and data-parallel layouts (--tp / --pp / --dp)
gives the single process's numbers: likelihood tasks within fp32 rounding, and the same greedy
completions, classifications and answers. The ranks start from `evaluate` itself, as the CLI
starts them."""

from __future__ import annotations

import json

import pytest

from eval_layouts import LAYOUTS, assert_same_numbers, evaluate_at_layouts
from megalm.errors import ConfigError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_layout_data")
    text = root / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n    y = 0\n" * 3)
    choice = root / "choice.jsonl"
    choice.write_text("".join(json.dumps({"context": "import os\nimport ", "choices": ["sys", "zzqq", "os.path"],
                                          "label": 0}) + "\n" for _ in range(2)))
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "reference": "x"}) + "\n" for p in ("def f(", "import ")))
    return {"perplexity": text, "choice": choice, "generate": gen}


def test_likelihood_and_generation_at_tp2_pp2_and_dp2(run, files):
    from megalm.evaluate import evaluate
    from megalm.evaluate.layout import on_ranks
    run_dir = run[0]
    jobs = [(run_dir, "perplexity", files["perplexity"], {"stride": 16, "batch_size": 2}),
            (run_dir, "choice", files["choice"], {"normalize": "tokens"}),
            (run_dir, "generate", files["generate"], {"max_new_tokens": 6})]
    singles = [evaluate(r, t, d, write=False, **o) for r, t, d, o in jobs]
    for (tp, pp, dp), results in zip(LAYOUTS, on_ranks(2, "cpu", evaluate_at_layouts, jobs)):
        for (_, task, _, _), single, layout in zip(jobs, singles, results):
            assert (layout["tp"], layout["pp"], layout["dp"]) == (tp, pp, dp)
            assert_same_numbers(single, layout, (task, tp, pp, dp))


def test_evaluate_starts_its_ranks_and_writes_once(run, files, tmp_path):
    """The public entry: --tp 2 starts two ranks here; the results file is rank 0's."""
    import shutil
    from megalm.evaluate import evaluate
    run_dir = tmp_path / "run"
    shutil.copytree(run[0], run_dir)
    got = evaluate(run_dir, "perplexity", files["perplexity"], tp=2, stride=16)
    single = evaluate(run_dir, "perplexity", files["perplexity"], stride=16, write=False)
    assert_same_numbers(single, got, "perplexity")
    written = json.loads((run_dir / "eval" / "perplexity_text_stride16.json").read_text())
    assert written["tp"] == 2 and written["loss"] == got["loss"]
    with pytest.raises(ConfigError, match=r"--pp 8 is more stages than the model's 2 layers"):
        evaluate(run_dir, "perplexity", files["perplexity"], pp=8)


def _shares():
    """On each of two ranks: what across_replicas hands this replica, and the gathered results."""
    import torch.distributed as dist
    from types import SimpleNamespace
    from megalm.evaluate.layout import across_replicas
    seen = []
    model = SimpleNamespace(dp_group=dist.group.WORLD)
    out = across_replicas(model, lambda part: seen.extend(part) or [x * 10 for x in part], range(5))
    return dist.get_rank(), seen, out


def test_replicas_take_contiguous_shares_and_all_get_every_result():
    from distributed import run_ranks
    results = run_ranks(2, _shares_on_rank)
    assert [seen for _, seen, _ in results] == [[0, 1], [2, 3, 4]]
    assert all(out == [0, 10, 20, 30, 40] for _, _, out in results)


def _shares_on_rank(rank, world):
    return _shares()


def test_the_ranks_get_every_keyword_and_the_group_waits_as_long_as_asked():
    """on_ranks hands its function every keyword but `wait_s`: the code task's `timeout_s` (--timeout, seconds a
    program may run) once became the collectives' timeout, so a layout's stage slower than 10 s failed."""
    from datetime import timedelta

    from eval_layouts import keywords_and_group_timeout
    from megalm.evaluate.layout import on_ranks
    got, waits = on_ranks(2, "cpu", keywords_and_group_timeout, timeout_s=3.5, seed=7)
    assert got == {"timeout_s": 3.5, "seed": 7} and waits == timedelta(minutes=30)  # torch's default
    got, waits = on_ranks(2, "cpu", keywords_and_group_timeout, wait_s=120)
    assert got == {} and waits == timedelta(seconds=120)
