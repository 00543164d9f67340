"""Where checkpoints live: the files a step folder holds besides DCP's, a run's checkpoint dir, and
the step folder that a path a user names (a step folder, a checkpoint dir, a run directory) stands for."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from megalm.errors import MissingFileError
from megalm.training.checkpoint.manifest import has_manifest

STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"


def run_checkpoints(run_dir: Path) -> Path:
    """The checkpoint dir of a run directory: its config.yaml's checkpoint.dir, relative to the run."""
    try:
        saved = OmegaConf.select(OmegaConf.load(run_dir / "config.yaml"), "checkpoint.dir", default="checkpoints")
    except Exception:  # an unreadable config.yaml (OSError, YAML's errors): the default folder
        saved = "checkpoints"
    ckpt = Path(str(saved)).expanduser()
    return ckpt if ckpt.is_absolute() else run_dir / ckpt


def kept_best(ckpt_dir: Path) -> Path:
    """What a tool reads from a checkpoint dir: the step folder `best` names (checkpoint.save_best), else the dir
    itself (resolve takes its `latest`)."""
    marker = Path(ckpt_dir) / "best"
    return Path(ckpt_dir) / marker.read_text().strip() if marker.is_file() else Path(ckpt_dir)


def resolve(path: str | Path) -> Path:
    """A step folder from a step folder, a checkpoint dir (its `latest`) or a run directory (its checkpoints)."""
    path = Path(path).expanduser()
    if (path / ".metadata").exists() or has_manifest(path):  # a damaged one too: load() names what is wrong
        return path
    marker = path / "latest"
    if marker.exists():
        step_dir = path / marker.read_text().strip()
        if (step_dir / ".metadata").exists() or has_manifest(step_dir):
            return step_dir
        raise MissingFileError(f"{marker} names {step_dir.name}, which holds no complete checkpoint")
    if not path.exists():
        raise MissingFileError(f"no checkpoint at {path}: the path does not exist")
    if (path / "config.yaml").is_file() and (run_checkpoints(path) / "latest").exists():  # a run directory
        return resolve(run_checkpoints(path))
    hint = ""
    if (path / "config.json").is_file():
        hint = (f"; {path} looks like a Hugging Face folder: `python -m megalm.convert import {path} OUT` makes a "
                "megalm checkpoint of it, then checkpoint.load=OUT")
    elif (path / "config.yaml").is_file():
        hint = f"; {path} is a run directory with no checkpoint in {run_checkpoints(path)}"
    raise MissingFileError(f"no checkpoint at {path}: neither a step folder (.metadata), a dir with `latest` nor a "
                           f"run directory with checkpoints{hint}")
