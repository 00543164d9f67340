"""Checkpoint integrity: manifests and the fallback past a damaged folder, the shape-mismatch
report, SIGKILL during and after a save, bitwise resume, and async saves equal to sync ones."""

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megalm.config import CheckpointConfig
from megalm.train import run
from megalm.training.checkpoint import Checkpointer, CorruptCheckpointError
from megalm.training.manifest import MANIFEST, verify, write_manifest
from test_train import TINY, load, records

# Dropout on, so a resume must restore the RNG to repeat the curve; a save every 2 steps.
COMMON = [*TINY, "model.dropout=0.1", "trainer.eval_interval=0", "trainer.max_steps=6", "checkpoint.interval=2",
          "checkpoint.keep_last=0"]


def losses(run_dir: Path):
    """step -> loss of the last time each step ran (a resumed run logs the steps it repeats again)."""
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def stored(step_dir: Path, tmp_path: Path) -> dict:
    """Every tensor and object a DCP folder holds, by its flattened key (no model needed)."""
    out = tmp_path / f"{step_dir.parent.parent.name}_{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, value in a["optim"].items():
        assert torch.equal(value, b["optim"][key]) if torch.is_tensor(value) else value == b["optim"][key], key
    assert torch.equal(a["rng"]["cpu"], b["rng"]["cpu"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 6-step run every interrupted one is compared with."""
    d = tmp_path_factory.mktemp("straight")
    run(load(*COMMON), d)
    return d


# -- manifest and fallback -----------------------------------------------------------------------

def test_manifest_names_truncated_flipped_and_missing_files(tmp_path):
    data = {"a.distcp": b"x" * 1000, "b.distcp": bytes(range(256)), "c.json": b"{}"}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    records_ = write_manifest(tmp_path)
    assert records_ == {n: {"size": len(c), "crc32": zlib.crc32(c)} for n, c in data.items()}
    assert verify(tmp_path) == []
    (tmp_path / "a.distcp").write_bytes(b"x" * 600)  # truncated
    (tmp_path / "b.distcp").write_bytes(bytes([1]) + bytes(range(1, 256)))  # one byte changed, same size
    (tmp_path / "c.json").unlink()
    problems = verify(tmp_path)
    assert len(problems) == 3
    assert problems[0].startswith("a.distcp: 600 bytes, the manifest records 1000")
    assert problems[1].startswith("b.distcp: CRC-32") and f"{zlib.crc32(data['b.distcp']):#010x}" in problems[1]
    assert problems[2] == "c.json: missing (the manifest records 2 bytes)"
    (tmp_path / MANIFEST).write_text('{"files": ')  # the manifest itself cut short
    assert verify(tmp_path)[0].startswith(f"{MANIFEST}: unreadable")


def test_damaged_newest_checkpoint_is_reported_and_the_previous_one_resumed(tmp_path, straight, caplog):
    run(load(*COMMON, "trainer.max_steps=6", "trainer.exit_interval=4"), tmp_path)
    shard = tmp_path / "checkpoints" / "step_00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # a copy cut short
    with caplog.at_level(logging.WARNING, logger="megalm.checkpoint"):
        run(load(*COMMON), tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    assert str(shard.parent) in warning and "__0_0.distcp" in warning and "truncated" in warning
    steps = [r["step"] for r in records(tmp_path) if "loss" in r]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6]  # resumed at 2, and step 4 saved again over the damaged one
    assert losses(tmp_path) == losses(straight)
    assert verify(shard.parent) == []


def test_explicit_load_of_a_damaged_checkpoint_fails_naming_path_and_file(tmp_path):
    run(load(*COMMON, "trainer.max_steps=2"), tmp_path / "src")
    step = tmp_path / "src" / "checkpoints" / "step_00000002"
    meta = step / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    meta.write_bytes(bytes(raw))
    for given in (step, step.parent):  # a step folder, or a checkpoint dir through `latest`
        with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {step} failed verification: \.metadata: CRC-32"):
            run(load(*COMMON, f"checkpoint.load={given}"), tmp_path / "dst")
    # Auto-resume has nothing older to fall back to: an error too, never a silent fresh start.
    with pytest.raises(CorruptCheckpointError, match=r"no checkpoint in .* verifies"):
        Checkpointer(CheckpointConfig(), tmp_path / "src").latest()


def test_checkpoint_without_manifest_loads_with_a_warning(tmp_path, caplog):
    """Folders written before manifests existed are still resumed, unverified, with a warning."""
    run(load(*COMMON, "trainer.max_steps=2"), tmp_path)
    step = tmp_path / "checkpoints" / "step_00000002"
    (step / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="megalm.checkpoint"):
        assert Checkpointer(CheckpointConfig(), tmp_path).latest() == step
    assert any(f"has no {MANIFEST}" in r.getMessage() for r in caplog.records)


# -- shape mismatch ------------------------------------------------------------------------------

def test_shape_mismatch_lists_each_tensor_with_stored_and_expected_shapes(tmp_path):
    run(load(*COMMON, "trainer.max_steps=2"), tmp_path / "src")
    ckpt = tmp_path / "src" / "checkpoints"
    with pytest.raises(ValueError) as wider:
        run(load(*COMMON, f"checkpoint.load={ckpt}", "model.hidden_size=48", "model.num_layers=3"), tmp_path / "a")
    msg = str(wider.value)
    # gpt_tiny: hidden 32, 4 heads, ffn 4 x hidden, vocab 256 (no padding at tp 1), 2 layers of 12 tensors.
    assert "shapes differ (29)" in msg  # every stored tensor has a hidden dimension
    for line in ("embed.tok.weight: stored (256, 32), expected (256, 48)",
                 "blocks.0.attn.qkv.weight: stored (96, 32), expected (144, 48)",
                 "blocks.1.mlp.fc2.weight: stored (32, 128), expected (48, 192)",
                 "norm.bias: stored (32,), expected (48,)"):
        assert line in msg
    assert "in the model, not in the checkpoint (12)" in msg and "blocks.2.attn.qkv.weight" in msg
    with pytest.raises(ValueError) as shallower:
        run(load(*COMMON, f"checkpoint.load={ckpt}", "model.num_layers=1"), tmp_path / "b")
    msg = str(shallower.value)
    assert "shapes differ" not in msg and "in the checkpoint, not in the model (12)" in msg
    assert "blocks.1.mlp.fc1.bias" in msg and "blocks.0." not in msg


# -- SIGKILL -------------------------------------------------------------------------------------

def start_cli(run_dir: Path, overrides, hook: str) -> subprocess.Popen:
    """`python -m megalm.train` with `hook` run first (to stop it at a chosen point)."""
    code = textwrap.dedent(hook) + textwrap.dedent("""
        import sys
        from megalm.train import main
        sys.argv = ["megalm.train", *sys.argv[1:]]
        main()
    """)
    return subprocess.Popen([sys.executable, "-c", code, *overrides, f"hydra.run.dir={run_dir}"],
                            cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def logged_steps(run_dir: Path):
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()
            if '"loss"' in line] if metrics.exists() else []


def kill_when(proc: subprocess.Popen, flag: Path, until=lambda: True, timeout: float = 120) -> None:
    """SIGKILL `proc` once `flag` exists and `until()` holds."""
    deadline = time.monotonic() + timeout
    while not (flag.exists() and until()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the hook never fired:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, straight, mode):
    run_dir, flag = tmp_path / "run", tmp_path / "writing"
    # Hold the write of step 4 after DCP wrote every shard and .metadata, before megalm commits it.
    hook = f"""
        import pathlib, time
        from torch.distributed.checkpoint import filesystem
        finish = filesystem._FileSystemWriter.finish
        def slow_finish(self, *args, **kwargs):
            finish(self, *args, **kwargs)
            if "step_00000004" in str(self.path):
                pathlib.Path({str(flag)!r}).touch()
                time.sleep(600)
        filesystem._FileSystemWriter.finish = slow_finish
    """
    overrides = [*COMMON, f"checkpoint.async_save={mode == 'async'}"]
    run_dir.mkdir()
    # Async: training goes on during the held write, up to step 6, whose save waits for step 4's.
    last = 4 if mode == "sync" else 6
    kill_when(start_cli(run_dir, overrides, hook), flag, until=lambda: last in logged_steps(run_dir))
    ckpt = run_dir / "checkpoints"
    assert (ckpt / ".step_00000004.tmp" / ".metadata").exists() and not (ckpt / "step_00000004").exists()
    assert Checkpointer(CheckpointConfig(), run_dir).latest() == ckpt / "step_00000002"
    run(load(*overrides), run_dir)  # auto-resume in the same run directory
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert steps == [*range(1, last + 1), 3, 4, 5, 6]  # resumed at 2
    assert losses(run_dir) == losses(straight)


def test_sigkill_after_a_checkpoint_resumes_with_bitwise_identical_losses(tmp_path, straight):
    run_dir, flag = tmp_path / "run", tmp_path / "killed"
    # Freeze the run as it starts step 6: steps 1-5 are done, step 4's checkpoint has landed.
    hook = f"""
        import pathlib, time
        from megalm.training.trainer import Trainer
        train_step = Trainer.train_step
        def stop_before_step_6(self):
            if self.step == 5:
                pathlib.Path({str(flag)!r}).touch()
                time.sleep(600)
            return train_step(self)
        Trainer.train_step = stop_before_step_6
    """
    run_dir.mkdir()
    kill_when(start_cli(run_dir, COMMON, hook), flag)
    first = [r["loss"] for r in records(run_dir) if "loss" in r]
    ref = losses(straight)
    assert first == [ref[s] for s in range(1, 6)]
    restart = subprocess.run([sys.executable, "-m", "megalm.train", *COMMON, f"hydra.run.dir={run_dir}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert restart.returncode == 0, restart.stderr[-3000:]
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 5, 6]  # resumed at 4: step 5 again, then 6
    assert losses(run_dir) == ref  # ==, not approx: RNG, data position and optimizer state all restored


# -- async save ----------------------------------------------------------------------------------

def test_async_save_writes_the_sync_checkpoint_and_resumes_the_same_curve(tmp_path, straight):
    d = tmp_path / "async"
    async_ = [*COMMON, "checkpoint.async_save=true"]
    run(load(*async_, "trainer.exit_interval=4"), d)  # the step 4 save is still in flight at the exit
    assert (d / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    run(load(*async_), d)  # resumes at 4; the save at the end (step 6) lands before run returns
    for step in ("step_00000002", "step_00000004", "step_00000006"):
        a, b = d / "checkpoints" / step, straight / "checkpoints" / step
        assert verify(a) == [] and (a / MANIFEST).exists()
        assert_same_state(stored(a, tmp_path), stored(b, tmp_path))
        assert json.loads((a / "trainer_state.json").read_text()) == json.loads((b / "trainer_state.json").read_text())
    assert losses(d) == losses(straight)


def test_async_save_keeps_the_state_of_its_step_while_training_changes_it(tmp_path):
    from megalm.config import ModelConfig
    from megalm.models import build_model, init_weights
    cfg = ModelConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    model = build_model(cfg)
    init_weights(model, cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long)).backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saver = Checkpointer(CheckpointConfig(async_save=True), tmp_path)
    saver.save(1, model, optimizer, {"consumed_samples": 0})
    with torch.no_grad():  # the next step changes the parameters in place while the write may run
        for p in model.parameters():
            p.add_(1.0)
    saver.finish()
    fresh = build_model(cfg)
    with torch.random.fork_rng():  # loading restores the saved RNG state: keep this process's own
        saver.load(tmp_path / "checkpoints", fresh, torch.optim.AdamW(fresh.parameters()))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_async_save_without_saving_is_refused():
    with pytest.raises(ValueError, match="checkpoint.async_save=true writes checkpoints in the background, but "
                                         "checkpoint.save=false"):
        load(*TINY, "checkpoint.async_save=true", "checkpoint.save=false")


def test_sigterm_with_async_save_lands_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [*TINY, "trainer.max_steps=1000", "trainer.eval_steps=0", "checkpoint.interval=2",
                 "checkpoint.async_save=true"]
    proc = start_cli(run_dir, overrides, "")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    last = max(r["step"] for r in records(run_dir) if "loss" in r)
    step = run_dir / "checkpoints" / f"step_{last:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == step.name
    assert (step / MANIFEST).exists() and verify(step) == []
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def _sync_then_async(rank, world, overrides, out):
    """Straight with sync saves; then async, stopped at step 2 and resumed."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.validation import validate
    for name, extra in (("sync", []), ("async", ["trainer.exit_interval=2"]), ("async", [])):
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            cfg = OmegaConf.to_object(compose("config", overrides=[
                *overrides, *extra, f"checkpoint.async_save={name == 'async'}"]))
        validate(cfg, world)
        run(cfg, Path(out) / name, world)


RANK_LAYOUTS = {"tp2": ["parallel=tp2", "model.attention_dropout=0.1"],  # the per-tp-rank "tp" stream
                "pp2": ["parallel=pp2"]}  # stages draw dropout for different layers: their default streams part


def _every_layout(rank, world, out):
    for layout, overrides in RANK_LAYOUTS.items():  # one set of ranks for both (process start-up dominates)
        _sync_then_async(rank, world, [*COMMON, "trainer.max_steps=4", *overrides], str(Path(out) / layout))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    from distributed import run_ranks
    out = tmp_path_factory.mktemp("two_ranks")
    run_ranks(2, _every_layout, str(out))
    return out


@pytest.mark.parametrize("layout", RANK_LAYOUTS)
def test_async_save_and_resume_on_two_ranks_match_the_sync_run(two_rank_runs, tmp_path, layout):
    """Gloo ranks: DCP's background collectives run beside training's, and each rank's own random
    streams come back, so the resumed async run repeats the sync run bit for bit."""
    sync, async_ = two_rank_runs / layout / "sync", two_rank_runs / layout / "async"
    for step in ("step_00000002", "step_00000004"):
        assert verify(async_ / "checkpoints" / step) == []
        assert_same_state(stored(sync / "checkpoints" / step, tmp_path), stored(async_ / "checkpoints" / step, tmp_path))
    steps = [r["step"] for r in records(async_) if "loss" in r]
    assert steps == [1, 2, 3, 4]  # stopped at 2, resumed at 2
    assert losses(async_) == losses(sync)


def test_a_step_folder_carries_the_resolved_config(straight, tmp_path):
    """A step folder copied away from its run still says what it holds: config.yaml inside,
    covered by the manifest, enough for the converter to find the model."""
    import shutil
    from omegaconf import OmegaConf
    from megalm.convert.hf import locate_checkpoint
    alone = tmp_path / "step_00000004"
    shutil.copytree(straight / "checkpoints" / "step_00000004", alone)
    saved = OmegaConf.load(alone / "config.yaml")
    assert OmegaConf.to_container(saved) == OmegaConf.to_container(OmegaConf.load(straight / "config.yaml"))
    assert "config.yaml" in json.loads((alone / MANIFEST).read_text())["files"]
    step_dir, model_cfg, _ = locate_checkpoint(alone)
    assert step_dir == alone and model_cfg.num_layers == saved.model.num_layers
    assert model_cfg.hidden_size == saved.model.hidden_size
