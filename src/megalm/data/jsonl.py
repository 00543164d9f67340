"""JSON-lines files of examples (SFT, classification, evaluation tasks), read one way; and the two
line-aligned text files of a translation corpus."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any, Iterator, Tuple, Union

from megalm.errors import DataError


def open_text(path: Path):
    """A UTF-8 text file, gunzipped when its name ends in .gz."""
    return gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")


def json_lines(path: Union[str, Path]) -> Iterator[Tuple[str, Any]]:
    """("file:line", record) of each non-blank line of a JSON-lines file (gzipped when it ends in
    .gz); a line that is not JSON is a DataError naming its file and line."""
    path = Path(path)
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None


def parallel_lines(source: Path, target: Path) -> Iterator[Tuple[str, str, str]]:
    """("source:line", source line, target line) of two line-aligned text files (a translation corpus
    as fairseq and Moses keep it: line k of one is translated by line k of the other), without their
    line ends. Files of different lengths are a DataError naming both counts."""
    with open_text(source) as a, open_text(target) as b:
        n = 0
        for n, (x, y) in enumerate(itertools.zip_longest(a, b), 1):
            if x is None or y is None:
                rest = 1 + sum(1 for _ in (b if x is None else a))
                lengths = (n - 1, n - 1 + rest) if x is None else (n - 1 + rest, n - 1)
                raise DataError(f"{source} has {lengths[0]} lines and {target} {lengths[1]}: parallel files pair "
                                "their lines one to one")
            yield f"{source}:{n}", x.rstrip("\r\n"), y.rstrip("\r\n")
