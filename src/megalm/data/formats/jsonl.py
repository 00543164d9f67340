"""JSON-lines files of examples (SFT, classification, evaluation tasks), read one way; and the two
line-aligned text files of a translation corpus."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Any, Iterator, Tuple, Union

from megalm.errors import DataError


def not_utf8(where: str, error: UnicodeDecodeError) -> DataError:
    """The DataError of text that is not UTF-8, at `where` (a file, or file:line)."""
    return DataError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start}"
                     f"{' of the line' if where.rpartition(':')[2].isdigit() else ''}); re-encode it as UTF-8")


def text_lines(path: Union[str, Path]) -> Iterator[Tuple[int, str]]:
    """(line number, line) of a UTF-8 text file (gunzipped when its name ends in .gz), each line ending in "\n"
    as text mode reads "\r\n", a leading byte-order mark dropped; bytes that are not UTF-8 are a DataError naming
    the file and line. (Each line is decoded alone, so the error names its line; text mode decodes whole blocks.)"""
    path = Path(path)
    with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise not_utf8(f"{path}:{n}", e) from None
            if n == 1 and line.startswith("\ufeff"):  # a byte-order mark, as Windows editors write: not text
                line = line[1:]
            yield n, line[:-2] + "\n" if line.endswith("\r\n") else line


def json_lines(path: Union[str, Path]) -> Iterator[Tuple[str, Any]]:
    """("file:line", record) of each non-blank line of a JSON-lines file (gzipped when it ends in
    .gz); a line that is not JSON, or not UTF-8, is a DataError naming its file and line."""
    path = Path(path)
    for n, line in text_lines(path):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None


def parallel_lines(source: Path, target: Path) -> Iterator[Tuple[str, str, str]]:
    """("source:line (target:line)", source line, target line) of two line-aligned text files (a translation corpus
    as fairseq and Moses keep it: line k of one is translated by line k of the other), without their
    line ends. Files of different lengths are a DataError naming both counts."""
    a, b = (line for _, line in text_lines(source)), (line for _, line in text_lines(target))
    n = 0
    for n, (x, y) in enumerate(itertools.zip_longest(a, b), 1):
        if x is None or y is None:
            rest = 1 + sum(1 for _ in (b if x is None else a))
            lengths = (n - 1, n - 1 + rest) if x is None else (n - 1 + rest, n - 1)
            raise DataError(f"{source} has {lengths[0]} lines and {target} {lengths[1]}: parallel files pair "
                            "their lines one to one")
        yield f"{source}:{n} ({target.name}:{n})", x.rstrip("\r\n"), y.rstrip("\r\n")  # a message may be about either
