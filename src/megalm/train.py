"""`python -m megalm.train [overrides]`: compose the config, validate it, launch, train.

Thin on purpose: the ranks' lifecycle is megalm.launch's, a rank's job megalm.training.job's
(`run`, importable from here too), and every piece is a builder that receives only its own
config section.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from megalm.cli import run_hydra_app
from megalm.config import Config, conf_dir
from megalm.errors import ConfigError, MegalmError, cli_errors
from megalm.launch import as_rank, detect_rank_env, plan_world, spawn_local
from megalm.models import build_model
from megalm.models.registry import register_configs
from megalm.report import job_record, write_job, write_sweep_summary
from megalm.training.job import run
from megalm.validation import reject_unknown_keys, validate

__all__ = ["hydra_main", "main", "run"]
register_configs()


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def hydra_main(dcfg: DictConfig) -> Optional[float]:
    """Hydra task function; returns the final validation loss so sweepers can optimise it."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        # A failed job's error goes back to the sweeper, which decides: Hydra's basic one stops the sweep and
        # the error is printed once by run_hydra_app; optuna's records a failed trial and goes on.
        return _task(dcfg)
    with cli_errors("megalm"):  # printed here: Hydra would add its own line to a raised exception
        return _task(dcfg)


def _task(dcfg: DictConfig) -> Optional[float]:
    """One run; in a multirun also its sweep job's record (job.json) and the sweep's summary, failed or not."""
    sweep = _sweep_job(dcfg)
    if sweep is None:
        return _run(dcfg)
    sweep_dir, run_dir, overrides = sweep
    try:
        val_loss = _run(dcfg)
    except BaseException as e:
        if _rank0():  # a stop (Ctrl-C, or an exit with status 0) is not a failure
            stopped = isinstance(e, KeyboardInterrupt) or (isinstance(e, SystemExit) and not e.code)
            message = str(e) if isinstance(e, MegalmError) else f"{type(e).__name__}: {e}"
            error = None if stopped else (message.splitlines() or [""])[0]
            write_job(run_dir, job_record(overrides, "stopped" if stopped else "failed", run_dir, error=error))
            write_sweep_summary(sweep_dir)
        raise
    if _rank0():
        write_job(run_dir, job_record(overrides, "ok", run_dir, val_loss=val_loss, params=_params(dcfg)))
        write_sweep_summary(sweep_dir)  # the run's rank 0 has drawn its curves.png (training.job.run)
    return val_loss


def _sweep_job(dcfg: DictConfig):
    """(sweep directory, this job's run directory, its overrides) in a Hydra multirun, else None."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    run_dir = Path(dcfg.get("run_dir") or hc.runtime.output_dir)
    return Path(hc.sweep.dir), run_dir, list(hc.overrides.task)


def _rank0() -> bool:
    env = detect_rank_env()
    return env is None or env.rank == 0


def _params(dcfg: DictConfig) -> int:
    """The model's parameter count, from a meta-device build (nothing allocated)."""
    model_cfg = OmegaConf.to_object(dcfg).model
    return sum(p.numel() for p in build_model(model_cfg, device="meta").parameters())


def _adopt_submitit_rank() -> None:
    """Under submitit (hydra/launcher=megalm_slurm or megalm_local) a job of several tasks runs one rank a
    task: torch's rendezvous variables (MASTER_ADDR / PORT, RANK, WORLD_SIZE, LOCAL_RANK) come from
    submitit's job environment, so the rank is found as under torchrun."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit
    job = submitit.JobEnvironment()
    if job.num_tasks > 1:
        dist_env = submitit.helpers.TorchDistributedEnvironment()
        if os.environ["SUBMITIT_EXECUTOR"] == "local" and "MASTER_PORT" not in os.environ:
            dist_env.master_port = _local_rendezvous_port(job)
        dist_env.export(set_cuda_visible_devices=False)


def _local_rendezvous_port(job, wait_s: float = 300.0) -> int:
    """A job of submitit's local executor (hydra/launcher=megalm_local): the port its ranks meet on, free
    on this machine. Submitit's own is drawn at random from 20000-60000 by the job id, which on a busy
    machine can be a port another process holds (rank 0 then cannot listen, and the others would wait on
    a stranger's socket); here task 0 asks the system for a free port and leaves it in the job's folder,
    where the other tasks read it."""
    import socket
    import time
    path = Path(job.paths.folder) / f"{job.job_id}_rendezvous_port"
    if job.global_rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))  # every interface, as the rendezvous store listens
            port = s.getsockname()[1]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(path)  # whole, or not there yet
        return port
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise MegalmError(f"task {job.global_rank} of job {job.job_id} waited {wait_s:.0f} s for task 0's "
                              f"rendezvous port in {path}")
        time.sleep(0.1)
    return int(path.read_text())


def _run(dcfg: DictConfig) -> Optional[float]:
    _adopt_submitit_rank()
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN and dcfg.logging.get("title") is None and hc.overrides.task:
        dcfg.logging.title = " ".join(hc.overrides.task)  # curves.png names what the command set
    try:
        reject_unknown_keys(dcfg)
        cfg: Config = OmegaConf.to_object(dcfg)
        world = plan_world(cfg)
        validate(cfg, world, launching=True)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} has no value (??? in the config); set it, e.g. {e.full_key}=...") from None
    except ValueError as e:  # validation is pure arithmetic: any ValueError there is about the config
        if isinstance(e, MegalmError):
            raise
        raise ConfigError(str(e)) from None
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)
    if detect_rank_env() is not None:  # started by torchrun or srun: this process is one rank
        return as_rank(cfg, run_dir, world, spawned=False)
    if world == 1:
        return run(cfg, run_dir, 1)
    return spawn_local(cfg, run_dir, world)


def main() -> Optional[float]:
    """`python -m megalm.train` / `megalm-train`: the Hydra app, with megalm's error reporting."""
    return run_hydra_app(hydra_main)


if __name__ == "__main__":
    main()
