"""Mixed precision: fp16 and bf16 training move the weights as fp32 does, to within the dtype's
rounding; fp16 dynamic loss scaling follows Megatron's rules, and an overflow on one rank skips
the step on all, leaving weights and optimizer state untouched."""

import json
from pathlib import Path

import pytest
import torch

from megalm.models import build_model, init_weights
from megalm.training.checkpoint import load_model_weights
from megalm.training.precision import DynamicLossScaler

from distributed import run_ranks
from configs import load
from layouts import BASE, GPT2


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


def _snapshot(trainer):
    """Copies of every weight (and fp32 main parameter) and every optimizer state tensor (moments, step
    counts), by name."""
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    weights.update({f"main.{i}": t.detach().clone() for i, t in enumerate(trainer.params)})
    state = {f"{i}.{k}": v.detach().clone() for i, s in enumerate(trainer.optimizer.state.values())
             for k, v in s.items() if torch.is_tensor(v)}
    return weights, state


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fp16_with_inf_on_rank_1(rank, world, overrides, run_dir):
    from megalm.parallel.data import DataParallel
    from megalm.train import run
    from megalm.training.trainer import Trainer
    original_finish, original_step = DataParallel.finish, Trainer.train_step
    calls, unchanged = [], []

    def finish_then_poison(self):
        original_finish(self)
        calls.append(1)
        if rank == 1 and len(calls) == 3:  # the third step's gradients overflow on rank 1 only
            self.grad_params[0].grad.view(-1)[0] = float("inf")

    def step_and_compare(self):
        weights, state = _snapshot(self)
        out = original_step(self)
        weights_after, state_after = _snapshot(self)
        unchanged.append((_same(weights, weights_after), _same(state, state_after)))
        return out

    DataParallel.finish, Trainer.train_step = finish_then_poison, step_and_compare
    try:
        run(load(*overrides), Path(run_dir), world)
    finally:  # the rank process serves later calls (tests/distributed.py)
        DataParallel.finish, Trainer.train_step = original_finish, original_step
    return unchanged  # per step: (weights bitwise unchanged, optimizer state bitwise unchanged)


@pytest.mark.parametrize("mode", ["autocast", "main_params"])
def test_injected_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(tmp_path, mode):
    """(main_params: the overflow is in rank 1's fp32 main gradients, which the scaler unscales and checks.)"""
    overrides = [*BASE, *GPT2, "parallel=dp2", "trainer.precision=fp16", f"trainer.mixed_precision={mode}",
                 "trainer.initial_loss_scale=1024",
                 "trainer.hysteresis=1", "trainer.max_steps=5", "trainer.loss_scale_window=1000"]
    per_rank = run_ranks(2, _fp16_with_inf_on_rank_1, overrides, str(tmp_path))
    steps = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert [r["skipped"] for r in steps] == [0, 0, 1, 0, 0]  # rank 0 (which logs) skipped rank 1's overflow
    assert [r["loss_scale"] for r in steps] == [1024, 1024, 1024, 512, 512]
    assert all(r["loss"] == r["loss"] and r["loss"] < 10 for r in steps)  # training went on, finite
    # On both ranks the skipped step changed no bit of the weights or the optimizer state (AdamW's
    # step count, moments), and every other step changed both.
    skipped, stepped = (True, True), (False, False)
    for rank, unchanged in enumerate(per_rank):
        assert unchanged == [stepped, stepped, skipped, stepped, stepped], rank


# Mixed precision against fp32 on the final weights, single process. Plain SGD (momentum 0.9,
# no clipping) so the update is linear in the gradients: the weights then differ from fp32's by
# about the relative error of the gradients, which autocast's rounding of each matmul input to
# the dtype sets at about its unit roundoff u (half an ulp at 1: 2^-11 for fp16's 11 significant
# bits, 2^-8 for bf16's 8). Measured: ||w - w_fp32|| / ||w_fp32 - w_init|| = 0.94 u (fp16) and
# 0.87 u (bf16). We allow 4 u. Adam is avoided here: it divides each gradient by its own size,
# so near-zero gradients whose sign rounding flips move by the full lr in either precision.
# lr 2 makes the update large (a third of the initial weights' norm); a skipped update would
# give a ratio near 1, autocast not running (or running another dtype) one far below u / 4.
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
SGD = ["optimizer=sgd", "optimizer.lr=2.0", "optimizer.warmup_steps=1", "trainer.grad_clip=0", "checkpoint.save=true",
       "trainer.initial_loss_scale=4096"]  # fp16: 2^32 would overflow the first steps, skipping them


def _flat_weights(run_dir, cfg):
    """All weights, flattened: from the run's last checkpoint, or the initial ones without run_dir."""
    model = build_model(cfg.model)
    init_weights(model, cfg.model, cfg.trainer.seed)
    if run_dir is not None:
        load_model_weights(run_dir / "checkpoints", model)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    from megalm.train import run
    run_dir = tmp_path_factory.mktemp("fp32")
    cfg = load(*BASE, *GPT2, *SGD, "trainer.precision=fp32")
    run(cfg, run_dir)
    return _flat_weights(None, cfg), _flat_weights(run_dir, cfg)


@pytest.mark.parametrize("mode", ["autocast", "main_params"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_updates_the_weights_as_fp32_does(tmp_path, fp32_run, precision, mode):
    """main_params: the weights the forward uses are rounded to the dtype once an update, as autocast rounds
    them in every op, and the fp32 main parameters (what the checkpoint holds) take the update."""
    from megalm.train import run
    w_init, w_fp32 = fp32_run
    cfg = load(*BASE, *GPT2, *SGD, f"trainer.precision={precision}", f"trainer.mixed_precision={mode}")
    run(cfg, tmp_path)
    w = _flat_weights(tmp_path, cfg)
    update = (w_fp32 - w_init).norm()
    assert update > 0.25 * w_init.norm()  # a large move, not a nudge
    ratio = ((w - w_fp32).norm() / update).item()
    u = UNIT_ROUNDOFF[precision]
    assert u / 4 < ratio < 4 * u, f"{precision}: |w - w_fp32| / |update| = {ratio:.3g} (unit roundoff {u:.3g})"
    if precision == "fp16":
        steps = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
        assert [r["skipped"] for r in steps] == [0] * len(steps)  # every step was a real update
