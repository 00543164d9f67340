"""Smoke test of scripts/bench.py: it runs end to end and writes sane JSON. Never a timing test."""

import importlib.util
import json
from pathlib import Path

import torch
import transformers  # noqa: F401  a dev dependency; the benchmark compares against it

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def test_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("megalm_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out_path = tmp_path / "bench.json"
    # The current thread count, so the test leaves torch as it found it for the tests after it.
    bench.main(["--model", "gpt_tiny", "--micro-batch", "2", "--rounds", "1", "--steps", "2", "--warmup", "1",
                "--peak-seconds", "0.02", "--threads", str(torch.get_num_threads()), "--modes", "eager,bf16",
                "--json", str(out_path)])
    out = json.loads(out_path.read_text())
    assert set(out["results"]) == {"megalm/eager", "hf/eager", "megalm/bf16", "hf/bf16"}
    assert all(r["tokens_per_s"] > 0 for r in out["results"].values())
    assert {"megalm/bf16 : hf/bf16", "megalm/bf16 : megalm/eager"} <= set(out["paired_ratios"])
    assert out["params"]["megalm"] == out["params"]["hf"] > 0
    assert out["initial_logit_max_abs_diff"] < 1e-3
    assert out["ratio"] > 0 and "paired_ratio" in out
