"""Hugging Face tokenizers: a `tokenizer.json` (GPT-2 byte-level BPE, Llama-style BPE with byte
fallback, ...) read through the `tokenizers` package (the optional extra `megalm[hf]`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

from megalm.data.formats.cache import stable_hash
from megalm.data.tokenizers.base import Tokenizer, atomic_write
from megalm.errors import ConfigError, DataError, MissingFileError

# End-of-document candidates of common tokenizer.json files, in order of preference.
HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
HF_SIDECAR = "megalm_tokenizer.json"  # what a tokenizer.json cannot say: our eod and options


def import_tokenizers():
    """The `tokenizers` package, imported when a Hugging Face tokenizer is used: it is an optional extra."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("tokenizer.type=huggingface needs the `tokenizers` package: "
                          "pip install 'megalm[hf]' (or pip install tokenizers)") from None
    return tokenizers


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (GPT-2 byte-level BPE, Llama, ...) via the `tokenizers` package.

    Documents are encoded without special tokens unless `add_special_tokens` (then the file's
    post-processor runs, e.g. Llama's <s> in front); end-of-document is `eod_token`, or the first
    of HF_EOD_CANDIDATES that the vocabulary has.
    """

    def __init__(self, path: Union[str, os.PathLike], eod_token: Optional[str] = None,
                 add_special_tokens: bool = False):
        tokenizers = import_tokenizers()
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise MissingFileError(f"Hugging Face tokenizer file {path} does not exist")
        self._json = path.read_bytes()
        try:
            self._tok = tokenizers.Tokenizer.from_str(self._json.decode("utf-8"))
        except Exception as e:  # the Rust side raises its own exception type
            raise DataError(f"{path} is not a Hugging Face tokenizer.json: {e}") from None
        self.path, self.origin = path, str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else HF_EOD_CANDIDATES
        found = [(c, self._tok.token_to_id(c)) for c in candidates]
        found = [(c, i) for c, i in found if i is not None]
        if not found:
            raise DataError(f"{path}: no end-of-document token: "
                             + (f"{eod_token!r} is not in its vocabulary" if eod_token else
                                f"it has none of {', '.join(HF_EOD_CANDIDATES)}; set tokenizer.eod_token"))
        self.eod_token, self.eod = found[0]
        self.add_special_tokens = bool(add_special_tokens)
        self.identity = "huggingface:" + stable_hash(hashlib.sha256(self._json).hexdigest(), self.eod_token,
                                                     str(self.add_special_tokens))

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], num_threads: Optional[int] = None) -> List[List[int]]:
        if num_threads == 1:  # a worker process of its own: no thread pool inside it
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=self.add_special_tokens)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, piece: str) -> Optional[int]:
        return self._tok.token_to_id(piece)

    def pieces(self) -> List[str]:
        out = [""] * self.vocab_size
        for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.vocab_size:
                out[i] = piece
        return out

    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / "tokenizer.json", self._json)
        meta = {"type": "huggingface", "eod_token": self.eod_token,
                "add_special_tokens": self.add_special_tokens, "vocab_size": self.vocab_size}
        atomic_write(directory / HF_SIDECAR, json.dumps(meta, indent=1).encode())
        return directory

