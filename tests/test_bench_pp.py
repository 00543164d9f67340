"""Smoke test of scripts/bench_pp.py: every schedule runs on 2 gloo ranks and the JSON is sane.

Never a timing test: only signs and ranges of the measured numbers are checked, and the bytes
sent across stage boundaries, which are exact.
"""

import importlib
import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCHEDULES = {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"}


def test_bench_pp_quick(tmp_path, monkeypatch):
    # Import by name from scripts/ (not from a file spec): the spawned ranks unpickle the worker
    # by module name, and they inherit this sys.path.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench = importlib.import_module("bench_pp")
    out_path = tmp_path / "pp.json"
    bench.main(["--quick", "--timeout", "120", "--json", str(out_path)])
    out = json.loads(out_path.read_text())
    shape = out["shape"]
    act_bytes = out["args"]["micro_batch"] * shape["seq"] * shape["hidden"] * 4  # fp32
    assert out["boundary_bytes_analytic"] == act_bytes
    assert {r["schedule"] for r in out["results"]} == SCHEDULES
    assert all(rate > 0 for rate in out["single_tokens_per_s"].values())
    assert out["device"]["message_s"] > 0 and out["device"]["message_cpu_s"] >= 0
    for r in out["results"]:
        assert r["tokens_per_s"] > 0
        # messages can only add time the ranks spend not computing
        assert all(a >= b - 1e-12 for a, b in zip(r["planned_idle_share"], r["planned_idle_share_free_messages"]))
        assert len(r["idle_share"]) == 2 and all(x < 1 for x in r["idle_share"]), r  # timing: no lower bound
        assert r["theory_idle_share"] == (2 - 1) / (r["m"] * r["v"] + 2 - 1)
        # one activation forward and its gradient backward per micro-batch on every cross-rank
        # boundary: 1 boundary at v = 1, 3 for the interleaved loop, 2 for the V (its turn is local)
        crossing = {1: 1, 2: 2 if r["schedule"] == "zbv" else 3}[r["v"]]
        assert len(r["boundaries"]) == 2 * crossing
        for b in r["boundaries"]:
            assert b["bytes"] == act_bytes and b["dtype"] == "float32" and b["per_step"] == r["m"]
