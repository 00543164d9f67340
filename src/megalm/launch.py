"""Where the ranks come from: this process alone, or torchrun / SLURM that started us.

`plan_world` decides the world size *before anything is allocated*, so a layout that cannot
run here fails at once with the numbers and the way to launch it on a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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
    if need > 1:
        raise ValueError(
            f"parallel={p.name} needs {need} ranks; spawning several ranks on this machine is not "
            "available yet, so use parallel=single")
    return need
