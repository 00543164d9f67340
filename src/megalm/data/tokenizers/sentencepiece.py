"""Sentencepiece tokenizers: loaded from a .model file, or trained on a corpus (cached, or by
`python -m megalm.data.train_tokenizer`) with options that make them lossless on source code.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import sentencepiece as spm

from megalm.data.formats.cache import locked, stable_hash
from megalm.data.tokenizers.base import Tokenizer, atomic_write
from megalm.errors import ConfigError, DataError, MissingFileError

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
MAX_SENTENCES = 1_000_000
_SPACE = "\u2581"  # sentencepiece's space marker


def _threads(num_threads: Optional[int]) -> int:
    return num_threads or len(os.sched_getaffinity(0)) or 1


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model: Union[str, os.PathLike, bytes]):
        where = "the model bytes given"
        if not isinstance(model, bytes):
            path = Path(model).expanduser()
            if path.is_dir():  # the folder train_tokenizer (or a run) wrote: its tokenizer.model
                if not (path / "tokenizer.model").is_file():
                    raise MissingFileError(f"sentencepiece model {path} is a folder without a tokenizer.model in it; "
                                           "give the .model file")
                path = path / "tokenizer.model"
            if not path.is_file():
                raise MissingFileError(f"sentencepiece model {path} does not exist")
            model, self.origin = path.read_bytes(), str(path)
            where = str(path)
        self._proto = model
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model)
        except RuntimeError:
            hint = ""
            if model.lstrip()[:1] in (b"{", b"["):
                hint = ("; it is JSON: a Hugging Face tokenizer.json takes data.tokenizer.type=huggingface, and a "
                        "megalm run directory's tokenizer.json only records its tokenizer (its model is "
                        "RUN/tokenizer.model)")
            raise DataError(f"{where} is not a sentencepiece model ({len(model)} bytes do not parse as one){hint}") \
                from None
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise DataError("the sentencepiece model has no eos piece to use as end-of-document")
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

    def token_to_id(self, piece: str) -> Optional[int]:
        i = self._sp.piece_to_id(piece)  # an unknown piece maps to <unk>'s id
        return i if self._sp.id_to_piece(i) == piece else None

    def pieces(self) -> List[str]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    def save_to(self, directory: Union[str, os.PathLike]) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / "tokenizer.model", self._proto)
        meta = {"type": "sentencepiece", "model": "tokenizer.model", "vocab_size": self.vocab_size}
        atomic_write(directory / "tokenizer.json", json.dumps(meta, indent=1).encode())
        return directory

    @classmethod
    def train(cls, corpus, vocab_size: int, cache_dir: Optional[Union[str, os.PathLike]] = None,
              num_threads: Optional[int] = None, special_tokens: Sequence[str] = ()) -> "SentencePieceTokenizer":
        """Train on the corpus (texts() and fingerprint()), or reuse the model cached for this
        corpus and these settings. `special_tokens` get ids of their own that text never maps to."""
        special_tokens = list(special_tokens)
        if cache_dir is None:
            return cls(train_sentencepiece(corpus.texts(), vocab_size, num_threads=num_threads,
                                           special_tokens=special_tokens))
        key = stable_hash("sentencepiece", spm.__version__, corpus.fingerprint(), str(vocab_size),
                          json.dumps(_TRAIN_OPTIONS, sort_keys=True), str(MAX_SENTENCES),
                          *([json.dumps(special_tokens)] if special_tokens else []))
        root = Path(cache_dir).expanduser() / "tokenizers"
        entry = root / key
        with locked(root / f"{key}.lock"):
            if (entry / "tokenizer.model").is_file():
                log.info("tokenizer: reusing %s", entry / "tokenizer.model")
                return cls(entry / "tokenizer.model")
            proto = train_sentencepiece(corpus.texts(), vocab_size, num_threads=num_threads,
                                        special_tokens=special_tokens)
            # Build the entry in a temp dir and rename it into place, so an interrupted
            # run never leaves a half-written model where the cache looks for one.
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}."))
            (tmp / "tokenizer.model").write_bytes(proto)
            (tmp / "settings.json").write_text(json.dumps(
                {"vocab_size": vocab_size, "documents": len(corpus), "special_tokens": special_tokens,
                 **_TRAIN_OPTIONS}, indent=1))
            if entry.exists():
                shutil.rmtree(entry)  # a leftover without a model; we hold the lock
            os.replace(tmp, entry)
        return cls(entry / "tokenizer.model")


def training_lines(texts: Iterable[str], max_sentences: int = MAX_SENTENCES, seed: int = 0) -> List[str]:
    """The non-blank lines of the texts; a uniform sample of max_sentences of them when there are more.

    Streams: memory holds at most max_sentences lines (reservoir sampling), never the corpus.
    """
    lines: List[str] = []
    rng = random.Random(seed)
    seen = 0
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            if len(lines) < max_sentences:
                lines.append(line)
            else:
                j = rng.randrange(seen + 1)
                if j < max_sentences:
                    lines[j] = line
            seen += 1
    return lines


def train_sentencepiece(texts: Iterable[str], vocab_size: int, *, num_threads: Optional[int] = None,
                        max_sentences: int = MAX_SENTENCES, model_type: str = "bpe",
                        special_tokens: Sequence[str] = ()) -> bytes:
    """Train a lossless sentencepiece model on the lines of `texts`; return the model bytes.

    `special_tokens` become control symbols: ids right after <unk>, <s>, </s>, which encode() never
    produces from text (so a literal "[MASK]" in a document stays text)."""
    if vocab_size < 1:
        raise ConfigError(f"a sentencepiece vocabulary of {vocab_size} pieces: the size must be at least 1")
    start = time.perf_counter()
    lines = training_lines(texts, max_sentences)
    log.info("tokenizer: training a %d-piece sentencepiece %s on %d lines", vocab_size, model_type, len(lines))
    if not lines:
        raise DataError("sentencepiece has nothing to train on: the corpus has no non-blank lines")
    buf = io.BytesIO()
    options = dict(_TRAIN_OPTIONS, model_type=model_type)
    if special_tokens:
        clash = [t for t in special_tokens if t in options["user_defined_symbols"] or not t or t != t.strip()]
        if clash or len(set(special_tokens)) != len(special_tokens):
            raise ConfigError(f"tokenizer.special_tokens={list(special_tokens)} must be distinct, non-blank "
                              f"tokens without surrounding spaces{f' (not {clash})' if clash else ''}")
        options["control_symbols"] = list(special_tokens)
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                       num_threads=_threads(num_threads), input_sentence_size=0, minloglevel=2,
                                       **options)
    except RuntimeError as e:
        small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e))
        if small:  # sentencepiece's advice names its own option, which megalm does not expose
            raise ConfigError(f"a {vocab_size}-piece vocabulary is too small for this corpus: its characters and "
                              f"special pieces alone need {small.group(2)}; set the vocabulary size "
                              f"(data.tokenizer.vocab_size, or train_tokenizer's --vocab-size) to at least "
                              f"{small.group(2)}") from None
        raise DataError(f"sentencepiece could not train a {vocab_size}-piece vocabulary on "
                        f"{len(lines)} lines: {e}") from None
    proto = buf.getvalue()
    log.info("tokenizer: trained in %.1f s", time.perf_counter() - start)
    return proto

