"""Checkpoint integrity: manifests and the fallback past a damaged folder, the shape-mismatch
report, SIGKILL during and after a save (one process, and whole two-rank jobs at tp2 and pp2),
bitwise resume, SIGTERM on one rank stopping every rank at one step, and async saves equal to
sync ones."""

import json
import logging
import os
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
from megalm.errors import MissingFileError
from megalm.training.checkpoint import Checkpointer, CorruptCheckpointError, resolve
from megalm.training.checkpoint.manifest import MANIFEST, verify, write_manifest
from tiny_run import TINY, load, records

# Dropout on, so a resume must restore the RNG to repeat the curve; a save every 2 steps.
COMMON = [*TINY, "logging.curves=false", "model.dropout=0.1", "trainer.eval_interval=0", "trainer.max_steps=6", "checkpoint.interval=2",
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
    with caplog.at_level(logging.WARNING, logger="megalm.checkpoint"), \
            caplog.at_level(logging.INFO, logger="megalm.trainer"):
        run(load(*COMMON), tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    assert str(shard.parent) in warning and "__0_0.distcp" in warning and "truncated" in warning
    assert "resuming at step 2" in caplog.text  # and step 4 saved again over the damaged one
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
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


def test_checkpoint_load_takes_a_run_directory_and_says_what_else_it_was_given(straight, tmp_path):
    """checkpoint.load=RUN (as generate, serve and convert take it) loads the run's latest step; a Hugging
    Face folder, or a run that saved nothing, is refused with what to do."""
    assert resolve(straight) == straight / "checkpoints" / "step_00000006"
    run(load(*COMMON, "trainer.max_steps=1", f"checkpoint.load={straight}", "checkpoint.finetune=true"),
        tmp_path / "tuned")
    assert stored(tmp_path / "tuned" / "checkpoints" / "step_00000001", tmp_path)["model"].keys() == \
        stored(straight / "checkpoints" / "step_00000006", tmp_path)["model"].keys()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(MissingFileError, match=rf"{hf} looks like a Hugging Face folder: `python -m megalm.convert "
                                              rf"import {hf} OUT`"):
        resolve(hf)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text("checkpoint:\n  dir: saved\n")
    with pytest.raises(MissingFileError, match=rf"{bare} is a run directory with no checkpoint in {bare / 'saved'}"):
        resolve(bare)


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
def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, straight, mode, caplog):
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
    with caplog.at_level(logging.INFO, logger="megalm.trainer"):
        run(load(*overrides), run_dir)  # auto-resume in the same run directory
    assert "resuming at step 2" in caplog.text
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
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
    assert "resuming at step 4" in (run_dir / "train.log").read_text()  # step 5 again, then 6
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
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
    from megalm.models.gpt.config import GPTConfig
    from megalm.models import build_model, init_weights
    cfg = GPTConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    model = build_model(cfg)
    init_weights(model, cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 16, dtype=torch.long), labels=torch.zeros(1, 16, dtype=torch.long)).backward()
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


def _config(overrides, world):
    """`load` for a rank of `world` (load validates for one process)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.validation import validate
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=list(overrides)))
    validate(cfg, world)
    return cfg


def _sync_then_async(rank, world, overrides, out):
    """Straight with sync saves; then async, stopped at step 2 and resumed."""
    for name, extra in (("sync", []), ("async", ["trainer.exit_interval=2"]), ("async", [])):
        cfg = _config([*overrides, *extra, f"checkpoint.async_save={name == 'async'}"], world)
        run(cfg, Path(out) / name, world)


RANK_LAYOUTS = {"tp2": ["parallel=tp2", "model.attention_dropout=0.1"],  # the per-tp-rank "tp" stream
                "pp2": ["parallel=pp2"]}  # stages draw dropout for different layers: their default streams part


def _sigterm_on_rank_1_only(rank, world, out):
    """dp2, 6 steps; as step 3 starts, rank 1 alone gets SIGTERM. What step did each rank stop at?"""
    from megalm.training import trainer as trainer_module
    train_step, done = trainer_module.Trainer.train_step, []

    def signalled_train_step(self):
        if rank == 1 and self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before this step runs: the trainer notes it
        out = train_step(self)
        done.append(self.step)
        return out

    trainer_module.Trainer.train_step = signalled_train_step
    try:
        run(_config([*COMMON, "parallel=dp2"], world), Path(out), world)
    finally:
        trainer_module.Trainer.train_step = train_step
    return {"last_step": done[-1], "stopped_on_signal": trainer_module.stopped_on_signal()}


def _two_rank_runs(rank, world, out):
    # One set of ranks for everything here (process start-up dominates): tp2 and pp2, then SIGTERM.
    for layout, overrides in RANK_LAYOUTS.items():
        _sync_then_async(rank, world, [*COMMON, "trainer.max_steps=4", *overrides], str(Path(out) / layout))
    return _sigterm_on_rank_1_only(rank, world, str(Path(out) / "sigterm"))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Per layout: sync (the uninterrupted reference) and async runs; then the SIGTERM run's rank results."""
    from distributed import run_ranks
    out = tmp_path_factory.mktemp("two_ranks")
    return out, run_ranks(2, _two_rank_runs, str(out), timeout=480)


@pytest.mark.parametrize("layout", RANK_LAYOUTS)
def test_async_save_and_resume_on_two_ranks_match_the_sync_run(two_rank_runs, tmp_path, layout):
    """Gloo ranks: DCP's background collectives run beside training's, and each rank's own random
    streams come back, so the resumed async run repeats the sync run bit for bit."""
    sync, async_ = two_rank_runs[0] / layout / "sync", two_rank_runs[0] / layout / "async"
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


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_saved_step(two_rank_runs):
    """Only rank 1 is signalled; the trainer's agreement (an all-reduce of the flag) makes rank 0
    stop after the same step, both save it, and both return as from a finished run."""
    out, results = two_rank_runs
    assert results == [{"last_step": 3, "stopped_on_signal": True}] * 2
    run_dir = out / "sigterm"
    step = run_dir / "checkpoints" / "step_00000003"  # not an interval step: saved for the signal
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == step.name
    assert verify(step) == [] and (step / MANIFEST).exists()
    assert max(losses(run_dir)) == 3


# -- SIGKILL of a whole multi-rank job -----------------------------------------------------------

# Put on PYTHONPATH for the killed job: every process of it (the launcher and the ranks it spawns,
# which run no code of the parent's command line) patches the trainer to stop as step FREEZE_AT + 1
# starts, after step FREEZE_AT is logged, and says so with a file per rank.
FREEZE_HOOK = """
import os
if os.environ.get("MEGALM_TEST_FREEZE_AT"):
    import pathlib, time
    from megalm.training.trainer import Trainer
    _train_step = Trainer.train_step
    def _frozen(self):
        if self.step == int(os.environ["MEGALM_TEST_FREEZE_AT"]):
            pathlib.Path(os.environ["MEGALM_TEST_FLAGS"], "rank" + os.environ.get("RANK", "0")).touch()
            time.sleep(600)
        return _train_step(self)
    Trainer.train_step = _frozen
"""


def kill_job_when_frozen(cmd, run_dir: Path, tmp_path: Path, world: int) -> None:
    """Run `cmd` (it spawns `world` ranks) until every rank is frozen, then SIGKILL the whole job."""
    hook, flags = tmp_path / "hook", tmp_path / "flags"
    hook.mkdir()
    flags.mkdir()
    (hook / "sitecustomize.py").write_text(FREEZE_HOOK)
    env = {**os.environ, "MEGALM_TEST_FREEZE_AT": "3", "MEGALM_TEST_FLAGS": str(flags),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    with open(tmp_path / "killed.log", "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: the launcher and its ranks
    try:
        deadline = time.monotonic() + 600  # generous: start-up of 3 processes on a loaded machine
        while len(list(flags.iterdir())) < world:
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"the job never froze:\n{(tmp_path / 'killed.log').read_text()[-3000:]}"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    deadline = time.monotonic() + 120
    while live_members(proc.pid):  # the ranks too, before anything reads the run directory
        assert time.monotonic() < deadline, f"processes of the killed job still run: {live_members(proc.pid)}"
        time.sleep(0.1)


def live_members(pgid: int):
    """Pids of the process group's processes that still run (zombies left to an init that may not reap don't)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


# The kill is the same at any layout: each rank's own state coming back is checked at tp2 and pp2 by
# test_async_save_and_resume_on_two_ranks_match_the_sync_run.
@pytest.mark.parametrize("layout", ["tp2"])
def test_sigkill_of_a_two_rank_job_resumes_with_bitwise_identical_losses(two_rank_runs, tmp_path, layout):
    """kill -9 of the launcher and both ranks after step 2's checkpoint and step 3's log; starting
    again in the run directory repeats steps 3-4 of the uninterrupted run exactly: each rank's RNG
    streams (dropout in tp-sharded and replicated regions), data position and optimizer state come
    back. The reference is the same config run by run_ranks; the killed job's first steps check that
    the CLI's ranks compute the same."""
    reference = losses(two_rank_runs[0] / layout / "sync")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "megalm.train", *COMMON, "trainer.max_steps=4", *RANK_LAYOUTS[layout],
           f"hydra.run.dir={run_dir}"]
    kill_job_when_frozen(cmd, run_dir, tmp_path, world=2)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert losses(run_dir) == {s: reference[s] for s in (1, 2, 3)}  # killed in step 4
    restart = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "resuming at step 2" in (run_dir / "train.log").read_text()
    resumed = losses(run_dir)
    assert {s: resumed[s] for s in (3, 4)} == {s: reference[s] for s in (3, 4)}  # ==, not approx
    assert resumed == reference


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_state_made_for_a_checkpoint_leaves_the_first_step_as_it_was(kind):
    """A save (or a load) before the first step creates the optimizer's lazy state; the first step after it is the
    fresh optimizer's to the bit (torch's own initialiser leaves Adam at step 1: another bias correction)."""
    from megalm.parallel.optim_state import create_state
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
            "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)}[kind]
    opts = [make(m.parameters()) for m in models]
    create_state(opts[1], list(models[1].parameters()))
    assert opts[1].state and all(p.grad is None for p in models[1].parameters())
    x = torch.randn(16, 8)
    for _ in range(3):
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
