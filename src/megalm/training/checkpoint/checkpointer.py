"""`Checkpointer`: a run's step folders, saved (every rank its own blocks, rank 0 the rest, then
the atomic rename; optionally in the background) and loaded (verified against the manifest,
shapes checked, read without running code from the files)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megalm.config import CheckpointConfig
from megalm.errors import CheckpointError
from megalm.training.checkpoint.chunks import ChunkedSavePlanner, stage_to_cpu
from megalm.training.checkpoint.manifest import (
    MANIFEST, folder_problems, fsync_dir, fsync_file, has_manifest, step_folders, write_manifest)
from megalm.training.checkpoint.paths import CONFIG_FILE, STATE_FILE, kept_best, resolve
from megalm.training.checkpoint.random_state import rank_streams, rng_state, set_rank_streams, set_rng_state
from megalm.training.checkpoint.safe_load import load_state, read_metadata
from megalm.training.checkpoint.shapes import check_shapes
from megalm.training.checkpoint.sharded_state import model_entries, optim_entries, zero_vocab_padding

log = logging.getLogger("megalm.checkpoint")

# The background writer of async_save warns from its own thread, where catch_warnings (below)
# does not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


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


class CorruptCheckpointError(CheckpointError):
    """A step folder whose files differ from its manifest."""


def _from_rank0(value):
    """Rank 0's `value` on every rank (the value itself without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_trainer_state(folder: Path, state: Dict[str, Any]) -> None:
    path = folder / STATE_FILE
    path.write_text(json.dumps(state, indent=1))
    fsync_file(path)


def _seal_after(written: Future, folder: Path) -> None:
    """Once DCP's write is done, the manifest: written last, it vouches for every file before it."""
    written.result()
    write_manifest(folder)


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, tp_group=None, config_yaml: Optional[str] = None):
        """`config_yaml`: the run's resolved config, copied into every step folder as config.yaml
        (so a step folder alone says what model it holds)."""
        self.cfg, self.tp_group, self.config_yaml = cfg, tp_group, config_yaml
        d = Path(cfg.dir).expanduser()
        self.dir = d if d.is_absolute() else Path(run_dir) / d
        self._verified: set = set()  # step folders already checked against their manifest
        self._pending = None  # (future, tmp, final) of a background save
        self._executor: Optional[ThreadPoolExecutor] = None
        self._async_group = None
        if cfg.async_save and dist.is_initialized():
            # The background writer runs DCP's collectives in its own thread: a group of their
            # own keeps them from interleaving with training's. Gloo, as DCP stages to CPU.
            self._async_group = dist.new_group(backend="gloo")

    def check_writable(self) -> None:
        """Make the checkpoint folder and write into it now, on every rank (each writes its own files): a
        folder no checkpoint could be written into is said before training, not at the first save."""
        if not self.cfg.save:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.rmdir(tempfile.mkdtemp(prefix=".megalm-probe-", dir=self.dir))
        except OSError as e:
            raise CheckpointError(f"checkpoint.dir={self.cfg.dir}: cannot write checkpoints into {self.dir}: "
                                  f"{e.strerror or e}; point checkpoint.dir at a folder you can write to") from None

    # -- which checkpoint ------------------------------------------------------------------------
    def latest(self) -> Optional[Path]:
        """The newest step folder that verifies; a damaged one is reported and the one before
        it taken. Rank 0 decides and tells the others, so ranks never disagree."""
        kind, value = _from_rank0(self._newest_whole() if _is_rank0() else None)
        if kind == "error":
            raise CorruptCheckpointError(value)
        if kind == "none":
            return None
        self._verified.add(value)
        return Path(value)

    def _newest_whole(self):
        rejected = []
        for folder in step_folders(self.dir):
            problems = folder_problems(folder)
            if not problems:
                if rejected:
                    log.warning("taking %s, the newest checkpoint that verifies", folder)
                self._warn_unverified(folder)
                return "ok", str(folder)
            log.warning("checkpoint %s is damaged, so it is skipped: %s", folder, "; ".join(problems))
            rejected.append(f"{folder}: {'; '.join(problems)}")
        if rejected:
            return "error", (f"no checkpoint in {self.dir} verifies:\n  " + "\n  ".join(rejected)
                             + f"\nno whole checkpoint is left in {self.dir}: a training run starts from scratch once "
                               "the damaged folders are moved out of it")
        return "none", None

    @staticmethod
    def _warn_unverified(folder: Path) -> None:
        if not has_manifest(folder):
            log.warning("checkpoint %s has no %s (written before megalm recorded one): loading it unverified",
                        folder, MANIFEST)

    def verify(self, path: Path) -> None:
        """Raise, on every rank, if `path` differs from its manifest: an explicit choice never falls back."""
        if str(path) in self._verified:
            return
        problems = _from_rank0(folder_problems(path) if _is_rank0() else None)
        if problems:
            raise CorruptCheckpointError(
                f"checkpoint {path} failed verification: {'; '.join(problems)}. An older step folder next to "
                f"it may be whole: name that one instead (to train: checkpoint.load)")
        if _is_rank0():
            self._warn_unverified(path)
        self._verified.add(str(path))

    def due(self, step: int, last: bool) -> bool:
        if not self.cfg.save:
            return False
        return last or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: Dict[str, Any], data_parallel=None, layout=None, best: bool = False) -> Path:
        """Write step `step`; with checkpoint.async_save it is published by the next save or finish().
        `layout`: what megalm.parallel.parallelize returned (None for a single process). `best`: the marker
        `best` names it once it is published (checkpoint.save_best)."""
        self.finish()  # never two saves in flight: the previous one lands first
        name = f"step_{step:08d}"
        final, tmp = self.dir / name, self.dir / f".{name}.tmp"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:  # the folder went away or became read-only since the start
                self._write_failed(e, tmp)
        _barrier()
        state = {"model": model_entries(model, data_parallel), "optim": optim_entries(model, optimizer, data_parallel),
                 "rng": rng_state(), **rank_streams(layout, self.tp_group)}
        if _is_rank0():
            _write_trainer_state(tmp, dict(trainer_state, step=step))
            if self.config_yaml is not None:
                (tmp / CONFIG_FILE).write_text(self.config_yaml)
        if self.cfg.async_save:
            # The blocks are copied to CPU memory before async_save returns (so training may
            # change them), then written from DCP's thread; rank 0's thread of ours then
            # checksums the files, so neither the write nor the read-back holds up training.
            written = dcp.async_save(stage_to_cpu(state), storage_writer=dcp.FileSystemWriter(str(tmp)),
                                     planner=ChunkedSavePlanner(), process_group=self._async_group,
                                     no_dist=not dist.is_initialized())
            if _is_rank0():
                written = self._sealer().submit(_seal_after, written, tmp)
            self._pending = (written, tmp, final, best)
            log.info("writing checkpoint %s in the background", final)
            return final
        try:
            _quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ChunkedSavePlanner())
            if _is_rank0():
                write_manifest(tmp)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            self._write_failed(e, tmp)
        self._publish(tmp, final, best)
        return final

    def _write_failed(self, error: BaseException, tmp: Path) -> None:
        """A save that could not write (a full disk, a quota, a read-only mount): name the file and
        the reason, drop the partial folder; the previous checkpoint stays `latest`."""
        cause = _os_error_in(error)
        if cause is None:
            raise error
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        where = cause.filename or tmp  # a failed write() carries no file name: the folder it was writing into
        raise CheckpointError(
            f"could not write the checkpoint into {where}: {cause.strerror or cause} (errno {cause.errno}). "
            f"Free space under {self.dir} or point checkpoint.dir elsewhere; the previous checkpoint "
            f"({self.latest_published() or 'none'}) is kept") from None

    def latest_published(self) -> Optional[Path]:
        """The step folder `latest` names, or will once a background save lands (for messages);
        None before the first save."""
        if self._pending is not None:
            return self._pending[2]
        try:
            return self.dir / (self.dir / "latest").read_text().strip()
        except OSError:
            return None

    def _sealer(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalm-checkpoint")
        return self._executor

    def finish(self) -> None:
        """Wait for a background save and publish it (no-op without one). Every rank calls it."""
        if self._pending is None:
            return
        written, tmp, final, best = self._pending
        self._pending = None
        try:
            written.result()  # DCP's own collectives: every rank's shards are on disk when this returns
        except (Exception, CheckpointException) as e:
            self._write_failed(e, tmp)
        self._publish(tmp, final, best)

    def _publish(self, tmp: Path, final: Path, best: bool = False) -> None:
        """Rank 0 renames a sealed folder (shards, trainer state, manifest) into place, then `latest` (and `best`)."""
        if _is_rank0():
            if final.exists():  # a re-run that reached the same step again
                shutil.rmtree(final)
            os.replace(tmp, final)
            for marker in ("latest", "best") if best else ("latest",):
                marker_tmp = self.dir / f".{marker}.tmp"
                marker_tmp.write_text(final.name + "\n")
                os.replace(marker_tmp, self.dir / marker)
            fsync_dir(self.dir)  # the renames on disk
            self._prune()
        _barrier()
        log.info("saved checkpoint %s%s", final, " (the best so far)" if best else "")

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        best = self._marked("best")
        for old in step_folders(self.dir)[self.cfg.keep_last:]:
            if old.name != best:  # the best is kept whatever its age
                shutil.rmtree(old, ignore_errors=True)

    def _marked(self, marker: str) -> Optional[str]:
        try:
            return (self.dir / marker).read_text().strip()
        except OSError:
            return None

    def for_reading(self) -> Optional[Path]:
        """The step folder tools read a run from: the one `best` names (checkpoint.save_best), verified, else
        latest()."""
        path = kept_best(self.dir)
        if path == self.dir:
            return self.latest()
        self.verify(path)  # named on purpose: a damaged one is an error, not a quiet fallback to another
        log.info("reading %s, the best checkpoint by the run's trainer.monitor (checkpoint.save_best)", path)
        return path

    # -- load ------------------------------------------------------------------------------------
    def load(self, path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             data_parallel=None, metadata=None, layout=None) -> Dict[str, Any]:
        """Load model (and optimizer, RNG) state in place; return the trainer state saved with it.
        `metadata`: the step folder's state_dict_metadata when the caller has read it already."""
        path = resolve(path)
        self.verify(path)
        if metadata is None:  # once: shapes, rank streams, and the load
            metadata = read_metadata(path).state_dict_metadata
        state = {"model": model_entries(model, data_parallel)}  # views of this rank's own tensors
        # A fine-tuning start (weights only) may lack the model's new heads and hold heads it dropped.
        heads = getattr(model, "new_heads", ()) if optimizer is None else ()
        fresh = check_shapes(path, metadata, state["model"], fresh=heads, ignore_unexpected=bool(heads))
        for key in fresh:
            state["model"].pop(key, None)
        if optimizer is not None:
            state.update(optim=optim_entries(model, optimizer, data_parallel), rng=rng_state(),
                         **rank_streams(layout, self.tp_group, metadata))
        zero_vocab_padding(model, optimizer, data_parallel)  # the checkpoint fills the real rows only
        _quiet(load_state, state, path, metadata_read=True)  # in place; never runs code from the files
        if optimizer is not None:
            set_rng_state(state["rng"])
            set_rank_streams(layout, self.tp_group, state)
        log.info("loaded checkpoint %s", path)
        return json.loads((path / STATE_FILE).read_text())


def _os_error_in(error: BaseException) -> Optional[OSError]:
    """The OSError behind `error`: itself, a cause, or one DCP collected from a rank (CheckpointException)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):  # rank -> (exception, stack summary)
            todo += [failure[0] for failure in e.failures.values()]
    return None


def load_model_weights(path: str | Path, model: torch.nn.Module) -> Dict[str, Any]:
    """Weights only (for generation and evaluation); returns the saved trainer state."""
    return Checkpointer(CheckpointConfig(), Path(".")).load(Path(path), model, None)
