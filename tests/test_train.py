"""End-to-end runs: the CLI, resume, sweeps and generation (tiny models, a few steps)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megalm.config import conf_dir, register_configs, validate
from megalm.train import run

register_configs()
TINY = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
        "trainer.eval_steps=2", "trainer.log_interval=1", "trainer.progress_bar=false",
        "optimizer.warmup_steps=2", "trainer.num_threads=1", "cluster.peak_flops=1e12"]


def load(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=list(overrides)))
    validate(cfg, 1)
    return cfg


def records(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cli(module, *args, cwd):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_train_cli_has_a_pulse_and_generate_samples(tmp_path):
    run_dir = tmp_path / "run"
    r = cli("megalm.train", *TINY, "trainer.max_steps=6", "trainer.eval_interval=3", f"hydra.run.dir={run_dir}",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    frozen = OmegaConf.load(run_dir / "config.yaml")
    assert frozen.trainer.max_steps == 6 and frozen.model.name == "gpt_tiny"
    assert "${" not in (run_dir / "config.yaml").read_text()  # resolved, nothing left to interpolate
    recs = records(run_dir)
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 3, 6]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] for r in recs if "loss" in r)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert "validation loss" in r.stdout + r.stderr

    g = cli("megalm.generate", str(run_dir), "--prompt", "", "--max-new-tokens", "8", "--seed", "1", cwd=tmp_path)
    assert g.returncode == 0, g.stderr[-3000:]
    assert "step 6" in g.stderr


def test_sweep_runs_each_job_in_its_own_dir(tmp_path):
    r = cli("megalm.train", "-m", *TINY, "trainer.max_steps=2", "optimizer.lr=1e-3,3e-4",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lrs = sorted(OmegaConf.load(tmp_path / "sweep" / str(i) / "config.yaml").optimizer.lr for i in (0, 1))
    assert lrs == [3e-4, 1e-3]
    for i in (0, 1):
        assert any("val_loss" in rec for rec in records(tmp_path / "sweep" / str(i)))


def test_task_function_returns_final_val_loss(tmp_path):
    cfg = load(*TINY, "trainer.max_steps=3")
    val = run(cfg, tmp_path)
    last = [r for r in records(tmp_path) if "val_loss" in r][-1]
    assert val == last["val_loss"] and math.isfinite(val)


def test_resume_matches_uninterrupted_run(tmp_path):
    common = [*TINY, "model.dropout=0.1", "optimizer.decay_steps=8", "trainer.eval_interval=0"]
    straight = tmp_path / "straight"
    run(load(*common, "trainer.max_steps=8"), straight)
    split = tmp_path / "split"
    run(load(*common, "trainer.max_steps=4"), split)
    assert (split / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    run(load(*common, "trainer.max_steps=8"), split)  # same run dir: auto-resumes from step 4
    a = {r["step"]: r["loss"] for r in records(straight) if "loss" in r}
    b = {r["step"]: r["loss"] for r in records(split) if "loss" in r}
    assert sorted(b) == list(range(1, 9))
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-6), step


def test_bad_layout_fails_before_allocating(tmp_path):
    r = cli("megalm.train", "model=gpt_175b", "parallel=tp8_pp16", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert r.returncode != 0
    assert "128 ranks" in r.stderr and "torchrun" in r.stderr
    assert not (tmp_path / "r" / "config.yaml").exists()
