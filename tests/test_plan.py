"""megalm.plan: the parameters and model state of each rank position, from the meta-device model
over a fake process group, against a hand count of GPT-3 175B's layers and against the ranks of
real two-rank runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distributed import run_ranks


def _plan(*overrides):
    from megalm.plan import compose, plan
    return plan(*compose(list(overrides)))


def test_gpt3_175b_at_tp8_pp16_by_hand():
    """Per rank and layer: the tp-sharded matrices and their biases (12h^2 + 7h)/8, and the replicated
    row-parallel biases and two norms 6h; the first stage adds its vocabulary shard (51200/8 rows) and
    the learned positions (2048 rows, replicated), the last its tied head shard and the final norm."""
    got = _plan("model=gpt_175b", "parallel=tp8_pp16", "trainer.micro_batch_size=1", "trainer.global_batch_size=64")
    h, layers = 12288, 96 // 16
    per_layer = (12 * h * h + 7 * h) // 8 + 6 * h
    params = {(q["stage"], q["tp_rank"]): q["params"] for q in got["positions"]}
    assert set(params) == {(s, t) for s in range(16) for t in (0, 7)}
    assert params[(5, 0)] == params[(5, 7)] == layers * per_layer
    assert params[(0, 0)] == layers * per_layer + (51200 // 8) * h + 2048 * h
    assert params[(15, 7)] == layers * per_layer + (51200 // 8) * h + 2 * h
    middle = [q for q in got["positions"] if q["stage"] == 5][0]
    assert middle["model_state_bytes"] == 16 * middle["params"]  # fp32 weights and grads, Adam's two moments
    assert got["layout"]["world"] == 128


def test_zero_shards_the_model_state():
    small = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    got = _plan(*small, "parallel=dp2", "parallel.zero_stage=1")
    q = got["positions"][0]
    assert q["model_state_bytes"] == pytest.approx(q["params"] * (4 + 4 + 8 / 2))
    got = _plan(*small, "parallel=dp2", "parallel.zero_stage=3")
    assert got["positions"][0]["model_state_bytes"] == pytest.approx(got["positions"][0]["params"] * 16 / 2)


def _held(rank, world, overrides):
    """What this rank of a real run's layout holds: the parameters of its part of the model."""
    import torch
    from test_parallel_model import load
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model
    from megalm.parallel import materialize, parallelize
    cfg = load(*overrides)
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
    model = build_model(cfg.model, device="meta")
    parallelize(model, mesh, cfg.parallel, seed=0)
    materialize(model, torch.device("cpu"))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layout", [["parallel=tp2"], ["parallel=pp2"], ["parallel=tp2", "parallel.sequence_parallel=true"]])
def test_positions_hold_what_real_ranks_hold(layout):
    overrides = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=2", "trainer.global_batch_size=4", *layout]
    planned = {q["example_rank"]: q["params"] for q in _plan(*overrides)["positions"]}
    held = run_ranks(2, _held, overrides, timeout=300.0)
    assert planned == {rank: n for rank, n in enumerate(held)}


def test_cli_table_and_json():
    args = [sys.executable, "-m", "megalm.plan", "model=gpt_tiny", "data=mock", "parallel=pp2",
            "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    table = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "gpt_tiny at tp1 pp2 dp1 (2 ranks)" in table.stdout and "model state GB" in table.stdout
    out = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300).stdout)
    assert [q["stage"] for q in out["positions"]] == [0, 1]
    bad = subprocess.run([sys.executable, "-m", "megalm.plan", "model=gpt_tiny", "parallel.tp=3"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "megalm.plan" in bad.stderr and "tp" in bad.stderr
