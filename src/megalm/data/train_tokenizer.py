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
from pathlib import Path
from typing import Optional, Sequence

from megalm.data.formats.corpus_files import TEXT_DOCUMENT_MODES
from megalm.data.tokenizers.sentencepiece import MAX_SENTENCES
from megalm.data.tokenizers.training import train
from megalm.errors import cli_errors

PROG = "megalm.data.train_tokenizer"


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
    p.add_argument("--max-sentences", type=int, default=MAX_SENTENCES, help="lines sampled for training")
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
