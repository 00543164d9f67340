"""Raw corpus files as preprocessing and tokenizer training read them: JSON lines (one object per
line; each key a document stream) or plain text (a document per paragraph, line or file), gzipped
or not, streamed in chunks of consecutive documents; bad input is a PreprocessError naming its file
and line.
"""

from __future__ import annotations

import glob as globlib
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from megalm.errors import ConfigError, DataError, MissingFileError

TEXT_DOCUMENT_MODES = ("paragraph", "line", "file")


class PreprocessError(DataError):
    """Bad input, with the file and line it came from."""


@dataclass
class Chunk:
    """A run of consecutive documents of one input file, as raw bytes."""
    file: str
    kind: str  # jsonl | text
    lines: List[int]  # line number of each record (1-based), for messages
    records: List[bytes]
    nbytes: int


def expand_inputs(patterns: Sequence[str]) -> List[Path]:
    """Files named by paths or glob patterns, in the order given (each pattern's matches sorted)."""
    files: List[Path] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if any(ch in pattern for ch in "*?["):
            matches = sorted(globlib.glob(pattern, recursive=True))
            matches = [m for m in matches if os.path.isfile(m)]
            if not matches:
                raise MissingFileError(f"input pattern {pattern!r} matches no files")
            files += [Path(m) for m in matches]
        elif os.path.isdir(pattern):
            raise ConfigError(f"input {pattern} is a directory; give files or a glob like {pattern}/*.jsonl")
        elif not os.path.isfile(pattern):
            raise MissingFileError(f"input file {pattern} does not exist")
        else:
            files.append(Path(pattern))
    if not files:
        raise ConfigError("no input files given")
    return files


def input_kind(path: Path, input_format: str = "auto") -> str:
    if input_format in ("jsonl", "text"):
        return input_format
    if input_format != "auto":
        raise ConfigError(f"--input-format {input_format!r} is not one of auto, jsonl, text")
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return "jsonl" if name.endswith((".jsonl", ".json", ".ndjson")) else "text"


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb", buffering=1 << 20)


def _records(path: Path, kind: str, text_document: str) -> Iterator[Tuple[int, bytes]]:
    """(line number, raw document bytes) of one file, streamed."""
    if text_document not in TEXT_DOCUMENT_MODES:
        raise ConfigError(f"--text-document {text_document!r} is not one of {', '.join(TEXT_DOCUMENT_MODES)}")
    try:
        yield from _read_records(path, kind, text_document)
    except FileNotFoundError as e:
        raise MissingFileError(f"input file {path} disappeared while reading ({e.strerror})") from None
    except (OSError, EOFError) as e:  # unreadable, or a .gz that is not gzip or is cut short
        raise DataError(f"cannot read input {path}: {e}") from None


def _read_records(path: Path, kind: str, text_document: str) -> Iterator[Tuple[int, bytes]]:
    with _open(path) as f:
        if kind == "jsonl":
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield n, line
        elif text_document == "file":
            yield 1, f.read()
        elif text_document == "line":
            for n, line in enumerate(f, 1):
                yield n, line[:-1] if line.endswith(b"\n") else line
        elif text_document == "paragraph":
            block: List[bytes] = []
            first = 1
            for n, line in enumerate(f, 1):
                if line.strip(b"\r\n") == b"":
                    if block:
                        yield first, _paragraph(block)
                        block = []
                    first = n + 1
                else:
                    block.append(line)
            if block:
                yield first, _paragraph(block)


def _paragraph(lines: List[bytes]) -> bytes:
    text = b"".join(lines)
    return text[:-1] if text.endswith(b"\n") else text


def read_chunks(files: Sequence[Path], *, input_format: str = "auto", text_document: str = "paragraph",
                chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    """The inputs' documents in order, grouped into chunks of about chunk_bytes raw bytes."""
    for path in files:
        kind = input_kind(path, input_format)
        lines: List[int] = []
        records: List[bytes] = []
        size = 0
        for n, raw in _records(path, kind, text_document):
            lines.append(n)
            records.append(raw)
            size += len(raw)
            if size >= chunk_bytes:
                yield Chunk(str(path), kind, lines, records, size)
                lines, records, size = [], [], 0
        if records:
            yield Chunk(str(path), kind, lines, records, size)


def texts_of(chunk: Chunk, keys: Tuple[str, ...]) -> Dict[str, List[Any]]:
    """key -> its document in each record of the chunk: text, or ids (a JSON list; None reads as "")."""
    texts: Dict[str, List[Any]] = {k: [] for k in keys}
    for line, raw in zip(chunk.lines, chunk.records):
        if chunk.kind == "text":
            try:
                texts[keys[0]].append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise PreprocessError(f"{chunk.file}:{line}: not UTF-8 text ({e})") from None
            continue
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PreprocessError(f"{chunk.file}:{line}: not a JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise PreprocessError(f"{chunk.file}:{line}: a JSON line must be an object, got {type(obj).__name__}")
        for key in keys:
            if key not in obj:
                raise PreprocessError(f"{chunk.file}:{line}: no key {key!r} (it has {', '.join(map(repr, obj))}); "
                                      "choose the document field with --json-keys")
            value = obj[key]
            if value is None:
                value = ""
            if not isinstance(value, (str, list)):
                raise PreprocessError(f"{chunk.file}:{line}: {key!r} holds a {type(value).__name__}, not text")
            texts[key].append(value)
    return texts

