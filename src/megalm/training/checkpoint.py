"""Checkpoints through torch.distributed.checkpoint (DCP).

DCP stores every tensor with its global shape, which is what lets a later change load a
checkpoint at another parallel layout. Layout on disk:

    <dir>/step_00000100/        DCP shards + .metadata, and trainer_state.json
    <dir>/latest                name of the newest complete step folder, written last

Tensor-parallel shards are saved as the full tensor of their global name (gathered over the tp
group at save time, sliced again at load time), and the vocabulary matrices keep only the real
rows (their padding depends on tp), so a checkpoint holds the same keys and shapes whatever
layout it was written at. This costs one all-gather per sharded tensor per save; the
checkpoint issue replaces it with sharded DTensor writes.

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)

from megalm.config import CheckpointConfig
from megalm.models.gpt import VOCAB_PARAMS
from megalm.training.safe_load import load_state

log = logging.getLogger("megalm.checkpoint")
# Optimizer state keyed per parameter ("state.<name>.exp_avg"), so pipeline stages, which hold
# different parameters, never write conflicting param_groups.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
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


def _state_dicts(model: torch.nn.Module, optimizer):
    """Model and flattened optimizer state dicts; a ZeRO optimizer gives its state gathered to full
    parameter-shaped tensors under the same keys, so every zero stage writes the same checkpoint."""
    if hasattr(optimizer, "flat_state_dict"):
        return get_model_state_dict(model), optimizer.flat_state_dict()
    return get_state_dict(model, optimizer, options=OPTIONS)


def _shards(model: torch.nn.Module) -> Dict[str, Any]:
    """Global parameter name → TPShard, for this rank's tensor-parallel shards."""
    return {n: p.tp_shard for n, p in model.named_parameters(remove_duplicate=False)
            if getattr(p, "tp_shard", None) is not None}


def _gather_full(local: torch.Tensor, spec, group) -> torch.Tensor:
    from megalm.parallel.tensor import full_from_shards
    parts = [torch.empty_like(local) for _ in range(spec.world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return full_from_shards(parts, spec)


def _optim_keys(optim_sd, name: str):
    """Keys of the flattened optimizer state that hold tensors shaped like parameter `name`."""
    prefix = f"state.{name}."
    return [k for k, v in (optim_sd or {}).items()
            if k.startswith(prefix) and "." not in k[len(prefix):] and torch.is_tensor(v) and v.dim() > 0]


def _entries(model: torch.nn.Module, model_sd, optim_sd):
    """(state dict, key, TPShard or None, real vocabulary rows or None) for every tensor that
    is stored differently from how this rank holds it."""
    shards = _shards(model)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    for name in list(model_sd.keys()):
        spec = shards.get(name)
        rows = vocab if name in VOCAB_PARAMS else None
        if spec is None and rows is None:
            continue
        yield model_sd, name, spec, rows
        for key in _optim_keys(optim_sd, name):
            yield optim_sd, key, spec, rows


def _to_canonical(model, model_sd, optim_sd, group) -> None:
    """In place: shards → full tensors, padded vocabulary → the real rows (the same at any tp)."""
    for sd, key, spec, rows in list(_entries(model, model_sd, optim_sd)):
        t = _gather_full(sd[key], spec, group) if spec is not None else sd[key]
        sd[key] = t[:rows] if rows is not None else t


def _canonical_templates(model, model_sd, optim_sd) -> list:
    """In place: buffers of the stored shape for DCP to load into; returns how to convert back."""
    back = []
    for sd, key, spec, rows in list(_entries(model, model_sd, optim_sd)):
        full = spec.full_shape(sd[key].shape) if spec is not None else tuple(sd[key].shape)
        stored = (rows,) + tuple(full[1:]) if rows is not None else full
        back.append((sd, key, spec, full))
        sd[key] = torch.empty(stored, dtype=sd[key].dtype)
    return back


def _from_canonical(back: list) -> None:
    for sd, key, spec, full in back:
        t = sd[key]
        if t.shape[0] < full[0]:  # padding rows for this tp: zeros (never looked up, masked in the loss)
            t = torch.cat([t, t.new_zeros((full[0] - t.shape[0],) + tuple(t.shape[1:]))])
        sd[key] = spec.local(t).contiguous() if spec is not None else t


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, tp_group=None):
        self.cfg, self.tp_group = cfg, tp_group
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
             trainer_state: Dict[str, Any]) -> Path:
        name = f"step_{step:08d}"
        final, tmp = self.dir / name, self.dir / f".{name}.tmp"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = _state_dicts(model, optimizer)
        _to_canonical(model, model_sd, optim_sd, self.tp_group)
        state = {"model": model_sd, "optim": optim_sd, "rng": rng_state()}
        _quiet(dcp.save, state, checkpoint_id=str(tmp))
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

    def load(self, path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
        """Load model (and optimizer, RNG) state in place; return the trainer state saved with it."""
        path = resolve(path)
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            back = _canonical_templates(model, state["model"], None)
            _quiet(load_state, state, path)  # never runs code from the files (safe_load.py)
            _from_canonical(back)
            set_model_state_dict(model, state["model"])
        else:
            model_sd, optim_sd = _state_dicts(model, optimizer)
            back = _canonical_templates(model, model_sd, optim_sd)
            state = {"model": model_sd, "optim": optim_sd, "rng": rng_state()}
            _quiet(load_state, state, path)  # never runs code from the files (safe_load.py)
            _from_canonical(back)
            if hasattr(optimizer, "load_flat_state_dict"):  # ZeRO: each rank keeps its shard of the state
                set_model_state_dict(model, state["model"])
                optimizer.load_flat_state_dict(state["optim"])
            else:
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                               options=OPTIONS)
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
