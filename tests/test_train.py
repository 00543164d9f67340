"""End-to-end runs: the CLI, resume, sweeps and generation (tiny models, a few steps)."""

import math
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from megalm.train import run
from tiny_run import TINY, load, records


def cli(module, *args, cwd):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_train_cli_has_a_pulse_and_generate_samples(tmp_path):
    # The real default pipeline (stdlib corpus, sentencepiece trained here), kept small.
    run_dir = tmp_path / "run"
    stdlib = ["data=stdlib", "data.max_corpus_mb=0.3", "data.split='80,20,0'", "data.tokenizer.vocab_size=512", "model.vocab_size=512",
              f"data.cache_dir={tmp_path / 'cache'}"]
    r = cli("megalm.train", *TINY, *stdlib, "trainer.max_steps=6", "trainer.eval_interval=3",
            f"hydra.run.dir={run_dir}", cwd=tmp_path)
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
    assert (run_dir / "tokenizer.model").exists()


def test_cfg_job_and_help_behave_as_in_any_hydra_app(tmp_path):
    r = cli("megalm.train", "trainer.max_steps=50", "optimizer.lr=3e-4", "model=gpt_125m", "--cfg", "job",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = OmegaConf.create(r.stdout)
    assert (cfg.trainer.max_steps, cfg.optimizer.lr, cfg.model.num_layers) == (50, 3e-4, 12)
    h = cli("megalm.train", "--help", cwd=tmp_path)
    assert h.returncode == 0 and "model: " in h.stdout and "gpt_175b" in h.stdout
    assert not (tmp_path / "outputs").exists()  # neither starts a run


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


def test_resume_matches_uninterrupted_run(tmp_path, monkeypatch):
    common = [*TINY, "model.dropout=0.1", "trainer.eval_interval=0", "trainer.max_steps=8"]
    straight = tmp_path / "straight"
    run(load(*common), straight)
    split = tmp_path / "split"
    run(load(*common, "trainer.exit_interval=4"), split)  # saves at step 4 and stops there
    assert (split / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert max(r["step"] for r in records(split) if "loss" in r) == 4
    from megalm.training.trainer import Trainer
    ran = []
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: ran.append(self.step) or original(self))
    run(load(*common), split)  # same run dir: auto-resumes from step 4
    assert ran == [4, 5, 6, 7]  # the second start ran steps 5..8 only: it began at the checkpoint
    a = {r["step"]: r["loss"] for r in records(straight) if "loss" in r}
    b = [(r["step"], r["loss"]) for r in records(split) if "loss" in r]
    assert [step for step, _ in b] == list(range(1, 9))  # each step once
    for step, loss in b[4:]:
        assert loss == pytest.approx(a[step], rel=1e-6), step


def test_metrics_after_a_lost_attempt_hold_each_step_once(tmp_path):
    import shutil
    common = [*TINY, "trainer.eval_interval=2", "checkpoint.interval=2", "checkpoint.keep_last=0"]
    run(load(*common, "trainer.max_steps=4"), tmp_path)
    # As if the job died after logging steps 3-4 but before step 4's checkpoint was published.
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
    run(load(*common, "trainer.max_steps=4"), tmp_path)
    recs = records(tmp_path)
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 2, 4]


def test_wandb_offline(tmp_path):
    run(load(*TINY, "trainer.max_steps=2", "logging.wandb.mode=offline"), tmp_path / "w")
    assert list((tmp_path / "w" / "wandb").glob("offline-run-*"))


def test_half_written_checkpoint_is_not_resumed(tmp_path):
    common = [*TINY, "trainer.eval_steps=0", "checkpoint.interval=2"]
    run(load(*common, "trainer.max_steps=2"), tmp_path)
    ckpt = tmp_path / "checkpoints"
    # A save killed midway leaves only its temporary folder; `latest` still names step 2.
    (ckpt / ".step_00000004.tmp").mkdir()
    (ckpt / ".step_00000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    run(load(*common, "trainer.max_steps=4"), tmp_path)
    steps = [r["step"] for r in records(tmp_path) if "loss" in r]
    assert steps == [1, 2, 3, 4]  # resumed at 2, not at the half-written 4
    assert (ckpt / "latest").read_text().strip() == "step_00000004"


def test_keep_last_prunes_older_checkpoints(tmp_path):
    run(load(*TINY, "trainer.eval_steps=0", "trainer.max_steps=5", "checkpoint.interval=1",
             "checkpoint.keep_last=2"), tmp_path)
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000004", "step_00000005"]
    assert (ckpt / "latest").read_text().strip() == "step_00000005"


def test_bad_layout_fails_before_allocating(tmp_path):
    r = cli("megalm.train", "model=gpt_175b", "parallel=tp8_pp16", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert r.returncode != 0
    assert "128 ranks" in r.stderr and "torchrun" in r.stderr
    assert not (tmp_path / "r" / "config.yaml").exists()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])  # Slurm's --signal=USR1@... warning, too
def test_stop_signal_saves_and_exits_cleanly_then_resumes(tmp_path, signame):
    import signal
    import time
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.max_steps=100000", "trainer.eval_steps=0", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "megalm.train", *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signame))  # as a cluster scheduler does before preempting
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "a stop signal arrived" in out
    saved = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert saved >= 3 and max(r["step"] for r in records(run_dir) if "loss" in r) == saved
    run(load(*TINY, "trainer.max_steps=100000", "trainer.eval_steps=0", "trainer.exit_interval=1"), run_dir)
    assert max(r["step"] for r in records(run_dir) if "loss" in r) == saved + 1  # resumed where it stopped
