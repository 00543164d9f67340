"""Tokenizers behind one small interface.

- sentencepiece: trained on a corpus (cached, or by scripts/train_tokenizer.py) or loaded from a
  .model file; trained with options that make it lossless on source code.
- huggingface: a `tokenizer.json` (GPT-2 byte-level BPE, Llama-style BPE with byte fallback, ...)
  through the `tokenizers` package (the optional extra `megalm[hf]`).
- null: for data that is already token ids.

`padded_vocab_size` is Megatron's embedding padding: a multiple of divisible_by x tp.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import sentencepiece as spm

from megalm.data.corpora import StdlibCorpus
from megalm.data.formats.cache import locked, stable_hash
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
_MAX_SENTENCES = 1_000_000
_SPACE = "\u2581"  # sentencepiece's space marker
# End-of-document candidates of common tokenizer.json files, in order of preference.
HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
_HF_SIDECAR = "megalm_tokenizer.json"  # what a tokenizer.json cannot say: our eod and options
TOKENIZER_TYPES = ("sentencepiece", "huggingface", "null")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary: vocab_size rounded up to a multiple of divisible_by * tp.

    Each tensor-parallel rank then holds an equal, aligned slice of the embedding and output layer.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp < 1:
        raise DataError(f"padded_vocab_size needs positive numbers (vocab_size={vocab_size}, "
                        f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, tp={tp})")
    multiple = make_vocab_size_divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


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
    """Names this exact vocabulary, for cache keys of tokenized data and the records of what made a corpus."""
    origin: Optional[str] = None
    """The file it was read from, for messages; None when built in memory."""

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
        _atomic_write(directory / "tokenizer.model", self._proto)
        meta = {"type": "sentencepiece", "model": "tokenizer.model", "vocab_size": self.vocab_size}
        _atomic_write(directory / "tokenizer.json", json.dumps(meta, indent=1).encode())
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
                          json.dumps(_TRAIN_OPTIONS, sort_keys=True), str(_MAX_SENTENCES),
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


def training_lines(texts: Iterable[str], max_sentences: int = _MAX_SENTENCES, seed: int = 0) -> List[str]:
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
                        max_sentences: int = _MAX_SENTENCES, model_type: str = "bpe",
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


def _import_tokenizers():
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
        tokenizers = _import_tokenizers()
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
        _atomic_write(directory / "tokenizer.json", self._json)
        meta = {"type": "huggingface", "eod_token": self.eod_token,
                "add_special_tokens": self.add_special_tokens, "vocab_size": self.vocab_size}
        _atomic_write(directory / _HF_SIDECAR, json.dumps(meta, indent=1).encode())
        return directory


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
        _atomic_write(directory / "tokenizer.json", json.dumps(meta, indent=1).encode())
        return directory


def load_tokenizer(directory: Union[str, os.PathLike]) -> Tokenizer:
    """Rebuild a tokenizer written by `save_to(directory)`; a plain HF tokenizer.json folder works too."""
    directory = Path(directory).expanduser()
    meta_path = directory / "tokenizer.json"
    if not meta_path.is_file():
        raise MissingFileError(f"{meta_path} does not exist (write it with tokenizer.save_to)")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not JSON: {e}") from None
    kind = meta.get("type") if isinstance(meta, dict) else None
    if kind == "sentencepiece":
        return SentencePieceTokenizer(directory / meta.get("model", "tokenizer.model"))
    if kind == "null":
        return NullTokenizer(int(meta["vocab_size"]))
    if isinstance(meta, dict) and isinstance(meta.get("model"), dict):  # a Hugging Face tokenizer.json
        side = directory / _HF_SIDECAR
        extra = json.loads(side.read_text()) if side.is_file() else {}
        return HuggingFaceTokenizer(meta_path, extra.get("eod_token"), extra.get("add_special_tokens", False))
    raise DataError(f"{meta_path}: unknown tokenizer type {kind!r} (sentencepiece | null, or a Hugging "
                    "Face tokenizer.json)")


def build_tokenizer(cfg, corpus: Optional[StdlibCorpus] = None,
                    cache_dir: Optional[Union[str, os.PathLike]] = None) -> Tokenizer:
    """The tokenizer a TokenizerConfig asks for; trains (cached) on `corpus` if no model is given."""
    if cfg.type == "null":
        return NullTokenizer(cfg.vocab_size)
    if cfg.type == "huggingface":
        if not cfg.model:
            raise DataError("tokenizer.type=huggingface needs tokenizer.model: a tokenizer.json or its folder")
        return _has_special_tokens(HuggingFaceTokenizer(cfg.model, getattr(cfg, "eod_token", None),
                                                        getattr(cfg, "add_special_tokens", False)), cfg)
    if cfg.type != "sentencepiece":
        raise DataError(f"tokenizer.type={cfg.type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
    if cfg.model:
        return _has_special_tokens(SentencePieceTokenizer(cfg.model), cfg)
    if corpus is None:
        raise DataError("tokenizer.type=sentencepiece needs tokenizer.model (a .model path) "
                        "when there is no text corpus to train one on")
    return SentencePieceTokenizer.train(corpus, cfg.vocab_size, cache_dir,
                                        special_tokens=getattr(cfg, "special_tokens", ()))


def _has_special_tokens(tokenizer: Tokenizer, cfg) -> Tokenizer:
    """A given tokenizer must hold the special_tokens the config names (megalm reserves them only
    in a model it trains)."""
    missing = [t for t in getattr(cfg, "special_tokens", ()) if tokenizer.token_to_id(t) is None]
    if missing:
        raise DataError(f"tokenizer.special_tokens names {', '.join(missing)}, which {tokenizer.origin} does not "
                        "have; use a tokenizer with them, or set data.tokenizer.special_tokens=[] if they are "
                        "not needed")
    return tokenizer
