"""Checkpoints through torch.distributed.checkpoint (DCP).

DCP stores every tensor with its global shape, which is what lets a later change load a
checkpoint at another parallel layout. Layout on disk:

    <dir>/step_00000100/        DCP shards + .metadata, and trainer_state.json
    <dir>/latest                name of the newest complete step folder, written last

Every tensor is stored under its global name and full shape, the vocabulary matrices with only
the real rows (their padding depends on tp), so a checkpoint holds the same keys and shapes
whatever layout it was written at. Each rank writes only the blocks it holds (tensor-parallel
shards, ZeRO's flat ranges; megalm.training.sharded_state) with their global offsets, nothing
is gathered, and a load reads into each rank's own tensors whatever blocks overlap them.

A step folder is written under a temporary name and renamed into place only when complete,
and `latest` is replaced atomically after that, so a crash mid-save never leaves a folder
that a resume would take for complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megalm.config import CheckpointConfig
from megalm.training.chunks import ChunkedSavePlanner
from megalm.training.safe_load import load_state
from megalm.training.sharded_state import model_entries, optim_entries

log = logging.getLogger("megalm.checkpoint")
STATE_FILE = "trainer_state.json"


def _quiet(fn, *args, **kwargs):
    # DCP warns on every call that it runs in one process when no process group exists.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def resolve(path: str | Path) -> Path:
    """A step folder from either a step folder or a checkpoint dir (its `latest`)."""
    path = Path(path).expanduser()
    if (path / ".metadata").exists():
        return path
    marker = path / "latest"
    if marker.exists():
        step_dir = path / marker.read_text().strip()
        if (step_dir / ".metadata").exists():
            return step_dir
        raise FileNotFoundError(f"{marker} names {step_dir.name}, which holds no complete checkpoint")
    raise FileNotFoundError(f"no checkpoint at {path}: neither a step folder (.metadata) nor a dir with `latest`")


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.cfg = cfg
        d = Path(cfg.dir).expanduser()
        self.dir = d if d.is_absolute() else Path(run_dir) / d

    def latest(self) -> Optional[Path]:
        try:
            return resolve(self.dir)
        except FileNotFoundError:
            return None

    def due(self, step: int, last: bool) -> bool:
        if not self.cfg.save:
            return False
        return last or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: Dict[str, Any], data_parallel=None) -> Path:
        name = f"step_{step:08d}"
        final, tmp = self.dir / name, self.dir / f".{name}.tmp"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state = {"model": model_entries(model, data_parallel), "optim": optim_entries(model, optimizer, data_parallel),
                 "rng": rng_state()}
        _quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ChunkedSavePlanner())
        if _is_rank0():
            (tmp / STATE_FILE).write_text(json.dumps(dict(trainer_state, step=step), indent=1))
            if final.exists():  # a re-run that reached the same step again
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = self.dir / ".latest.tmp"
            marker_tmp.write_text(name + "\n")
            os.replace(marker_tmp, self.dir / "latest")
            self._prune()
        _barrier()
        log.info("saved checkpoint %s", final)
        return final

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        steps = sorted(p for p in self.dir.glob("step_*") if (p / ".metadata").exists())
        for old in steps[:-self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             data_parallel=None) -> Dict[str, Any]:
        """Load model (and optimizer, RNG) state in place; return the trainer state saved with it."""
        path = resolve(path)
        state = {"model": model_entries(model, data_parallel)}  # views of this rank's own tensors
        if optimizer is not None:
            state.update(optim=optim_entries(model, optimizer, data_parallel), rng=rng_state())
        _quiet(load_state, state, path)  # in place; never runs code from the files (safe_load.py)
        if optimizer is not None:
            set_rng_state(state["rng"])
        log.info("loaded checkpoint %s", path)
        return json.loads((path / STATE_FILE).read_text())


def rng_state() -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_model_weights(path: str | Path, model: torch.nn.Module) -> Dict[str, Any]:
    """Weights only (for generation and evaluation); returns the saved trainer state."""
    return Checkpointer(CheckpointConfig(), Path(".")).load(Path(path), model, None)
