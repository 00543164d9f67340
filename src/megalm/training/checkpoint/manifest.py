"""The manifest of a step folder: every file's size and CRC-32, to tell a whole checkpoint from a damaged one.

Written last inside the temporary step folder, before the rename that makes the folder
complete, so a folder under its final name always carries the record of what it held when it
was written. Verification reads every file back and lists what differs: a missing file, a
size other than the recorded one (a truncated copy, a full disk), a different checksum (bytes
changed in place).

Why CRC-32 (zlib.crc32, streamed): it catches truncation, torn writes and bit flips, which is
all a checkpoint needs (nobody forges one), it ships with Python, and it runs at memory speed,
several times faster than SHA-256, so checking costs about as much as reading the files once.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Dict, List

MANIFEST = "manifest.json"
FORMAT = "megalm-manifest-v1"
_CHUNK = 8 << 20  # 8 MiB reads: large enough to stream at disk speed, small enough to stay in cache


def crc32_of(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable; skipped where the filesystem refuses (still atomic)."""
    try:
        fsync_file(path)
    except OSError:
        pass


def write_manifest(folder: Path) -> Dict[str, dict]:
    """Record every file now in `folder` (all but the manifest itself); return the records."""
    files = {p.name: {"size": p.stat().st_size, "crc32": crc32_of(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    out = folder / MANIFEST
    out.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))
    fsync_file(out)  # on disk before the rename publishes the folder, also across a power cut
    return files


def verify(folder: Path) -> List[str]:
    """What is wrong with `folder` against its manifest, one line a file; empty when it verifies.
    A folder without a manifest gives [] too: see has_manifest."""
    path = folder / MANIFEST
    if not path.exists():
        return []
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST}: unreadable ({e})"]
    if manifest.get("format") != FORMAT:
        return [f"{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}"]
    problems = []
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: missing (the manifest records {want['size']} bytes)")
            continue
        size = p.stat().st_size
        if size != want["size"]:
            problems.append(f"{name}: {size} bytes, the manifest records {want['size']} (truncated or overwritten)")
            continue
        crc = crc32_of(p)
        if crc != want["crc32"]:
            problems.append(f"{name}: CRC-32 {crc:#010x}, the manifest records {want['crc32']:#010x} "
                            f"(the bytes changed after the save)")
    return problems


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST).exists()


def folder_problems(folder: Path) -> List[str]:
    """verify(), plus a folder that is no checkpoint at all; never raises (in a process group,
    the other ranks wait for rank 0's answer)."""
    try:
        if not has_manifest(folder) and not (folder / ".metadata").exists():
            return [".metadata: missing (not a DCP checkpoint)"]
        return verify(folder)
    except OSError as e:
        return [f"{Path(e.filename or folder).name}: cannot be read ({e.strerror})"]


def step_folders(d: Path) -> List[Path]:
    """Step folders under their final names (step_<digits>), newest first by step number."""
    found = [p for p in d.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)
