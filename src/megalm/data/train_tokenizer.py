"""Train a tokenizer on a corpus: `python -m megalm.data.train_tokenizer` (or scripts/train_tokenizer.py).

    python -m megalm.data.train_tokenizer --input 'corpus/*.jsonl' --json-keys text \\
        --vocab-size 32000 --output tok/
    # then: data.tokenizer.model=tok/tokenizer.model, or --tokenizer-model tok/tokenizer.model

--type sentencepiece (default) trains a lossless sentencepiece BPE (or unigram) with the options
megalm uses for its own corpus: identity normalization, whitespace kept, byte fallback; the
input's non-blank lines are the training sentences, at most --max-sentences of them sampled
uniformly while streaming. --type bytelevel-bpe trains a GPT-2-style byte-level BPE
tokenizer.json with the `tokenizers` package (megalm[hf]), with <|endoftext|> as end-of-document.
The folder it writes loads with load_tokenizer(folder) and works as tokenizer.model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from megalm.data.preprocess import PreprocessError, TEXT_DOCUMENT_MODES, _texts_of, expand_inputs, read_chunks
from megalm.data.tokenizer import (_MAX_SENTENCES, HuggingFaceTokenizer, SentencePieceTokenizer, Tokenizer,
                                   _import_tokenizers, train_sentencepiece, training_lines)
from megalm.errors import ConfigError, DataError, cli_errors

log = logging.getLogger("megalm.data.train_tokenizer")
PROG = "megalm.data.train_tokenizer"


def iter_texts(inputs: Sequence[str], json_keys: Sequence[str] = ("text",), input_format: str = "auto",
               text_document: str = "paragraph") -> Iterator[str]:
    """The documents' text, streamed, as preprocessing would see it."""
    files = expand_inputs(inputs)
    for chunk in read_chunks(files, input_format=input_format, text_document=text_document):
        for values in _texts_of(chunk, tuple(json_keys)).values():
            for v in values:
                if not isinstance(v, str):
                    raise PreprocessError(f"{chunk.file}: a tokenizer trains on text, not lists of ids")
                yield v


def train_bytelevel_bpe(texts: Iterator[str], vocab_size: int, max_sentences: int = _MAX_SENTENCES) -> str:
    """A GPT-2-style byte-level BPE tokenizer.json (as a string) trained on the texts' lines."""
    tk = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers
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
          model_type: str = "bpe", max_sentences: int = _MAX_SENTENCES,
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="input files or globs (JSON lines or text)")
    p.add_argument("--output", required=True, help="folder to write the tokenizer into")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--type", default="sentencepiece", choices=("sentencepiece", "bytelevel-bpe"))
    p.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"), help="sentencepiece algorithm")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--input-format", default="auto", choices=("auto", "jsonl", "text"))
    p.add_argument("--text-document", default="paragraph", choices=TEXT_DOCUMENT_MODES)
    p.add_argument("--max-sentences", type=int, default=_MAX_SENTENCES, help="lines sampled for training")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--special-tokens", nargs="+", default=[], metavar="TOKEN",
                   help="sentencepiece: reserve ids for these (for BERT: [CLS] [SEP] [MASK] [PAD])")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with cli_errors(PROG):  # a user mistake: `prog: kind: message` on stderr and exit code 1
        tok = train(args.input, args.output, vocab_size=args.vocab_size, kind=args.type, json_keys=args.json_keys,
                    input_format=args.input_format, text_document=args.text_document, model_type=args.model_type,
                    max_sentences=args.max_sentences, num_threads=args.threads, special_tokens=args.special_tokens)
    print(json.dumps({"output": str(Path(args.output)), "vocab_size": tok.vocab_size, "eod": tok.eod,
                      "identity": tok.identity}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
