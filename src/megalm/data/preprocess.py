"""Raw text to Megatron .bin/.idx: `python -m megalm.data.preprocess` (or scripts/preprocess_data.py).

    python -m megalm.data.preprocess --input 'corpus/*.jsonl' --output-prefix out/corpus \\
        --json-keys text --append-eod --workers 8 \\
        --tokenizer-type sentencepiece --tokenizer-model tok/tokenizer.model
    python -m megalm.data.preprocess --merge out/part0_text_document out/part1_text_document \\
        --output-prefix out/all_text_document

The command's options and signals; the work (reading, tokenizing in worker processes, writing in
input order, merging) is megalm.data.corpora.preprocess's.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Optional, Sequence

from megalm.config import TokenizerConfig
from megalm.data.preprocessing.pipeline import STOP, merge, preprocess
from megalm.data.formats.corpus_files import TEXT_DOCUMENT_MODES
from megalm.data.tokenizers.build import TOKENIZER_TYPES
from megalm.errors import ConfigError, cli_errors

PROG = "megalm.data.preprocess"
_MEGATRON_TOKENIZER_NAMES = {  # Megatron's --tokenizer-type values, for familiar command lines
    "sentencepiecetokenizer": "sentencepiece", "gptsentencepiecetokenizer": "sentencepiece",
    "huggingfacetokenizer": "huggingface", "hf": "huggingface", "nulltokenizer": "null",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", help="input files or glob patterns (JSON lines or text; .gz works)")
    p.add_argument("--output-prefix", required=True, help="output path prefix (merge: the full output prefix)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize, one output each")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's eod id")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (for BERT), into {prefix}_{key}_sentence; needs blingfire")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--tokenizer-type", default="sentencepiece",
                   help=f"{' | '.join(TOKENIZER_TYPES)} (Megatron's names work too)")
    p.add_argument("--tokenizer-model", help="sentencepiece .model, or Hugging Face tokenizer.json / its folder")
    p.add_argument("--vocab-size", type=int, default=TokenizerConfig.vocab_size,
                   help="null tokenizer: the id range")
    p.add_argument("--eod-token", help="huggingface: the end-of-document token (default: found by name)")
    p.add_argument("--add-special-tokens", action="store_true",
                   help="huggingface: apply the tokenizer.json post-processor (e.g. Llama's <s>)")
    p.add_argument("--input-format", default="auto", choices=("auto", "jsonl", "text"),
                   help="auto: .jsonl/.json/.ndjson are JSON lines, anything else text")
    p.add_argument("--text-document", default="paragraph", choices=TEXT_DOCUMENT_MODES,
                   help="plain text: what one document is")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="raw input per unit of work")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.add_argument("--merge", nargs="+", metavar="PREFIX",
                   help="instead of tokenizing: merge these datasets (prefixes or globs) into --output-prefix")
    return p


def tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    kind = _MEGATRON_TOKENIZER_NAMES.get(args.tokenizer_type.lower(), args.tokenizer_type.lower())
    if kind not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
    if kind != "null" and not args.tokenizer_model:
        raise ConfigError(f"--tokenizer-type {kind} needs --tokenizer-model")
    return TokenizerConfig(type=kind, model=args.tokenizer_model, vocab_size=args.vocab_size,
                           eod_token=args.eod_token, add_special_tokens=args.add_special_tokens)


def _note_stop(signum, frame) -> None:
    # Only note it: preprocess() stops at its next check (every chunk, and every 0.2 s while it
    # waits for a worker) with KeyboardInterrupt, which kills the workers and aborts the writers.
    STOP.set()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    STOP.clear()
    with cli_errors(PROG):
        try:
            if args.merge:
                if args.input:
                    raise ConfigError("--merge and --input do not go together")
                # merge_datasets removes its temporaries on any exception: interrupt it anywhere
                signal.signal(signal.SIGTERM, _interrupt)
                signal.signal(signal.SIGINT, _interrupt)
                merge(args.merge, args.output_prefix)
                return 0
            if not args.input:
                raise ConfigError("give --input files (or --merge prefixes)")
            signal.signal(signal.SIGTERM, _note_stop)
            signal.signal(signal.SIGINT, _note_stop)
            preprocess(args.input, args.output_prefix, tokenizer=tokenizer_config(args), json_keys=args.json_keys,
                       append_eod=args.append_eod, workers=args.workers, input_format=args.input_format,
                       text_document=args.text_document, chunk_mb=args.chunk_mb, progress=args.progress,
                       split_sentences=args.split_sentences)
            return 0
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted; no output was written", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
