"""Hugging Face tokenizers: a `tokenizer.json` (GPT-2 byte-level BPE, Llama-style BPE with byte
fallback, ...) read through the `tokenizers` package (the optional extra `megalm[hf]`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Union

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
    of HF_EOD_CANDIDATES that the vocabulary has. What the file cannot say is read from megalm_tokenizer.json
    beside it, when there is one (an imported model's or a run's): the end token where `eod_token` is not given,
    `add_special_tokens` where it is None, the tokens a document starts with ("start_tokens", absent: the
    end-of-document token) and the model's Jinja chat template ("chat_template").
    """

    def __init__(self, path: Union[str, os.PathLike], eod_token: Optional[str] = None,
                 add_special_tokens: Optional[bool] = None):
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
        side = _sidecar(path.parent / HF_SIDECAR)
        eod_token = eod_token or side.get("eod_token")
        if add_special_tokens is None:
            add_special_tokens = side.get("add_special_tokens", False)
        self.start_tokens, self.chat_template = side.get("start_tokens"), side.get("chat_template")
        self.bos_token = side.get("bos_token")  # what a chat template calls bos_token
        if self.start_tokens is not None:
            missing = [t for t in self.start_tokens if self._tok.token_to_id(t) is None]
            if missing:
                raise DataError(f"{path.parent / HF_SIDECAR}: start_tokens {missing} are not in {path.name}")
            self._start = [self._tok.token_to_id(t) for t in self.start_tokens]
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

    @property
    def start(self) -> List[int]:
        return [self.eod] if self.start_tokens is None else list(self._start)

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def apply_chat_template(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as the model's Jinja chat template writes it, rendered as transformers' apply_chat_template
        renders it (a sandbox, trimmed blocks, bos_token and eos_token set); with the assistant's opening after it
        when `add_generation_prompt`."""
        return render_chat(self.chat_template, messages, add_generation_prompt, bos_token=self.bos_token or "",
                           eos_token=self.eod_token)

    def own_start_tokens(self) -> List[str]:
        """The tokens this tokenizer.json's post-processor puts in front of a text (Llama's <s>; none for many):
        an imported model's start, as Hugging Face's tokenizer(text) gives it."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        head = full[:full.index(plain[0])] if plain and plain[0] in full else []
        return [self._tok.id_to_token(i) for i in head]

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
        meta.update({k: v for k, v in (("start_tokens", self.start_tokens), ("bos_token", self.bos_token),
                                       ("chat_template", self.chat_template)) if v is not None})
        atomic_write(directory / HF_SIDECAR, json.dumps(meta, indent=1).encode())
        return directory


def _sidecar(path: Path) -> dict:
    """megalm_tokenizer.json's fields; {} when there is none."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not JSON: {e}") from None
    starts = meta.get("start_tokens") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not (starts is None or isinstance(starts, list) and all(
            isinstance(t, str) for t in starts)) or not isinstance(meta.get("chat_template", ""), str):
        raise DataError(f"{path}: expected an object whose start_tokens is a list of token strings and chat_template "
                        "a string")
    return meta


def render_chat(template: str, messages: List[Dict[str, str]], add_generation_prompt: bool, **tokens: str) -> str:
    """A Jinja chat template rendered with the environment Hugging Face chat templates are written for (jinja2,
    torch's own dependency: this is that library's sandbox, set up as the templates expect)."""
    import jinja2  # lazy: only chats of imported models render one
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise DataError(f"the model's chat template refused the chat: {message}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **tokens)
    except jinja2.TemplateError as e:
        raise DataError(f"the model's chat template cannot be rendered: {e}") from None
