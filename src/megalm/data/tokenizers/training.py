"""Training a tokenizer on the documents of JSON-lines or text files, into a folder load_tokenizer
reads: the work of `python -m megalm.data.train_tokenizer`.

--type sentencepiece (default) trains a lossless sentencepiece BPE (or unigram) with the options
megalm uses for its own corpus: identity normalization, whitespace kept, byte fallback; the
input's non-blank lines are the training sentences, at most max_sentences of them sampled
uniformly while streaming. --type bytelevel-bpe trains a GPT-2-style byte-level BPE
tokenizer.json with the `tokenizers` package (megalm[hf]), with <|endoftext|> as end-of-document.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from megalm.data.formats.corpus_files import PreprocessError, expand_inputs, read_chunks, texts_of
from megalm.data.tokenizers.base import Tokenizer
from megalm.data.tokenizers.huggingface import HuggingFaceTokenizer, import_tokenizers
from megalm.data.tokenizers.sentencepiece import (MAX_SENTENCES, SentencePieceTokenizer, train_sentencepiece,
                                                  training_lines)
from megalm.errors import ConfigError, DataError

log = logging.getLogger("megalm.data.train_tokenizer")


def iter_texts(inputs: Sequence[str], json_keys: Sequence[str] = ("text",), input_format: str = "auto",
               text_document: str = "paragraph") -> Iterator[str]:
    """The documents' text, streamed, as preprocessing would see it."""
    files = expand_inputs(inputs)
    for chunk in read_chunks(files, input_format=input_format, text_document=text_document):
        for values in texts_of(chunk, tuple(json_keys)).values():
            for v in values:
                if not isinstance(v, str):
                    raise PreprocessError(f"{chunk.file}: a tokenizer trains on text, not lists of ids")
                yield v


def train_bytelevel_bpe(texts: Iterator[str], vocab_size: int, max_sentences: int = MAX_SENTENCES) -> str:
    """A GPT-2-style byte-level BPE tokenizer.json (as a string) trained on the texts' lines."""
    tk = import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers  # lazy: an optional extra (megalm[hf])
    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [line + "\n" for line in training_lines(texts, max_sentences)]
    if not lines:
        raise DataError("nothing to train on: the corpus has no non-blank lines")
    tok.train_from_iterator(lines, trainer)
    return tok.to_str()


def train(inputs: Sequence[str], output: str, *, vocab_size: int, kind: str = "sentencepiece",
          json_keys: Sequence[str] = ("text",), input_format: str = "auto", text_document: str = "paragraph",
          model_type: str = "bpe", max_sentences: int = MAX_SENTENCES,
          num_threads: Optional[int] = None, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """Train on the inputs and save into the folder `output`; return the tokenizer.

    special_tokens (sentencepiece): ids reserved for tokens text never maps to (BERT's [CLS] [SEP] [MASK] [PAD])."""
    start = time.perf_counter()
    out = Path(output).expanduser()
    if vocab_size < 1:
        raise ConfigError(f"--vocab-size {vocab_size} must be at least 1")
    if out.exists() and not out.is_dir():  # said before training, not after
        raise ConfigError(f"--output {out} is a file; name a folder to write the tokenizer into")
    texts = iter_texts(inputs, json_keys, input_format, text_document)
    if kind == "sentencepiece":
        tok: Tokenizer = SentencePieceTokenizer(train_sentencepiece(
            texts, vocab_size, num_threads=num_threads, max_sentences=max_sentences, model_type=model_type,
            special_tokens=special_tokens))
        tok.save_to(out)
    elif kind == "bytelevel-bpe":
        if special_tokens:
            raise ConfigError(f"--special-tokens {' '.join(special_tokens)} is for --type sentencepiece only")
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".tokenizer.json.tmp"
        tmp.write_text(train_bytelevel_bpe(texts, vocab_size, max_sentences))
        tok = HuggingFaceTokenizer(tmp)
        tok.save_to(out)
        tmp.unlink()
    else:
        raise ConfigError(f"--type {kind!r} is not one of sentencepiece, bytelevel-bpe")
    log.info("train_tokenizer: %s, %d ids, eod %d, in %.1f s -> %s", tok.identity, tok.vocab_size, tok.eod,
             time.perf_counter() - start, out)
    return tok
