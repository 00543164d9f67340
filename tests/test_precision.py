"""fp16 dynamic loss scaling: Megatron's rules, and an overflow on one rank skips the step on all."""

import json
from pathlib import Path

import pytest

from megalm.training.precision import DynamicLossScaler

from distributed import run_ranks
from test_parallel_model import BASE, GPT2, load


def test_scaler_follows_megatron_rules():
    s = DynamicLossScaler(initial_scale=2.0 ** 32, window=3, hysteresis=2, min_scale=1.0)
    assert s.scale == 2.0 ** 32
    s.update(True)                 # first overflow: hysteresis 2 -> 1, scale kept
    assert s.scale == 2.0 ** 32
    s.update(True)                 # second: hysteresis used up, halve
    assert s.scale == 2.0 ** 31
    s.update(True)                 # still exhausted: halve again
    assert s.scale == 2.0 ** 30
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0 ** 30    # 2 clean steps < window 3
    s.update(True)                 # an overflow resets the clean-step count
    s.update(False), s.update(False), s.update(False)
    assert s.scale == 2.0 ** 30    # that overflow halved (hysteresis still spent): 2^29, then doubled
    s.update(True)                 # hysteresis refilled at the growth: this one only spends it
    assert s.scale == 2.0 ** 30
    tiny = DynamicLossScaler(initial_scale=2.0, window=10, hysteresis=1, min_scale=1.0)
    tiny.update(True), tiny.update(True), tiny.update(True)
    assert tiny.scale == 1.0       # never below the minimum
    static = DynamicLossScaler(static=128.0)
    static.update(True)
    assert static.scale == 128.0


def _fp16_with_inf_on_rank_1(rank, world, overrides, run_dir):
    import torch
    from megalm.parallel.data import DataParallel
    from megalm.train import run
    original = DataParallel.finish
    calls = []

    def finish_then_poison(self):
        original(self)
        calls.append(1)
        if rank == 1 and len(calls) == 3:  # the third step's gradients overflow on rank 1 only
            self.grad_params[0].grad.view(-1)[0] = float("inf")

    DataParallel.finish = finish_then_poison
    cfg = load(*overrides)
    return run(cfg, Path(run_dir), world)


def test_injected_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(tmp_path):
    overrides = [*BASE, *GPT2, "parallel=dp2", "trainer.precision=fp16", "trainer.initial_loss_scale=1024",
                 "trainer.hysteresis=1", "trainer.max_steps=5", "trainer.loss_scale_window=1000"]
    run_ranks(2, _fp16_with_inf_on_rank_1, overrides, str(tmp_path))
    steps = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert [r["skipped"] for r in steps] == [0, 0, 1, 0, 0]  # rank 0 (which logs) skipped rank 1's overflow
    assert [r["loss_scale"] for r in steps] == [1024, 1024, 1024, 512, 512]
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in steps)  # training went on, finite


def test_fp16_trains_close_to_fp32(tmp_path):
    from megalm.train import run
    curves = {}
    for precision in ("fp32", "fp16"):
        run(load(*BASE, *GPT2, f"trainer.precision={precision}", "trainer.initial_loss_scale=4096"),
            tmp_path / precision)
        curves[precision] = [json.loads(l)["loss"] for l in (tmp_path / precision / "metrics.jsonl").read_text()
                             .splitlines() if '"loss"' in l]
    # fp16 keeps 11 significant bits (~5e-4 relative per op); over 4 steps of a tiny model the
    # loss stays within a percent of fp32.
    assert curves["fp16"] == pytest.approx(curves["fp32"], rel=1e-2)
    assert curves["fp16"] != curves["fp32"]
