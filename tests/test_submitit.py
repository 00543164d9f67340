"""hydra/launcher=megalm_local and megalm_slurm (hydra-submitit-launcher with each job's own resources): a
real layout sweep through submitit's local executor, one task a rank, and the sbatch file a SLURM job gets."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

QUICK = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
         "trainer.max_steps=4", "trainer.eval_interval=2", "trainer.eval_steps=1", "trainer.log_interval=1",
         "trainer.progress_bar=false", "trainer.num_threads=1", "cluster.peak_flops=1e12"]


def _val_losses(run_dir: Path):
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["val_loss"] for r in records if "val_loss" in r]


def test_a_layout_sweep_runs_each_job_at_its_own_size_one_task_a_rank(tmp_path):
    """`-m hydra/launcher=megalm_local parallel=single,dp2,tp2`: submitit's local executor runs the three jobs
    at once, dp2 and tp2 as two tasks each (two log files, each a rank, each job its own rendezvous port and
    run directory), and their validation losses equal the single process's (fp32, relative 1e-5): the tasks
    found their ranks and each other, not another job's."""
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "megalm.train", "-m", "hydra/launcher=megalm_local", *QUICK,
                          "parallel=single,dp2,tp2", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tasks_per_node=1" in out.stdout and "tasks_per_node=2" in out.stdout
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "ok"), ("2", "ok")]
    single = _val_losses(sweep / "0")
    assert len(single) == 3
    for job in ("1", "2"):
        assert _val_losses(sweep / job) == pytest.approx(single, rel=1e-5), job
        assert "world 2" in (sweep / job / "train.log").read_text()
    tasks = sorted(n for n in (len(list(job.glob("*_log.out"))) for job in (sweep / ".submitit").iterdir()) if n)
    assert tasks == [1, 2, 2]  # submitit's log a task: job 0 ran one, jobs 1 and 2 two each
    # The two-task jobs met on a port task 0 found free (not submitit's draw from the job id, which can be taken).
    assert len(list((sweep / ".submitit").glob("*/*_rendezvous_port"))) == 2


def _compose(overrides):
    from hydra import compose, initialize_config_dir
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_each_job_is_submitted_with_its_layouts_resources(tmp_path, monkeypatch):
    """megalm_slurm groups a sweep's jobs by the nodes, tasks and GPUs each layout needs (one task a rank,
    cluster.devices_per_node a node; dp=-1 fills the profile's nodes), keeps the sweep's job numbers, takes
    what the user set over what it works out, and returns the results in the sweep's order."""
    jobs = [["parallel=tp2"], ["parallel=tp8_pp16"], ["parallel=tp2_pp2"], ["parallel.tp=8", "parallel.dp=-1"],
            ["parallel=single", "trainer.device=cpu"]]
    # composed first: Hydra's plugin scan re-executes the launcher's module, which would undo the patch below
    configs = {tuple(job): _compose(["cluster=slurm_h100", "model=gpt_tiny", *job]) for job in jobs}
    from hydra_plugins.megalm_launcher import megalm_launcher as ml
    from omegaconf import OmegaConf
    submitted = []

    class Executor:
        def __init__(self, params):
            self.params = params

        def map_array(self, fn, overrides, key, nums, ids, states):
            submitted.append((self.params, list(nums)))
            return [type("Job", (), {"results": lambda self, n=n: [f"result {n}"]})() for n in nums]
    monkeypatch.setattr(ml, "make_executor", lambda executor, params: Executor(params))

    class Loader:
        def load_sweep_config(self, config, overrides):
            return configs[tuple(overrides)]
    launcher = ml.MegalmSlurmLauncher(submitit_folder=str(tmp_path / "%j"), timeout_min=60, nodes=None,
                                      tasks_per_node=None, gpus_per_node=None, partition="gpu")
    launcher.hydra_context = type("Context", (), {"config_loader": Loader()})()
    launcher.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    assert launcher.launch(jobs, initial_job_idx=10) == [f"result {n}" for n in range(10, 15)]
    got = {tuple(nums): {k: p[k] for k in ("nodes", "tasks_per_node", "gpus_per_node", "partition")}
           for p, nums in submitted}
    assert got == {(10,): {"nodes": 1, "tasks_per_node": 2, "gpus_per_node": 2, "partition": "gpu"},
                   (11, 13): {"nodes": 16, "tasks_per_node": 8, "gpus_per_node": 8, "partition": "gpu"},
                   (12,): {"nodes": 1, "tasks_per_node": 4, "gpus_per_node": 4, "partition": "gpu"},
                   (14,): {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "partition": "gpu"}}
    submitted.clear()
    launcher.params["nodes"] = 2  # set by the user: kept
    launcher.launch([["parallel=tp2"]], initial_job_idx=0)
    assert submitted[0][0]["nodes"] == 2 and submitted[0][0]["tasks_per_node"] == 2


def test_the_sbatch_file_asks_for_the_layouts_nodes_and_gpus(tmp_path, monkeypatch):
    """The submission file submitit writes for a 256-rank job on 8-GPU nodes (without submitting it: submitit
    only checks that srun exists, so a stub stands in for it)."""
    from hydra_plugins.megalm_launcher.megalm_launcher import job_resources, make_executor
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}:{Path(sys.executable).parent}:/usr/bin:/bin")
    cfg = _compose(["model=gpt_175b", "parallel=tp8_pp16", "parallel.dp=2", "cluster=slurm_h100"])
    resources = job_resources(cfg, "slurm")
    assert resources == {"nodes": 32, "tasks_per_node": 8, "gpus_per_node": 8}
    executor = make_executor("slurm", {"submitit_folder": str(tmp_path / "%j"), "timeout_min": 240, "partition": "h100",
                                       "signal_delay_s": 120, "max_num_timeout": 0, "cpus_per_task": None, **resources})
    sbatch = executor._executor._make_submission_file_text("python -u -m submitit.core._submit", "uid")
    for line in ("#SBATCH --nodes=32", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=h100", "#SBATCH --time=240", "export SUBMITIT_EXECUTOR=slurm"):
        assert line in sbatch.splitlines(), (line, sbatch)


def test_a_layout_that_does_not_fill_its_nodes_is_refused():
    from hydra_plugins.megalm_launcher.megalm_launcher import job_resources
    cfg = _compose(["model=gpt_tiny", "parallel.tp=4", "parallel.dp=3", "cluster=slurm_h100"])
    with pytest.raises(ValueError, match="12 ranks.*devices_per_node=8"):
        job_resources(cfg, "slurm")
