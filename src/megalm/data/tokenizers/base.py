"""The tokenizer interface every kind implements, the null tokenizer, and Megatron's vocabulary padding.

Kinds: sentencepiece (megalm.data.tokenizers.sentencepiece), huggingface (a `tokenizer.json`,
megalm.data.tokenizers.huggingface) and null (data that is already token ids, here); which one a
config asks for, and reading one back from its folder: megalm.data.tokenizers.build.
`padded_vocab_size` is Megatron's embedding padding: a multiple of divisible_by x tp.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

from megalm.errors import DataError


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary: vocab_size rounded up to a multiple of divisible_by * tp.

    Each tensor-parallel rank then holds an equal, aligned slice of the embedding and output layer.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp < 1:
        raise DataError(f"padded_vocab_size needs positive numbers (vocab_size={vocab_size}, "
                        f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, tp={tp})")
    multiple = make_vocab_size_divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place: a reader sees the old file or the new.
    The file gets the mode any other file written here gets (0666 less the umask; mkstemp's is 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, path)


class Tokenizer(ABC):
    vocab_size: int
    eod: int
    """End-of-document id, appended after every document."""
    identity: str
    """Names this exact vocabulary, for cache keys of tokenized data and the records of what made a corpus."""
    origin: Optional[str] = None
    """The file it was read from, for messages; None when built in memory."""
    chat_template: Optional[str] = None
    """The model's own Jinja chat template (an imported model's); None: chats use data.chat_template."""

    @property
    def start(self) -> List[int]:
        """What a document or prompt starts with: the end-of-document token, as megalm's pretraining packs each
        document after one; an imported model's own start tokens instead (Llama's <s>, none for SmolLM2)."""
        return [self.eod]

    @property
    def context(self) -> List[int]:
        """`start`, or the end-of-document token where that is empty: scoring a text's first token needs one
        token before it (lm-evaluation-harness prefixes the end-of-text token where a model has no BOS)."""
        return self.start or [self.eod]

    def prompt(self, text: str) -> List[int]:
        """`text` as a decoder model reads a prompt: after `start`; at least one token (`context` when empty)."""
        return (self.start + self.encode(text)) or self.context

    @abstractmethod
    def encode(self, text: str) -> List[int]: ...

    def encode_batch(self, texts: Sequence[str], num_threads: Optional[int] = None) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    def token_to_id(self, piece: str) -> Optional[int]:
        """The id of the vocabulary entry `piece` (a special token such as "[CLS]"); None if absent."""
        return None

    def pieces(self) -> Optional[List[str]]:
        """Every id's vocabulary entry, in id order; None for a tokenizer without one (null)."""
        return None

    @abstractmethod
    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        """Write what load_tokenizer(directory) needs; return the directory."""


class NullTokenizer(Tokenizer):
    """For pre-tokenized data: text is space-separated ids; ids are used as they are."""

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise DataError(f"null tokenizer vocab_size={vocab_size} must be at least 2")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.identity = f"null:{vocab_size}"

    def encode(self, text: str) -> List[int]:
        try:
            return [int(tok) for tok in text.split()]
        except ValueError:
            raise DataError(f"the null tokenizer reads space-separated integer ids, got {text[:60]!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"type": "null", "vocab_size": self.vocab_size}
        atomic_write(directory / "tokenizer.json", json.dumps(meta, indent=1).encode())
        return directory

