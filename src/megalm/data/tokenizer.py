"""Tokenizers behind one small interface: sentencepiece (trained on the corpus and cached, or
loaded from a .model file) and a null tokenizer for data that is already token ids."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import sentencepiece as spm

from megalm.data.corpora import StdlibCorpus, locked, stable_hash

log = logging.getLogger("megalm.data")

# Trainer options that make sentencepiece lossless on source code: decode(encode(s)) == s.
_TRAIN_OPTIONS = dict(
    model_type="bpe",  # trains in seconds on the whole stdlib; unigram takes ~5x longer
    normalization_rule_name="identity",  # no NFKC: every code point stays as written
    remove_extra_whitespaces=False,  # runs of spaces are indentation, not noise
    add_dummy_prefix=False,  # no invented space before the first token
    allow_whitespace_only_pieces=True,  # a run of indentation becomes one piece
    byte_fallback=True,  # unseen characters become UTF-8 byte pieces, never <unk>
    # Training sentences are lines, so "\n" would never be seen; a user symbol makes it
    # one piece instead of a byte fallback.
    user_defined_symbols=["\n"],
    character_coverage=0.9999,
    max_sentence_length=16384,  # bytes; longer lines are skipped by the trainer
    hard_vocab_limit=False,  # a small corpus may not fill the vocabulary; that is fine
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
)
# Lines sampled for training; the whole stdlib has ~730k non-blank lines.
_MAX_SENTENCES = 1_000_000
_SPACE = "\u2581"  # sentencepiece's space marker


def _threads(num_threads: Optional[int]) -> int:
    return num_threads or len(os.sched_getaffinity(0)) or 1


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Tokenizer(ABC):
    vocab_size: int
    eod: int
    """End-of-document id, appended after every document."""
    identity: str
    """Names this exact vocabulary, for cache keys of tokenized data."""

    @abstractmethod
    def encode(self, text: str) -> List[int]: ...

    def encode_batch(self, texts: Sequence[str], num_threads: Optional[int] = None) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @abstractmethod
    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        """Write what load_tokenizer(directory) needs; return the directory."""


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model: Union[str, os.PathLike, bytes]):
        if not isinstance(model, bytes):
            path = Path(model).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"sentencepiece model {path} does not exist")
            model = path.read_bytes()
        self._proto = model
        self._sp = spm.SentencePieceProcessor(model_proto=model)
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError("the sentencepiece model has no eos piece to use as end-of-document")
        self.identity = "sentencepiece:" + hashlib.sha256(model).hexdigest()[:16]
        # sentencepiece reads a literal U+2581 in the input as a space; its UTF-8 bytes as
        # byte pieces decode back to the character itself.
        byte_ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE.encode("utf-8")]
        self._space_bytes = byte_ids if all(self._sp.is_byte(i) for i in byte_ids) else None

    def encode(self, text: str) -> List[int]:
        if _SPACE not in text or self._space_bytes is None:
            return self._sp.encode(text)
        ids: List[int] = []
        for k, part in enumerate(text.split(_SPACE)):
            if k:
                ids.extend(self._space_bytes)
            ids.extend(self._sp.encode(part))
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: Optional[int] = None) -> List[List[int]]:
        out = self._sp.encode(list(texts), num_threads=_threads(num_threads))
        for k, text in enumerate(texts):
            if _SPACE in text:  # rare: redo the few texts that need the escape
                out[k] = self.encode(text)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(directory / "tokenizer.model", self._proto)
        meta = {"type": "sentencepiece", "model": "tokenizer.model", "vocab_size": self.vocab_size}
        _atomic_write(directory / "tokenizer.json", json.dumps(meta, indent=1).encode())
        return directory

    @classmethod
    def train(cls, corpus: StdlibCorpus, vocab_size: int, cache_dir: Optional[Union[str, os.PathLike]] = None,
              num_threads: Optional[int] = None) -> "SentencePieceTokenizer":
        """Train on the corpus, or reuse the model cached for this corpus and these settings."""
        if cache_dir is None:
            return cls(_train_proto(corpus, vocab_size, num_threads))
        key = stable_hash("sentencepiece", spm.__version__, corpus.fingerprint(), str(vocab_size),
                          json.dumps(_TRAIN_OPTIONS, sort_keys=True), str(_MAX_SENTENCES))
        root = Path(cache_dir).expanduser() / "tokenizers"
        entry = root / key
        with locked(root / f"{key}.lock"):
            if (entry / "tokenizer.model").is_file():
                log.info("tokenizer: reusing %s", entry / "tokenizer.model")
                return cls(entry / "tokenizer.model")
            proto = _train_proto(corpus, vocab_size, num_threads)
            # Build the entry in a temp dir and rename it into place, so an interrupted
            # run never leaves a half-written model where the cache looks for one.
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}."))
            (tmp / "tokenizer.model").write_bytes(proto)
            (tmp / "settings.json").write_text(json.dumps(
                {"vocab_size": vocab_size, "documents": len(corpus), **_TRAIN_OPTIONS}, indent=1))
            if entry.exists():
                shutil.rmtree(entry)  # a leftover without a model; we hold the lock
            os.replace(tmp, entry)
        return cls(entry / "tokenizer.model")


def _train_proto(corpus: StdlibCorpus, vocab_size: int, num_threads: Optional[int]) -> bytes:
    start = time.perf_counter()
    lines = [line for text in corpus.texts() for line in text.split("\n") if line.strip()]
    if len(lines) > _MAX_SENTENCES:
        lines = random.Random(0).sample(lines, _MAX_SENTENCES)
    log.info("tokenizer: training a %d-piece sentencepiece BPE on %d lines of %d documents",
             vocab_size, len(lines), len(corpus))
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                    num_threads=_threads(num_threads), input_sentence_size=0, minloglevel=2,
                    **_TRAIN_OPTIONS)
    except RuntimeError as e:
        raise ValueError(f"sentencepiece could not train a {vocab_size}-piece vocabulary on "
                         f"{len(corpus)} documents ({len(lines)} lines): {e}") from None
    proto = buf.getvalue()
    log.info("tokenizer: trained in %.1f s", time.perf_counter() - start)
    return proto


class NullTokenizer(Tokenizer):
    """For pre-tokenized data: text is space-separated ids; ids are used as they are."""

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise ValueError(f"null tokenizer vocab_size={vocab_size} must be at least 2")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.identity = f"null:{vocab_size}"

    def encode(self, text: str) -> List[int]:
        return [int(tok) for tok in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"type": "null", "vocab_size": self.vocab_size}
        _atomic_write(directory / "tokenizer.json", json.dumps(meta, indent=1).encode())
        return directory


def load_tokenizer(directory: Union[str, os.PathLike]) -> Tokenizer:
    """Rebuild a tokenizer written by `save_to(directory)`."""
    directory = Path(directory).expanduser()
    meta_path = directory / "tokenizer.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} does not exist (write it with tokenizer.save_to)")
    meta = json.loads(meta_path.read_text())
    kind = meta.get("type")
    if kind == "sentencepiece":
        return SentencePieceTokenizer(directory / meta.get("model", "tokenizer.model"))
    if kind == "null":
        return NullTokenizer(int(meta["vocab_size"]))
    raise ValueError(f"{meta_path}: unknown tokenizer type {kind!r} (sentencepiece | null)")


def build_tokenizer(cfg, corpus: Optional[StdlibCorpus] = None,
                    cache_dir: Optional[Union[str, os.PathLike]] = None) -> Tokenizer:
    """The tokenizer a TokenizerConfig asks for; trains (cached) on `corpus` if no model is given."""
    if cfg.type == "null":
        return NullTokenizer(cfg.vocab_size)
    if cfg.type != "sentencepiece":
        raise ValueError(f"tokenizer.type={cfg.type!r} is not one of sentencepiece, null")
    if cfg.model:
        return SentencePieceTokenizer(cfg.model)
    if corpus is None:
        raise ValueError("tokenizer.type=sentencepiece needs tokenizer.model (a .model path) "
                         "when there is no text corpus to train one on")
    return SentencePieceTokenizer.train(corpus, cfg.vocab_size, cache_dir)
