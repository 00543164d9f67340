"""One exception type for mistakes a user can fix, and the one place that prints them.

A MegalmError's message says what is wrong, the value, and what is allowed or what to do. Every
entry point (train, generate, convert, preprocess) runs its body under `cli_errors(prog)`, which
prints such an error as `prog: <kind>: <message>` and exits 1, without a traceback. Any other
exception is a bug or a failure of the machine and keeps its traceback. MEGALM_FULL_ERROR=1 shows
the traceback of megalm errors too (for `megalm.train`, Hydra's HYDRA_FULL_ERROR=1 does as well).

The subclasses also derive from the built-in type a caller would expect (ValueError for a bad
value, FileNotFoundError for a missing file), so library code may catch either.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from typing import Iterable, Iterator


class MegalmError(Exception):
    """A mistake in what the user gave megalm: a config value, a file, a checkpoint, a request."""

    kind = "error"


class ConfigError(MegalmError, ValueError):
    """A config value (or a command-line option) that cannot work."""

    kind = "invalid config"


class DataError(MegalmError, ValueError):
    """A data file, corpus or tokenizer that does not fit what the run needs."""

    kind = "data"


class MissingFileError(MegalmError, FileNotFoundError):
    """A path the user named that does not exist."""

    kind = "not found"


class CheckpointError(MegalmError, RuntimeError):
    """A checkpoint that is damaged, of another model or tokenizer, or cannot be written."""

    kind = "checkpoint"


class TrainingError(MegalmError, RuntimeError):
    """Training cannot go on usefully (it diverged); the last good checkpoint is kept."""

    kind = "training stopped"


class DeviceError(MegalmError, RuntimeError):
    """A device that was asked for and is not there."""

    kind = "device"


def not_a_file(path) -> str:
    """Why a path named as a file cannot be read as one, for a message: "is a folder, not a file" or "does not
    exist"."""
    from pathlib import Path
    return "is a folder, not a file" if Path(path).is_dir() else "does not exist"


def did_you_mean(word: str, options: Iterable[str], prefix: str = "") -> str:
    """` (did you mean <prefix><closest>?)` for a message, or "" when nothing is close."""
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def full_errors() -> bool:
    """True when the user asked for tracebacks of megalm errors too."""
    return os.environ.get("MEGALM_FULL_ERROR", "").lower() in ("1", "true", "yes")


def format_error(prog: str, error: MegalmError) -> str:
    return f"{prog}: {error.kind}: {error}"


@contextlib.contextmanager
def cli_errors(prog: str) -> Iterator[None]:
    """Print a MegalmError raised inside as `prog: kind: message` and exit 1; let others through."""
    try:
        yield
    except MegalmError as e:
        if full_errors():
            raise
        sys.stderr.write(format_error(prog, e) + "\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
