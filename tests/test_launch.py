"""Multi-rank launch on this machine: through the CLI, and a failing rank stops the job."""

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from megalm.config import Config
from megalm.launch import spawn_local


def _fail_on_rank_1(cfg, run_dir):
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def body():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("boom on rank 1")
        dist.barrier()  # rank 0 would wait here forever without the agent stopping it
    return body()


def test_a_failing_rank_stops_the_job_with_its_traceback(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg: Config = OmegaConf.to_object(compose("config", overrides=["model=gpt_tiny"]))
    with pytest.raises(SystemExit) as e:
        spawn_local(cfg, tmp_path, 2, entrypoint=_fail_on_rank_1)
    msg = str(e.value)
    assert msg.startswith("megalm: rank 1 failed") and "boom on rank 1" in msg and "ValueError" in msg


def test_train_cli_tp2_end_to_end(tmp_path):
    args = ["model=gpt_tiny", "data=mock", "parallel=tp2", "parallel.sequence_parallel=true",
            "trainer.max_steps=3", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
            "trainer.eval_steps=1", "trainer.log_interval=1", f"hydra.run.dir={tmp_path / 'run'}"]
    r = subprocess.run([sys.executable, "-m", "megalm.train", *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == 3  # rank 0 alone writes metrics
    assert (run_dir / "config.yaml").exists() and (run_dir / "train.log").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    log = (run_dir / "train.log").read_text()
    assert "[rank 1]" not in log
    # the progress bar is on (the default), and the log still has a line for every log_interval, once
    assert [sum(f"step {k}/3 loss" in line for line in log.splitlines()) for k in (1, 2, 3)] == [1, 1, 1]
    assert "MFU is against a fp32 matmul measured now on this cpu" in log  # cluster=local names its denominator
    from megalm.report import run_title
    # curves.png is titled with what the command set (Hydra's overrides, the run directory's left out)
    assert run_title(run_dir) == "gpt_tiny: " + " ".join(args[:-1])
    last = [json.loads(line) for line in lines if '"loss"' in line][-1]
    assert len(last["peak_mem_gb_per_rank"]) == 2 and all(m > 0 for m in last["peak_mem_gb_per_rank"])


def test_pp2_training_then_generation_from_its_checkpoint(tmp_path):
    args = ["model=gpt_tiny", "data=mock", "parallel=pp2", "trainer.max_steps=2", "trainer.micro_batch_size=2",
            "trainer.global_batch_size=8", "trainer.eval_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    r = subprocess.run([sys.executable, "-m", "megalm.train", *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss" in r.stdout + r.stderr  # the last stage's loss reached rank 0's log
    g = subprocess.run([sys.executable, "-m", "megalm.generate", str(tmp_path / "run"), "--prompt", "1 2 3",
                        "--max-new-tokens", "5", "--temperature", "0"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert g.returncode == 0, g.stderr[-3000:]
    assert "step 2" in g.stderr and g.stdout.startswith("1 2 3")


def test_under_torchrun_each_process_is_a_rank(tmp_path):
    run_dir = tmp_path / "run"
    # --standalone: the rendezvous takes a free port itself, so concurrent runs never clash.
    args = ["--standalone", "--nproc-per-node", "2", "-m", "megalm.train", "model=gpt_tiny", "data=mock", "parallel=dp2",
            "trainer.max_steps=2", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
            "trainer.eval_steps=1", "trainer.progress_bar=false", "trainer.log_interval=1",
            f"hydra.run.dir={run_dir}"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (r.stdout + r.stderr).count("saved checkpoint") == 1  # rank 0 alone reports
    assert sum('"loss"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def _rank_1_dies_once(cfg, run_dir):
    import os
    from megalm.launch import rank_main
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == "1":
        import megalm.training.trainer as trainer_mod
        original = trainer_mod.Trainer.train_step

        def dies_at_step_4(self):
            if self.step == 3:
                raise RuntimeError("rank 1 lost its machine")
            return original(self)

        trainer_mod.Trainer.train_step = dies_at_step_4
    return rank_main(cfg, run_dir)


def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.train import run
    register_configs()
    common = ["model=gpt_tiny", "data=mock", "trainer.max_steps=5", "trainer.micro_batch_size=4",
              "trainer.global_batch_size=8", "trainer.eval_steps=0", "trainer.log_interval=1",
              "trainer.progress_bar=false", "trainer.num_threads=1", "checkpoint.interval=2"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        flaky = OmegaConf.to_object(compose("config", overrides=[*common, "parallel=dp2", "cluster.max_restarts=1"]))
        single = OmegaConf.to_object(compose("config", overrides=common))
    spawn_local(flaky, tmp_path / "flaky", 2, entrypoint=_rank_1_dies_once)
    run(single, tmp_path / "single", 1)

    def losses(d):
        return [(r["step"], r["loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if "loss" in r]

    got, ref = losses(tmp_path / "flaky"), dict(losses(tmp_path / "single"))
    assert [step for step, _ in got] == [1, 2, 3, 4, 5]  # each step once: the lost attempt's step 3 is gone
    assert [loss for _, loss in got] == pytest.approx([ref[s] for s in range(1, 6)], rel=1e-5)
    log = (tmp_path / "flaky" / "train.log").read_text()
    assert "resuming at step 2" in log  # the restarted ranks began at the step-2 checkpoint, not from scratch
    assert (tmp_path / "flaky" / "checkpoints" / "latest").read_text().strip() == "step_00000005"


def test_after_a_signal_no_keep_alive_timer_is_left_to_be_freed_on_its_own_thread():
    """On a signal torch's launcher leaves its rendezvous keep-alive timer running. Freed on the timer's own thread
    (a heartbeat holds its handler), the timer's finalizer would join that thread and Python would print the
    ignored RuntimeError on the user's terminal, as it once did in the stop-signal test. spawn_local cancels
    the timers first; here a timer whose heartbeat holds the handler stands in for torch's."""
    import threading
    import time
    import weakref
    from datetime import timedelta
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer
    from megalm.launch import _stop_rendezvous_heartbeats

    class Handler:
        pass

    beating = threading.Event()

    def heartbeat(ref):
        held = ref()  # as torch's keep-alive does: a strong reference while the beat lasts
        beating.set()
        time.sleep(0.3)
        del held

    handler = Handler()
    handler.timer = _PeriodicTimer(timedelta(seconds=0.01), heartbeat, weakref.ref(handler))
    handler.timer.start()
    thread = handler.timer._thread
    ignored, hook = [], sys.unraisablehook
    sys.unraisablehook = ignored.append
    try:
        assert beating.wait(30)
        _stop_rendezvous_heartbeats()
        del handler  # the last reference outside a heartbeat in flight, if the timer still beats
        thread.join(30)
        time.sleep(0.1)
    finally:
        sys.unraisablehook = hook
    assert not thread.is_alive()
    assert not ignored, [f"{type(u.exc_value).__name__}: {u.exc_value}" for u in ignored]


@pytest.mark.parametrize("env,named", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"RANK": "first", "WORLD_SIZE": "2"}, "RANK='first'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0.5"}, "LOCAL_RANK='0.5'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two'"),
    ({"SLURM_PROCID": "", "SLURM_NTASKS": "2"}, "SLURM_PROCID=''"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x'"),
])
def test_a_launcher_variable_that_is_not_a_number_is_named(monkeypatch, env, named):
    """`WORLD_SIZE=abc python -m megalm.train` names the variable and its value, not int()'s "invalid literal"."""
    from megalm.errors import ConfigError
    from megalm.launch import detect_rank_env
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        detect_rank_env()
    assert str(e.value).startswith(f"{named} in the environment must be a whole number"), str(e.value)
    monkeypatch.setenv(named.split("=")[0], "2")
    assert detect_rank_env().world_size == 2  # a number there, the launcher's ranks are read as before
