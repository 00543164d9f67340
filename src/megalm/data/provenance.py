"""What a tokenized corpus was made with: a small JSON file beside the `.bin/.idx` megalm writes.

    <prefix>.bin  <prefix>.idx  <prefix>.megalm.json   {"tokenizer": {"identity", "type", "vocab_size",
                                                        "origin"}, "documents", "tokens"}

Megatron's format records no tokenizer, so a corpus made by another tokenizer of the same size
would train silently on the wrong ids. Training refuses a corpus whose recorded tokenizer is not
the configured one, naming both (`check_corpus_tokenizer`). Files without the sidecar (made by
Megatron's tools) are not checked beyond the id range.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

from megalm.data.tokenizers.base import atomic_write
from megalm.errors import DataError

SUFFIX = ".megalm.json"
FORMAT = "megalm-corpus-v1"


def sidecar_path(prefix: Union[str, os.PathLike]) -> Path:
    return Path(str(prefix) + SUFFIX)


def tokenizer_record(tokenizer) -> Dict[str, Any]:
    """The facts about a tokenizer worth recording: its identity (a hash of the vocabulary) and how to find it."""
    return {"identity": tokenizer.identity, "type": tokenizer.identity.split(":", 1)[0],
            "vocab_size": tokenizer.vocab_size, "origin": getattr(tokenizer, "origin", None)}


def describe(record: Dict[str, Any]) -> str:
    """`sentencepiece:5d34feea5b5c2d78 (500 ids, from tok/tokenizer.model)` for messages."""
    origin = f", from {record['origin']}" if record.get("origin") else ""
    return f"{record.get('identity')} ({record.get('vocab_size')} ids{origin})"


def write_provenance(prefix: Union[str, os.PathLike], tokenizer, **facts: Any) -> Path:
    """Write <prefix>.megalm.json atomically (after the .bin/.idx are in place)."""
    return write_record(prefix, tokenizer_record(tokenizer), **facts)


def write_record(prefix: Union[str, os.PathLike], made_with: Dict[str, Any], **facts: Any) -> Path:
    """write_provenance from a tokenizer record (as read_provenance gives it: a merge passes one on)."""
    path = sidecar_path(prefix)
    record = {"format": FORMAT, "tokenizer": made_with, **facts}
    atomic_write(path, json.dumps(record, indent=1).encode())
    return path


def read_provenance(prefix: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """The sidecar of `prefix`, or None when there is none (Megatron's own files)."""
    path = sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); delete it to train on {prefix} unchecked") from None
    if not isinstance(record, dict) or not isinstance(record.get("tokenizer"), dict):
        raise DataError(f"{path} has no tokenizer record; delete it to train on {prefix} unchecked")
    return record


def check_corpus_tokenizer(prefix: Union[str, os.PathLike], tokenizer) -> None:
    """Raise DataError when `prefix` was tokenized by another tokenizer than `tokenizer`."""
    record = read_provenance(prefix)
    if record is None:
        return
    made = record["tokenizer"]
    if made.get("identity") != tokenizer.identity:
        raise DataError(
            f"{prefix} was tokenized with {describe(made)}, but this run's tokenizer is "
            f"{describe(tokenizer_record(tokenizer))}: its ids would mean other tokens. Set data.tokenizer to "
            f"the tokenizer the corpus was made with, or preprocess the corpus again with this one")
