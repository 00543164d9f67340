"""The embedded corpora: the Python standard library's own source files, and their docstrings.

Every Python install carries ~30 MB of real, varied, well-written code, so the framework can
train a meaningful model with no download. Each *.py file is one document (StdlibCorpus). Its
docstrings (~2 MB of English prose) are the sentences BERT trains on (StdlibDocstrings): one
document per module, its docstrings in source order, a blank line between them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import platform
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from megalm.data.formats.cache import stable_hash
from megalm.errors import DataError

# Third-party and bytecode directories are not "the standard library's own source".
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_MB = 1_000_000


@dataclass
class StdlibCorpus:
    """A list of source files under `root`, in a fixed pseudo-random order; one document each."""

    root: Path
    files: List[Tuple[str, int]] = field(default_factory=list)
    """(path relative to root, size in bytes), in corpus order."""

    def __len__(self) -> int:
        return len(self.files)

    @property
    def num_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def fingerprint(self) -> str:
        """Identifies the exact documents, for cache keys of tokenizers and token files."""
        listing = "\n".join(f"{rel}\t{size}" for rel, size in self.files)
        return stable_hash("stdlib-corpus-v1", platform.python_version(), listing)

    def texts(self) -> Iterator[str]:
        """The documents' text, read lazily so the whole corpus never sits in memory."""
        for rel, _ in self.files:
            yield (self.root / rel).read_bytes().decode("utf-8")

    def subset(self, start: int, stop: int) -> "StdlibCorpus":
        return StdlibCorpus(self.root, self.files[start:stop])


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstrings(source: str) -> List[str]:
    """The docstrings of a module's source (module, classes, functions at any depth) in source
    order, cleaned of their indentation (inspect.cleandoc); [] when it does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old string literals
            tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a few test files are deliberately broken
        return []
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, _DOCUMENTED)), key=lambda n: getattr(n, "lineno", 0))
    return [d for d in (ast.get_docstring(n, clean=True) for n in nodes) if d and d.strip()]


@dataclass
class StdlibDocstrings:
    """The docstrings of a StdlibCorpus's modules: one document per module that has any."""

    code: StdlibCorpus

    def __len__(self) -> int:
        """Source files read (a module without docstrings gives no document)."""
        return len(self.code)

    def fingerprint(self) -> str:
        return stable_hash("stdlib-docstrings-v1", self.code.fingerprint())

    def texts(self) -> Iterator[str]:
        for source in self.code.texts():
            parts = docstrings(source)
            if parts:
                yield "\n\n".join(parts)


def _order_key(rel: str) -> str:
    # A hash rather than the name: alphabetical order would put all of test/ or all of
    # email/ in one contiguous block, and splits take contiguous ranges of documents.
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=8)  # the tokenizer and the data both list it; the stdlib does not change
def stdlib_corpus(max_corpus_mb: float = 0.0, root: Optional[str] = None) -> StdlibCorpus:
    """The stdlib's *.py files in hash order, valid UTF-8 only, up to `max_corpus_mb` (0 = all).

    The limit takes the longest prefix of the ordered files that fits, so a small corpus is a
    fair sample of the whole. MB here is 10^6 bytes of source.
    """
    if max_corpus_mb < 0:
        raise DataError(f"max_corpus_mb={max_corpus_mb} must not be negative")
    base = Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    candidates: List[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                candidates.append(Path(dirpath, name).relative_to(base).as_posix())
    if not candidates:
        raise DataError(f"no *.py files under the stdlib directory {base}")
    candidates.sort(key=_order_key)

    limit = int(max_corpus_mb * _MB) if max_corpus_mb > 0 else None
    files: List[Tuple[str, int]] = []
    total = 0
    for rel in candidates:
        data = (base / rel).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test files are deliberately latin-1 or koi8-r
        if limit is not None and total + len(data) > limit:
            break
        files.append((rel, len(data)))
        total += len(data)
    if not files:
        raise DataError(
            f"max_corpus_mb={max_corpus_mb} ({limit} bytes) is smaller than the first "
            f"stdlib file in corpus order; use a larger limit or 0 for all of it")
    return StdlibCorpus(base, files)
