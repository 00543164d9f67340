"""The step-time breakdown in metrics.jsonl (single process, dp2 with ZeRO-1, pp2), the comm clock's
arithmetic, and trainer.profile_steps (traces per step and rank; bad values refused).

No assertion on speed: only that the parts exist where they should, are not negative, and add up
to no more than the step.
"""

import dataclasses
import json
import logging
import time
from pathlib import Path

import pytest

from distributed import run_ranks
from megalm.cli import explain_hydra_error
from megalm.distributed.comm import CommClock, _TimedWork
from megalm.validation import validate

from configs import load as compose
from tiny_run import TINY, load

PARTS = ("time_data_s", "time_forward_s", "time_backward_s", "time_compute_s", "time_pipeline_idle_s",
         "time_optimizer_s", "time_other_s")
QUICK = [*TINY, "logging.curves=false", "trainer.eval_steps=1", "trainer.eval_interval=0", "trainer.eval_at_start=false",
         "checkpoint.save=false"]


def train_records(run_dir):
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


def assert_adds_up(r):
    """Every part >= 0, the parts (which never overlap) within the step; comm within the step too."""
    parts = [r[k] for k in PARTS if k in r]
    assert all(p >= 0 for p in parts), r
    assert sum(parts) <= r["time_step_s"] * 1.001 + 1e-6, r
    assert r["time_other_s"] == pytest.approx(r["time_step_s"] - sum(parts[:-1]), abs=1e-9)
    assert 0 <= r["time_comm_exposed_s"] <= r["time_step_s"] * 1.001 + 1e-6, r
    assert 0 <= r["time_comm_s"] <= r["time_step_s"] * 1.001 + 1e-6, r
    kinds = exposed_by_kind(r)
    assert all(v >= 0 for v in kinds.values()), r
    assert sum(kinds.values()) == pytest.approx(r["time_comm_exposed_s"], rel=1e-6, abs=1e-9), r


def exposed_by_kind(r):
    """{kind: seconds} of time_comm_exposed_KIND_s."""
    return {k[len("time_comm_exposed_"):-2]: v for k, v in r.items()
            if k.startswith("time_comm_exposed_") and k != "time_comm_exposed_s"}


def test_single_process_breakdown_at_the_log_interval_and_a_profiled_step(tmp_path, caplog):
    from megalm.train import run
    caplog.set_level(logging.INFO, logger="megalm.trainer")
    run(load(*QUICK, "trainer.max_steps=3", "trainer.log_interval=2", "trainer.profile_steps=[2]"), tmp_path)
    recs = train_records(tmp_path)
    assert [r["step"] for r in recs] == [2, 3]  # the log interval, and the last step
    for r in recs:
        assert {"time_step_s", "time_data_s", "time_forward_s", "time_backward_s", "time_optimizer_s",
                "time_other_s", "time_comm_s", "time_comm_exposed_s"} <= r.keys()
        assert "time_compute_s" not in r and "time_pipeline_idle_s" not in r
        assert_adds_up(r)
        assert r["time_forward_s"] > 0 and r["time_backward_s"] > 0 and r["time_optimizer_s"] > 0
        assert r["time_comm_s"] == 0 and r["time_comm_exposed_s"] == 0  # one process: no collective
    assert "ms/step: data" in caplog.text and "forward" in caplog.text

    traces = sorted((tmp_path / "profiles").iterdir())
    assert [p.name for p in traces] == ["step_00000002_rank0.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the step's operators are in it
    assert str(traces[0]) in caplog.text


def test_breakdown_off_writes_no_time_fields(tmp_path):
    from megalm.train import run
    run(load(*QUICK, "trainer.max_steps=2", "trainer.time_breakdown=false"), tmp_path)
    recs = train_records(tmp_path)
    assert len(recs) == 2 and not any(k.startswith("time_") for r in recs for k in r)
    assert not (tmp_path / "profiles").exists()


def _rank_runs(rank, world, jobs):
    from megalm.train import run
    for overrides, run_dir in jobs:
        cfg = compose(*overrides)
        validate(cfg, world)
        run(cfg, Path(run_dir), world)


def test_dp2_and_pp2_time_their_collectives_and_the_pipeline(tmp_path):
    common = [*QUICK, "model.num_layers=2", "trainer.micro_batch_size=2", "trainer.max_steps=2",
              "parallel.bucket_size_mb=0.02"]  # several gradient buckets, launched asynchronously
    dp2, pp2 = tmp_path / "dp2", tmp_path / "pp2"
    run_ranks(2, _rank_runs, [([*common, "parallel=dp2", "parallel.zero_stage=1"], str(dp2)),
                              ([*common, "parallel=pp2", "trainer.profile_steps=[2]"], str(pp2))])
    for r in train_records(dp2):
        assert_adds_up(r)
        assert r["time_comm_s"] > 0 and r["time_comm_exposed_s"] > 0  # reduce-scatters, all-gathers, the norm
        # ZeRO-1: the buckets' reduce-scatters (waited on at the end of backward), the all-gathers after the update
        # (waited on at once), the gradient norm's and the loss's all-reduces
        assert set(exposed_by_kind(r)) == {"all_reduce", "all_gather", "reduce_scatter"}, r
        assert exposed_by_kind(r)["all_gather"] > 0, r
        assert r["time_forward_s"] > 0 and r["time_backward_s"] > 0
    for r in train_records(pp2):
        assert_adds_up(r)
        # The schedule interleaves forward and backward: one compute figure, and the schedule's idle.
        assert "time_forward_s" not in r and "time_backward_s" not in r
        # Idle holds at least the schedule's own work between chunks and the loss broadcast.
        assert r["time_compute_s"] > 0 and r["time_pipeline_idle_s"] > 0
        assert r["time_comm_s"] > 0  # the gradient norm's and the tied embedding's all-reduces
        # Without dp every collective is synchronous: all of its time is exposed.
        assert r["time_comm_exposed_s"] == pytest.approx(r["time_comm_s"], rel=1e-6, abs=1e-9)
        assert set(exposed_by_kind(r)) == {"all_reduce"}, r  # the norm's and the tied embedding's
    names = sorted(p.name for p in (pp2 / "profiles").iterdir())
    assert names == ["step_00000002_rank0.pt.trace.json", "step_00000002_rank1.pt.trace.json"]
    assert all(json.loads((pp2 / "profiles" / n).read_text())["traceEvents"] for n in names)


def test_comm_clock_counts_overlapping_collectives_once_and_waits_as_exposed():
    clock = CommClock()
    clock.spans = [[1.0, 3.0], [2.0, 4.0], [5.0, None], [0.0, 0.5]]  # two overlapping, one still in flight
    assert clock.in_flight(0.75, 6.0) == pytest.approx(3.0 + 1.0)  # [1, 4] and [5, 6]; [0, 0.5] is outside

    class Work:  # an async handle whose transfer takes 50 ms after it was launched
        def __init__(self):
            self.done_at = time.perf_counter() + 0.05

        def wait(self):
            time.sleep(max(0.0, self.done_at - time.perf_counter()))
            return True

    span = [time.perf_counter(), None]
    work = _TimedWork(Work(), span, clock, "reduce_scatter")
    assert work.done_at and work.wait() and span[1] is not None  # other attributes pass through
    assert 0.04 < clock.blocked < 1.0 and clock.blocked_by == {"reduce_scatter": clock.blocked}


def test_bad_profile_steps_are_refused_naming_the_value():
    for steps, message in (("[0]", "step 0 is never run"), ("[-2]", "step -2 is never run"),
                           ("[2,9]", "step 9 is never run")):
        with pytest.raises(ValueError, match="list steps from 1 \\(the first step\\) to trainer.max_steps=5") as e:
            validate(load("trainer.max_steps=5", f"trainer.profile_steps={steps}"), 1)
        assert message in str(e.value) and "trainer.profile_steps=" in str(e.value)
    cfg = load("trainer.max_steps=5")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, profile_steps=[1.5]))
    with pytest.raises(ValueError, match=r"1.5 is not a step number; list whole numbers from 1"):
        validate(cfg, 1)
    with pytest.raises(Exception) as e:  # what the command line says to a non-integer
        load("trainer.profile_steps=[two]")
    assert "trainer.profile_steps=[two]" in str(explain_hydra_error(e.value))
    assert "Integer" in str(explain_hydra_error(e.value))
