"""The tokenizer a config asks for (`build_tokenizer`: sentencepiece, huggingface or null; a
sentencepiece model trained on the corpus when none is given), and reading one back from the
folder it was saved to (`load_tokenizer`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

from megalm.data.corpora.stdlib import StdlibCorpus
from megalm.data.tokenizers.base import NullTokenizer, Tokenizer
from megalm.data.tokenizers.huggingface import HuggingFaceTokenizer
from megalm.data.tokenizers.sentencepiece import SentencePieceTokenizer
from megalm.errors import DataError, MissingFileError

TOKENIZER_TYPES = ("sentencepiece", "huggingface", "null")


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
        return HuggingFaceTokenizer(meta_path)  # its megalm_tokenizer.json beside it, when there is one
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
