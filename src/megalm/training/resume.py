"""Where a run starts, decided before anything expensive and before the run directory changes.

`plan_start` picks the checkpoint (the run directory's newest whole one, else checkpoint.load)
and checks what its files alone can tell: that it was trained with this run's tokenizer, that it
holds tensors of this model config (a meta-device model, nothing allocated), and whether any
step is left to train. Only a start that passes is taken; until then the run directory's
config.yaml, tokenizer and metrics are untouched, so a rejected resume damages nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from megalm.config import Config
from megalm.data import load_tokenizer
from megalm.data.provenance import describe, tokenizer_record
from megalm.errors import CheckpointError
from megalm.models import build_model
from megalm.training.checkpoint.paths import CONFIG_FILE, STATE_FILE, resolve
from megalm.training.checkpoint.safe_load import read_metadata
from megalm.training.checkpoint.shapes import check_shapes
from megalm.training.checkpoint.sharded_state import model_entries

log = logging.getLogger("megalm.train")


@dataclass
class Start:
    path: Optional[Path] = None
    """Step folder to load; None = from scratch."""
    weights_only: bool = False
    """checkpoint.finetune: the weights alone, from step 0."""
    state: Dict[str, Any] = field(default_factory=dict)
    """The checkpoint's trainer_state.json."""
    metadata: Any = None
    """Its DCP metadata, read once here for the shape check and handed on to the load."""

    @property
    def step(self) -> int:
        return 0 if self.path is None or self.weights_only else int(self.state.get("step", 0))


def plan_start(cfg: Config, checkpointer, tokenizer, run_dir: Path) -> Start:
    """The checked starting point of this run (see the module doc); raises CheckpointError."""
    latest = checkpointer.latest()  # verified against its manifest; rank 0 decides for all
    if latest is not None:
        start = Start(latest, False)
    elif cfg.checkpoint.load:
        start = Start(resolve(cfg.checkpoint.load), cfg.checkpoint.finetune)
        checkpointer.verify(start.path)  # an explicit choice that is damaged is an error, never skipped
    else:
        return Start()
    try:
        start.state = json.loads((start.path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{start.path / STATE_FILE} is not readable ({e}); the step folder is incomplete")
    _check_tokenizer(start, tokenizer, run_dir if latest is not None else None)
    start.metadata = _check_model(start.path, cfg, start.weights_only)
    return start


def _check_tokenizer(start: Start, tokenizer, run_dir: Optional[Path]) -> None:
    recorded = start.state.get("tokenizer")
    if recorded is None and run_dir is not None and (run_dir / "tokenizer.json").is_file():
        # a checkpoint from before the record: the run's own copy
        recorded = tokenizer_record(load_tokenizer(run_dir))
    if recorded is None or recorded.get("identity") == tokenizer.identity:
        return  # an imported checkpoint records none: nothing to compare
    hint = (f"set data.tokenizer.model to the one it was trained with (the run directory keeps a copy in "
            f"{run_dir}), or use a new run directory" if run_dir is not None else
            "set data.tokenizer.* to the one it was trained with")
    raise CheckpointError(f"checkpoint {start.path} was trained with tokenizer {describe(recorded)}, but this run's "
                          f"tokenizer is {describe(tokenizer_record(tokenizer))}; {hint}")


def _check_model(path: Path, cfg: Config, weights_only: bool = False):
    """The stored tensors against the global shapes of this model config, on the meta device;
    returns the checkpoint's metadata (state_dict_metadata). Fine-tuning a model with new heads
    (a classifier on a pretrained BERT) takes the tensors the two share."""
    stored_arch = _stored_arch(path)
    if stored_arch is not None and stored_arch != cfg.model.arch:
        raise CheckpointError(f"checkpoint {path} holds a {stored_arch} model (its config.yaml), and this run's model "
                              f"is {cfg.model.arch} (model={cfg.model.name}): choose a {stored_arch} model preset, or "
                              "another checkpoint")
    model = build_model(cfg.model, device="meta")
    metadata = read_metadata(path).state_dict_metadata
    heads = getattr(model, "new_heads", ()) if weights_only else ()
    check_shapes(path, metadata, model_entries(model), gather=False, fresh=heads, ignore_unexpected=bool(heads))
    return metadata


def _stored_arch(path: Path) -> Optional[str]:
    """The model family a step folder's config.yaml names; None if it has none (older or imported checkpoints)."""
    try:
        arch = OmegaConf.select(OmegaConf.load(path / CONFIG_FILE), "model.arch")
    except Exception:  # no file, or not YAML: the shape check below says what differs
        return None
    return str(arch) if arch is not None else None


def nothing_left(start: Start, max_steps: int) -> Optional[str]:
    """Why there is nothing to train from `start` (a finished run started again), or None."""
    if start.path is None or start.weights_only or start.step < max_steps:
        return None
    return (f"nothing to train: checkpoint {start.path} is at step {start.step} and trainer.max_steps={max_steps}. "
            f"Raise trainer.max_steps to train further, or use a new run directory to start over")
