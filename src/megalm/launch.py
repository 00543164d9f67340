"""Where the ranks come from: this process alone, or torchrun / SLURM that started us.

`plan_world` decides the world size *before anything is allocated*, so a layout that cannot
run here fails at once with the numbers and the way to launch it on a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megalm.config import Config


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int
    launcher: str  # torchrun | slurm | local


def detect_rank_env() -> Optional[RankEnv]:
    """The rank this process already is, when a launcher started it; None for a plain `python` start."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        return RankEnv(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]), "slurm")
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
    """World size of this job; ValueError when the layout cannot run where we are."""
    env = detect_rank_env()
    if env is not None:
        return env.world_size
    p, need = cfg.parallel, ranks_needed(cfg)
    have, where = local_capacity(cfg)
    if need > have:
        per_node = 8
        nodes = -(-need // per_node)
        raise ValueError(
            f"parallel={p.name} needs tp({p.tp}) * pp({p.pp}) * dp({max(p.dp, 1)}) * cp({p.cp}) = {need} ranks, "
            f"but this machine offers {have} ({where}). Launch it on a cluster, e.g. "
            f"`torchrun --nnodes {nodes} --nproc-per-node {per_node} -m megalm.train model={cfg.model.name} "
            f"parallel={p.name} cluster=torchrun_h200` on each node, or under SLURM "
            f"`srun --nodes {nodes} --ntasks-per-node {per_node} python -m megalm.train ... cluster=slurm_h100`.")
    return need


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(cfg: Config, run_dir: Path, world_size: int, entrypoint=None):
    """Start `world_size` ranks on this machine through PyTorch's elastic launcher; rank 0's result.

    The ranks get the already-composed, frozen Config (Hydra runs once, here), so they agree on
    every value and on the run directory. A rank that raises stops the whole job: the agent
    kills the others and ChildFailedError carries the failing rank's traceback.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    # Restarted ranks must not share the rendezvous TCP store with the first attempt: its stale
    # keys hand gloo/nccl the dead ranks' addresses (a known torch elastic problem, pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launch_cfg = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"megalm-{os.getpid()}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=cfg.cluster.max_restarts,
        monitor_interval=0.2, start_method="spawn")
    results = elastic_launch(launch_cfg, entrypoint or rank_main)(cfg, str(run_dir))
    return results[0]


def init_distributed(cfg: Config, device_type: str) -> None:
    """Join the process group the launcher (elastic agent, torchrun or srun) describes in the environment."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    env = os.environ
    if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
        raise ValueError("under srun set MASTER_ADDR and MASTER_PORT (e.g. the first host of "
                         "$SLURM_JOB_NODELIST and a free port) before starting megalm")
    if "RANK" not in env:  # srun: translate SLURM's variables to the ones torch reads
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    backend = cfg.cluster.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def rank_main(cfg: Config, run_dir: str):
    """Entry point of a spawned rank."""
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_rank_main)(cfg, run_dir)


def _rank_main(cfg: Config, run_dir: str):
    import torch.distributed as dist
    from megalm.train import resolve_device, run, setup_rank_logging
    rank = int(os.environ["RANK"])
    setup_rank_logging(rank, Path(run_dir))
    init_distributed(cfg, resolve_device(cfg.trainer.device).type)
    try:
        return run(cfg, Path(run_dir), int(os.environ["WORLD_SIZE"]))
    finally:
        dist.destroy_process_group()
