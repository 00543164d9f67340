"""Where the ranks come from (this process alone, the local launcher, torchrun / SLURM) and the
lifecycle of each: join the process group, agree on the run directory, run the job, leave.

`plan_world` decides the world size *before anything is allocated*, so a layout that cannot
run here fails at once with the numbers and the way to launch it on a cluster. `as_rank` is the
one lifecycle every started rank goes through; the job itself is megalm.training.job.run.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from megalm.config import Config
from megalm.distributed.device import resolve_device
from megalm.errors import ConfigError, MegalmError, full_errors
from megalm.training.job import run


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int
    launcher: str  # torchrun | slurm | local


def env_int(name: str, default: int = 0) -> int:
    """The whole number a launcher's variable holds (`default` when unset); ConfigError naming it otherwise."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} in the environment must be a whole number, as torchrun and srun set it "
                          f"(unset {name} to start megalm without a launcher)") from None


def detect_rank_env() -> Optional[RankEnv]:
    """The rank this process already is, when a launcher started it; None for a plain `python` start."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankEnv(env_int("RANK"), env_int("LOCAL_RANK"), env_int("WORLD_SIZE"), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and env_int("SLURM_NTASKS") > 1:
        return RankEnv(env_int("SLURM_PROCID"), env_int("SLURM_LOCALID"), env_int("SLURM_NTASKS"), "slurm")
    return None


def ranks_needed(cfg: Config) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp * (p.dp if p.dp > 0 else 1)


def local_capacity(cfg: Config) -> tuple[int, str]:
    """Ranks this machine can host, and a description for messages."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return gpus, f"{gpus} GPU(s)"
    cores = os.cpu_count() or 1
    return cfg.cluster.devices_per_node, (
        f"no GPU; {cores} CPU core(s), and cluster={cfg.cluster.name} allows at most "
        f"{cfg.cluster.devices_per_node} CPU ranks (cluster.devices_per_node)")


def plan_world(cfg: Config) -> int:
    """World size of this job; ConfigError when the layout cannot run where we are."""
    env = detect_rank_env()
    if env is not None:
        return env.world_size
    p, need = cfg.parallel, ranks_needed(cfg)
    have, where = local_capacity(cfg)
    if need > have:
        per_node = 8
        nodes = -(-need // per_node)
        raise ConfigError(
            f"parallel={p.name} needs tp({p.tp}) * pp({p.pp}) * dp({max(p.dp, 1)}) * cp({p.cp}) = {need} ranks, "
            f"but this machine offers {have} ({where}). Launch it on a cluster, e.g. "
            f"`torchrun --nnodes {nodes} --nproc-per-node {per_node} -m megalm.train model={cfg.model.name} "
            f"parallel={p.name} cluster=torchrun_h200` on each node, or under SLURM "
            f"`srun --nodes {nodes} --ntasks-per-node {per_node} python -m megalm.train ... cluster=slurm_h100`. "
            f"To see what each rank would hold first, run `python -m megalm.plan` with the same overrides.")
    return need


REPORT_DIR_ENV = "MEGALM_RANK_REPORTS"  # where spawned ranks say how they ended (see spawn_local)


def spawn_local(cfg: Config, run_dir: Path, world_size: int, entrypoint=None):
    """Start `world_size` ranks on this machine through PyTorch's elastic launcher; rank 0's result.

    The ranks get the already-composed, frozen Config (Hydra runs once, here), so they agree on
    every value and on the run directory. A rank that raises stops the whole job: the agent
    stops the others. Each rank writes how it ended into a report folder (rank_main), so the
    user sees the first failing rank's message once, not every rank's traceback; a megalm error
    stays the one line it would be in one process (RankFailure). SIGTERM to this process reaches
    every rank (the agent forwards it): they save and stop, and the job ends as a single process
    does, with exit 0, when every rank has saved.
    """
    import tempfile
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    # Restarted ranks must not share the rendezvous TCP store with the first attempt: its stale
    # keys hand gloo/nccl the dead ranks' addresses (a known torch elastic problem, pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launch_cfg = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"megalm-{os.getpid()}",
        # Port 0: the agent's store binds a free port itself, so concurrent jobs never collide.
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=cfg.cluster.max_restarts,
        monitor_interval=0.2, start_method="spawn")
    # The agent logs each failed rank's traceback itself; the ranks' reports say it once, better.
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="megalm-ranks-") as reports:
        saved = os.environ.get(REPORT_DIR_ENV)
        os.environ[REPORT_DIR_ENV] = reports  # inherited by the spawned ranks
        # SIGUSR1 (Slurm's early warning) would end this process: pass it on to the ranks instead
        # (the agent does so for SIGTERM itself). Its workers are this process's children.
        usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: [
            os.kill(child.pid, signum) for child in multiprocessing.active_children()])
        try:
            results = elastic_launch(launch_cfg, entrypoint or rank_main)(cfg, str(run_dir))
        except ChildFailedError as e:
            raise rank_failure(Path(reports), e) from None
        except SignalException as e:
            _stop_rendezvous_heartbeats()
            return _after_signal(Path(reports), e, world_size)
        finally:
            signal.signal(signal.SIGUSR1, usr1)
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
            if saved is None:
                os.environ.pop(REPORT_DIR_ENV, None)
            else:
                os.environ[REPORT_DIR_ENV] = saved
    return results[0]


def _stop_rendezvous_heartbeats() -> None:
    """Cancel torch's rendezvous keep-alive timers, on this thread. After a signal, torch's launcher leaves
    its rendezvous handler open (launch_agent skips its shutdown then, so other nodes could rejoin) and
    the handler's keep-alive timer running. When the handler is later freed on the timer's own thread
    (the timer holds it while it sends a heartbeat), the timer's finalizer joins that very thread, and
    Python prints the RuntimeError it raises as an ignored exception on the user's terminal. Cancelling
    stops and joins each timer thread from here, as the handler's shutdown would have; the rendezvous
    itself stays open."""
    import gc
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer
    for obj in gc.get_objects():
        if issubclass(type(obj), _PeriodicTimer):  # not isinstance: it reads __class__, which some objects warn on
            obj.cancel()


def _reports(folder: Path) -> List[dict]:
    """The reports of the newest attempt (elastic restarts start a new one), earliest first."""
    found = []
    for path in folder.glob("rank*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a rank killed while writing its report
    if not found:
        return []
    attempt = max(r["attempt"] for r in found)
    return sorted((r for r in found if r["attempt"] == attempt), key=lambda r: r["time"])


def rank_failure(folder: Path, error) -> BaseException:
    """What to show for a failed multi-rank job: the first failing rank's own report."""
    failed = [r for r in _reports(folder) if r["status"] != "ok"]
    if failed:
        first = failed[0]
        if first["status"] == "megalm":
            return RankFailure(first["message"], first["kind"], first["rank"])
        return SystemExit(f"megalm: rank {first['rank']} failed, so the job stopped (the other ranks were "
                          f"stopped):\n{first['traceback']}")
    rank, failure = error.get_first_failure()  # no report: another entrypoint, or a rank that died without a word
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    recorded = data.get("message")
    if isinstance(recorded, dict) and recorded.get("extraInfo", {}).get("py_callstack"):
        return SystemExit(f"megalm: rank {rank} failed, so the job stopped:\n{recorded['extraInfo']['py_callstack']}")
    how = (f"exit code {failure.exitcode}" if failure.exitcode >= 0 else
           f"signal {_signal_name(-failure.exitcode)}")
    hint = " (SIGKILL is what the kernel's out-of-memory killer sends: see `dmesg`)" if failure.exitcode == -9 else ""
    return SystemExit(f"megalm: rank {rank} died with {how}{hint}, so the job stopped")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _after_signal(folder: Path, error, world_size: int):
    """The agent got SIGTERM and passed it on: exit 0 if every rank saved and stopped cleanly."""
    done = [r for r in _reports(folder) if r["status"] == "ok"]
    if len(done) == world_size:
        logging.getLogger("megalm.launch").warning(
            "%s: every rank saved and stopped; start again in this run directory to resume", error.sigval.name)
        return next(r.get("result") for r in done if r["rank"] == 0)
    raise SystemExit(f"megalm: stopped by {error.sigval.name} before every rank had saved "
                     f"({len(done)} of {world_size} did); the newest complete checkpoint resumes")


class RankFailure(MegalmError):
    """A megalm error raised on one rank of a spawned job, shown as that rank raised it."""

    def __init__(self, message: str, kind: str, rank: int):
        super().__init__(f"{message} (rank {rank})")
        self.kind, self.rank = kind, rank


def _write_report(rank: int, **fields) -> None:
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    record = dict(rank=rank, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), time=time.time(),
                  **fields)
    path = Path(folder) / f"rank{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(path)


def setup_rank_logging(rank: int, run_dir: Path) -> None:
    """Spawned ranks do not run Hydra: rank 0 logs to the console and train.log, others warnings only."""
    fmt = logging.Formatter(f"[%(asctime)s][%(name)s][%(levelname)s][rank {rank}] - %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        root.addHandler(file)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def init_distributed(cfg: Config, device_type: str) -> None:
    """Join the process group the launcher (elastic agent, torchrun or srun) describes in the environment."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    env = os.environ
    if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
        raise ConfigError("under srun set MASTER_ADDR and MASTER_PORT (e.g. the first host of "
                          "$SLURM_JOB_NODELIST and a free port) before starting megalm")
    if "RANK" not in env:  # srun: translate SLURM's variables to the ones torch reads
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    backend = cfg.cluster.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(env_int("LOCAL_RANK"))
    dist.init_process_group(backend)


def rank_main(cfg: Config, run_dir: str):
    """Entry point of a spawned rank."""
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_rank_main)(cfg, run_dir)


def as_rank(cfg: Config, run_dir: Path, world: int, spawned: bool) -> Optional[float]:
    """One rank's lifecycle: join the process group, agree on the run directory, train, leave.

    `spawned`: started by spawn_local, which handed every rank the same run directory and set
    up its logging; otherwise (torchrun, srun) the ranks take rank 0's directory, since they may
    have composed the config seconds apart, and only rank 0 keeps Hydra's info logging."""
    import torch.distributed as dist
    init_distributed(cfg, resolve_device(cfg.trainer.device).type)
    try:
        if not spawned:
            shared = [str(run_dir)]
            dist.broadcast_object_list(shared, src=0)
            run_dir = Path(shared[0])
            if dist.get_rank() != 0:
                logging.getLogger().setLevel(logging.WARNING)
        return run(cfg, run_dir, world)
    finally:
        dist.destroy_process_group()


def _rank_main(cfg: Config, run_dir: str):
    rank = int(os.environ["RANK"])
    setup_rank_logging(rank, Path(run_dir))
    try:
        result = as_rank(cfg, Path(run_dir), int(os.environ["WORLD_SIZE"]), spawned=True)
    except MegalmError as e:
        _write_report(rank, status="megalm", kind=e.kind, message=str(e))
        if full_errors() or not os.environ.get(REPORT_DIR_ENV):
            raise
        raise SystemExit(1) from None  # the launcher prints the report; no traceback on the console
    except Exception:
        _write_report(rank, status="error", traceback=traceback.format_exc())
        if not os.environ.get(REPORT_DIR_ENV):
            raise
        raise SystemExit(1) from None
    _write_report(rank, status="ok", result=result)
    # lazy: the trainer imports torch.distributed.checkpoint (~1 s), kept out of `megalm.train --help`
    from megalm.training.trainer import stopped_on_signal
    if stopped_on_signal() and os.environ.get(REPORT_DIR_ENV):
        # After returning, torch's worker wrapper waits for the agent to read the result. An agent
        # that is itself stopping on SIGTERM never does, and kills the rank only 30 s later; so
        # leave on our own after a grace period (the result is already in the pipe, and the report
        # says the rest). A healthy agent (SIGUSR1, a signal to one rank) reads it well before.
        leave = threading.Timer(5.0, _leave)
        leave.daemon = True  # an orderly exit (the agent read the result) does not wait for it
        leave.start()
    return result


def _leave() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
