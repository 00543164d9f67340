"""checkpoint.save_best and trainer.early_stopping_patience on the tiny GPT: the checkpoint kept as
`best` is the evaluation the log shows lowest, early stopping ends a run where the log says it should,
the tools read the best weights, and a rerun of a stopped run stays stopped."""

from __future__ import annotations

import copy

import pytest
import torch

from megalm.errors import ConfigError
from tiny_run import TINY, load, records

# A learning rate high enough that the validation loss goes up and down within a few steps.
WATCHED = [*TINY, "trainer.max_steps=12", "trainer.eval_interval=2", "optimizer.lr=3e-2"]


def _val(run_dir):
    return [(r["step"], r["val_loss"]) for r in records(run_dir) if "val_loss" in r]


def _expected_stop(losses, patience):
    """Where a run evaluated at `losses` (step, loss) stops: the evaluation that is the `patience`-th in a row
    after the lowest so far without going below it; None when no such evaluation comes before the last."""
    best, stale = None, 0
    for i, (step, loss) in enumerate(losses):
        if best is None or loss < best:
            best, stale = loss, 0
        else:
            stale += 1
        if stale >= patience and i < len(losses) - 1:
            return step
    return None


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The run with nothing stopping it, each evaluation's weights kept: the reference for the others."""
    from megalm.train import run as train_run
    d = tmp_path_factory.mktemp("full")
    train_run(load(*WATCHED, "checkpoint.interval=2", "checkpoint.keep_last=0"), d, 1)
    return d


def test_the_best_checkpoint_is_the_best_validation_loss_of_the_log(full, tmp_path):
    """trainer.monitor_mode=max on the loss, so that the best evaluation falls in the middle of this run (its
    lowest is at the end): the checkpoint kept as best, and what the tools read, is the highest in the log."""
    from megalm.generate import load_for_generation
    from megalm.train import run as train_run
    from megalm.training.checkpoint import load_model_weights
    losses = _val(full)
    best_step = max(losses, key=lambda sl: sl[1])[0]
    assert best_step not in (0, 12), f"the reference run's losses {losses} should have their highest between"
    train_run(load(*WATCHED, "checkpoint.save_best=true", "trainer.monitor_mode=max", "checkpoint.interval=2",
                   "checkpoint.keep_last=1"), tmp_path, 1)
    assert _val(tmp_path) == losses  # watching changes nothing that is trained
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "best").read_text().strip() == f"step_{best_step:08d}"
    assert (ckpt / "latest").read_text().strip() == "step_00000012"
    # keep_last=1 keeps the last of the saves (one every 2 steps); the best survives them
    assert sorted(p.name for p in ckpt.glob("step_*")) == [f"step_{best_step:08d}", "step_00000012"]
    _, model, _, state = load_for_generation(tmp_path)  # what evaluate, generate and serve read
    reference = copy.deepcopy(model)
    ref_state = load_model_weights(full / "checkpoints" / f"step_{best_step:08d}", reference)
    assert state["step"] == ref_state["step"] == best_step
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_a_best_start_is_saved_before_the_first_step_and_changes_nothing(full, tmp_path):
    """Over the first 6 steps the starting weights evaluate lowest: they are saved (step 0) as the best, and the
    optimizer state that save creates leaves every later number as it was (the schedule is the 12-step run's)."""
    from megalm.train import run as train_run
    losses = [sl for sl in _val(full) if sl[0] <= 6]
    assert min(losses, key=lambda sl: sl[1])[0] == 0, losses
    train_run(load(*WATCHED, "trainer.max_steps=6", "optimizer.decay_steps=12", "checkpoint.save_best=true"),
              tmp_path, 1)
    assert _val(tmp_path) == losses
    assert [r["loss"] for r in records(tmp_path) if "loss" in r] == \
        [r["loss"] for r in records(full) if "loss" in r and r["step"] <= 6]
    assert (tmp_path / "checkpoints" / "best").read_text().strip() == "step_00000000"


@pytest.mark.parametrize("patience", [1, 2])
def test_early_stopping_ends_the_run_where_the_log_says(full, tmp_path, patience):
    from megalm.train import run as train_run
    losses = _val(full)
    stop = _expected_stop(losses, patience)
    assert stop is not None, f"patience {patience} should stop the reference run {losses} before its end"
    train_run(load(*WATCHED, f"trainer.early_stopping_patience={patience}"), tmp_path, 1)
    assert _val(tmp_path) == [sl for sl in losses if sl[0] <= stop]
    assert max(r["step"] for r in records(tmp_path)) == stop
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{stop:08d}"  # saved where it stopped
    n = len(records(tmp_path))
    train_run(load(*WATCHED, f"trainer.early_stopping_patience={patience}"), tmp_path, 1)  # the same command again
    assert len(records(tmp_path)) == n, "a rerun of a run that stopped early trained on"


def test_min_delta_counts_only_larger_changes(full, tmp_path):
    """Patience 4 never runs out on the reference losses (step 8 beats the start); with a min_delta above every
    change nothing after the start improves, so the run stops at the fourth evaluation after it."""
    from megalm.train import run as train_run
    losses = _val(full)
    assert _expected_stop(losses, 4) is None
    assert max(loss for _, loss in losses) - min(loss for _, loss in losses) < 1.0
    train_run(load(*WATCHED, "trainer.early_stopping_patience=4", "trainer.early_stopping_min_delta=1.0"), tmp_path, 1)
    assert max(r["step"] for r in records(tmp_path)) == losses[4][0]


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.save_best=true", "trainer.monitor=val_acc"],
     r"trainer.monitor=val_acc .* is not a number this run's evaluations report; they report val_loss, val_ppl"),
    (["trainer.early_stopping_patience=2", "trainer.eval_steps=0"],
     r"trainer.early_stopping_patience=2 watch trainer.monitor=val_loss .* trainer.eval_steps=0"),
    (["checkpoint.save_best=true", "checkpoint.save=false"], r"checkpoint.save=false writes none"),
    (["trainer.monitor_mode=lowest"], r"trainer.monitor_mode='lowest' is not one of auto, min, max"),
    (["trainer.early_stopping_patience=-1"], r"trainer.early_stopping_patience=-1 must not be negative"),
])
def test_bad_watch_settings_are_refused_before_training(tmp_path, overrides, message):
    from megalm.train import run as train_run
    with pytest.raises(ConfigError, match=message):
        train_run(load(*WATCHED, *overrides), tmp_path, 1)
    assert not (tmp_path / "metrics.jsonl").exists() or not records(tmp_path)


def test_a_pipeline_run_stops_where_the_single_process_run_does(full, tmp_path):
    """pp2: the validation loss comes from the last stage and the monitor takes rank 0's value on every rank, so
    both stages stop (and save the best) at the single-process run's steps, with its losses."""
    from layouts import run_layout
    losses = _val(full)
    stop = _expected_stop(losses, 2)
    run_layout(2, [*WATCHED, "parallel=pp2", "trainer.early_stopping_patience=2", "checkpoint.save_best=true"],
               str(tmp_path), timeout=300.0)
    got = _val(tmp_path)
    assert [s for s, _ in got] == [s for s, _ in losses if s <= stop]
    for (_, a), (_, b) in zip(got, losses):
        assert a == pytest.approx(b, rel=1e-5)
    assert (tmp_path / "checkpoints" / "best").read_text().strip() == "step_00000000"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{stop:08d}"


def test_the_monitor_on_its_own():
    """auto mode by name, a NaN never the best (and counted as no improvement), a resumed state kept only for the
    same number watched the same way."""
    from megalm.training.monitor import Monitor
    acc = Monitor("val_acc", patience=2)
    assert acc.mode == "max" and Monitor("val_ppl").mode == "min"
    assert acc.update({"val_acc": float("nan")}, 0) is False and acc.best is None and acc.stale == 1
    assert acc.update({"val_acc": 0.5}, 10) is True and acc.stale == 0
    assert acc.update({"val_acc": 0.4}, 20) is False and not acc.exhausted
    assert acc.update({"val_acc": float("nan")}, 30) is False and acc.exhausted
    resumed = Monitor("val_acc", patience=2)
    resumed.load_state_dict(acc.state_dict())
    assert (resumed.best, resumed.best_step, resumed.exhausted) == (0.5, 10, True)
    other = Monitor("val_loss", patience=2)
    other.load_state_dict(acc.state_dict())
    assert (other.best, other.stale) == (None, 0)
