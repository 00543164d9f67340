"""Raw text to Megatron .bin/.idx: the work of `python -m megalm.data.preprocess`.

Inputs are JSON lines (one object per line; each key holds a document, written to
`{prefix}_{key}_document.bin/.idx` as Megatron's tools/preprocess_data.py names them) or plain
text (one document per paragraph, line or file), optionally gzipped (megalm.data.formats.corpus_files
reads them). With split_sentences (for BERT) each document is split into sentences
(`megalm.data.corpora.sentences`) and each sentence is one sequence of its document, in
`{prefix}_{key}_sentence.bin/.idx`; append_eod then ends each document's last sentence with eod, and
sentences that tokenize to nothing are left out (a document left with none is skipped as empty). The
input streams through in chunks of about chunk_mb of raw bytes; with N workers, processes
(megalm.data.corpora.workers) parse and tokenize the chunks while the main process writes the results
in input order, so the output is byte for byte the same for any N and memory stays bounded by the
chunks in flight. Documents that tokenize to nothing are skipped and counted; a corpus that yields no
document at all is an error, not an empty dataset. Output files appear only when complete (the
writer's temporary names and renames), so an interrupted or failed run leaves nothing that looks
finished. Beside each output, `<prefix>.megalm.json` records the tokenizer that made it
(`megalm.data.provenance`); a merge carries that record over when every input has the same one, and
refuses inputs made by different tokenizers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob as globlib
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from megalm.config import TokenizerConfig
from megalm.data.corpora import sentences
from megalm.data.preprocessing.workers import Workers
from megalm.data.formats.corpus_files import (Chunk, PreprocessError, expand_inputs, input_kind, read_chunks,
                                              texts_of)
from megalm.data.formats.indexed import IndexedDataset, best_dtype
from megalm.data.formats.indexed_writer import IndexedDatasetWriter, merge_datasets
from megalm.data.provenance import describe, read_provenance, sidecar_path, write_provenance, write_record
from megalm.data.tokenizers.base import Tokenizer
from megalm.data.tokenizers.build import build_tokenizer
from megalm.errors import ConfigError, DataError, MissingFileError

log = logging.getLogger("megalm.data.preprocess")  # named after the command, whose logs these are


@dataclass
class PreprocessStats:
    documents: int = 0
    """Records read (JSON lines, or text documents)."""
    bytes: int = 0
    """Raw input bytes read."""
    seconds: float = 0.0
    tokens: Dict[str, int] = field(default_factory=dict)
    """Tokens written per key (eod included)."""
    written: Dict[str, int] = field(default_factory=dict)
    """Documents written per key."""
    sequences: Dict[str, int] = field(default_factory=dict)
    """Sequences written per key: the sentences with --split-sentences, else one per document."""
    skipped_empty: Dict[str, int] = field(default_factory=dict)
    """Documents per key that tokenized to nothing and were left out."""
    outputs: Dict[str, str] = field(default_factory=dict)
    """Output prefix per key."""

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)



# ---------------------------------------------------------------- tokenizing (in the workers)

_STATE: Dict[str, Any] = {}


def _init_worker(tok_cfg: dict, keys: Tuple[str, ...], append_eod: bool, num_threads: int,
                 split_sentences: bool = False) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false" if num_threads == 1 else "true")
    tokenizer = build_tokenizer(TokenizerConfig(**tok_cfg))
    _STATE.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod, num_threads=num_threads,
                  split_sentences=split_sentences)



def _encode(tokenizer: Tokenizer, strings: List[str], chunk: Chunk, key: str, lines: List[int]) -> List[List[int]]:
    """The ids of each string; `lines` holds the input line of each, to name in an error."""
    try:
        return tokenizer.encode_batch(strings, num_threads=_STATE["num_threads"])
    except ValueError:  # find the document to blame
        for line, text in zip(lines, strings):
            try:
                tokenizer.encode(text)
            except ValueError as e:
                raise PreprocessError(f"{chunk.file}:{line}: {key!r}: {e}") from None
        raise


class Encoded(NamedTuple):
    """One key's part of a chunk, ready for IndexedDatasetWriter.add_documents."""
    tokens: np.ndarray
    """The ids of all sequences back to back (eod included)."""
    lengths: np.ndarray
    """Tokens per sequence."""
    sequences_per_document: Optional[np.ndarray]
    """Sequences (sentences) of each document with --split-sentences; None: one sequence per document."""
    empty: int
    """Documents skipped because they tokenized to nothing."""

    @property
    def documents(self) -> int:
        return self.lengths.size if self.sequences_per_document is None else self.sequences_per_document.size


def _sequences_of(chunk: Chunk, key: str, values: List[Any], tokenizer: Tokenizer,
                  split: bool) -> Tuple[List[List[int]], np.ndarray]:
    """The ids of every sequence of the documents in `values`, and the document (0-based) of each."""
    parts = [(sentences.split_sentences(v) if split else [v]) if isinstance(v, str) else None for v in values]
    strings = [text for p in parts if p is not None for text in p]  # whole documents, or their sentences
    lines = [line for line, p in zip(chunk.lines, parts) if p is not None for _ in p]
    encoded = iter(_encode(tokenizer, strings, chunk, key, lines) if strings else [])
    seqs: List[List[int]] = []
    seq_doc: List[int] = []
    for d, (line, v, p) in enumerate(zip(chunk.lines, values, parts)):
        if p is not None:
            seqs += [next(encoded) for _ in p]
            seq_doc += [d] * len(p)
        elif tokenizer.identity.startswith("null:") and all(type(i) is int for i in v):
            seqs.append(list(v))  # pre-tokenized ids as a JSON list: one sequence, even when splitting
            seq_doc.append(d)
        else:
            raise PreprocessError(f"{chunk.file}:{line}: {key!r} holds a list; only the null tokenizer "
                                  "takes ids, and only integers")
    return seqs, np.asarray(seq_doc, dtype=np.int64)


def encode_chunk(chunk: Chunk) -> Dict[str, Encoded]:
    """key -> the chunk's documents of that key, tokenized (split into sentences with --split-sentences)."""
    tokenizer: Tokenizer = _STATE["tokenizer"]
    keys, append_eod, split = _STATE["keys"], _STATE["append_eod"], _STATE.get("split_sentences", False)
    out = {}
    for key, values in texts_of(chunk, keys).items():
        seqs, seq_doc = _sequences_of(chunk, key, values, tokenizer, split)
        lengths = np.fromiter((len(q) for q in seqs), dtype=np.int64, count=len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
        if flat.size and (flat.max() >= tokenizer.vocab_size or flat.min() < 0):
            bad_pos = int(np.flatnonzero((flat >= tokenizer.vocab_size) | (flat < 0))[0])
            seq = int(np.searchsorted(np.cumsum(lengths), bad_pos, side="right"))
            raise PreprocessError(f"{chunk.file}:{chunk.lines[seq_doc[seq]]}: token id {int(flat[bad_pos])} in "
                                  f"{key!r} is outside the vocabulary of {tokenizer.vocab_size} ids")
        keep = lengths > 0  # sequences (documents, or sentences) of no tokens are left out
        lengths, seq_doc = lengths[keep], seq_doc[keep]
        per_doc = np.bincount(seq_doc, minlength=len(values))
        empty = int((per_doc == 0).sum())
        per_doc = per_doc[per_doc > 0]
        if append_eod and lengths.size:
            last = np.cumsum(per_doc) - 1  # the last sequence of each document
            flat = np.insert(flat, np.cumsum(lengths)[last], tokenizer.eod)
            lengths[last] += 1
        out[key] = Encoded(flat, lengths, per_doc if split else None, empty)
    return out


# ---------------------------------------------------------------- the pipeline

def output_prefix_for(output_prefix: str, key: str, split_sentences: bool = False) -> str:
    """Megatron's output names: `{prefix}_{key}_document`, or `{prefix}_{key}_sentence` when splitting."""
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def _open_writer(prefix: str, dtype) -> IndexedDatasetWriter:
    try:
        return IndexedDatasetWriter(prefix, dtype)
    except OSError as e:
        raise ConfigError(f"--output-prefix: cannot write {prefix}.bin ({e.strerror or e})") from None


def _require_documents(files: Sequence[Path], keys: Sequence[str], stats: PreprocessStats) -> None:
    """A dataset of no documents is a mistake (an empty file, the wrong --json-keys): say what was read."""
    for k in keys:
        if stats.written[k]:
            continue
        names = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        found = (f"{stats.documents} record(s) read, all {stats.skipped_empty[k]} skipped as empty ({k!r} "
                 "tokenizes to nothing)" if stats.documents else "0 records read (blank lines are not documents)")
        raise DataError(f"no documents to write to {stats.outputs[k]}: {names}: {found}; no output was written")


def preprocess(inputs: Sequence[str], output_prefix: str, *, tokenizer: TokenizerConfig,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               input_format: str = "auto", text_document: str = "paragraph", chunk_mb: float = 1.0,
               progress: Optional[bool] = None, split_sentences: bool = False) -> PreprocessStats:
    """Tokenize the inputs into `{output_prefix}_{key}_document.bin/.idx` for each key; return counts.

    split_sentences: one sequence per sentence, into `{output_prefix}_{key}_sentence.bin/.idx`.
    """
    files = expand_inputs(inputs)
    keys = tuple(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise ConfigError(f"--json-keys {list(keys)} must name at least one key, each once")
    kinds = {input_kind(f, input_format) for f in files}
    if "text" in kinds and len(keys) > 1:
        raise ConfigError(f"plain-text inputs hold one document stream; --json-keys {list(keys)} names several")
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be at least 1")
    if split_sentences:
        sentences.split_sentences("")  # fails fast, before any worker starts, when blingfire is missing
    tok_cfg = dataclasses.asdict(tokenizer)
    main_tok = build_tokenizer(tokenizer)  # fails fast on a bad model, and gives the dtype
    dtype = best_dtype(main_tok.vocab_size)
    stats = PreprocessStats()
    stats.outputs = {k: output_prefix_for(output_prefix, k, split_sentences) for k in keys}
    stats.tokens = {k: 0 for k in keys}
    stats.written = {k: 0 for k in keys}
    stats.sequences = {k: 0 for k in keys}
    stats.skipped_empty = {k: 0 for k in keys}
    total_bytes = sum(f.stat().st_size for f in files) if not any(f.name.endswith(".gz") for f in files) else None
    chunks = read_chunks(files, input_format=input_format, text_document=text_document,
                         chunk_bytes=max(1, int(chunk_mb * (1 << 20))))
    log.info("preprocess: %d file(s), %s, tokenizer %s (%d ids, %s), %d worker(s)%s -> %s", len(files),
             f"{total_bytes / 1e6:.1f} MB" if total_bytes is not None else "gzipped", main_tok.identity,
             main_tok.vocab_size, dtype, workers, ", splitting sentences" if split_sentences else "",
             ", ".join(stats.outputs.values()))
    from tqdm import tqdm
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if progress is None else not progress)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:  # unwinds in reverse: workers killed, then the writers abort
        stack.callback(bar.close)
        writers = {k: stack.enter_context(_open_writer(stats.outputs[k], dtype)) for k in keys}

        def take(chunk_bytes: int, chunk_docs: int, result) -> None:
            for k, enc in result.items():
                writers[k].add_documents(enc.tokens, enc.lengths, enc.sequences_per_document)
                stats.tokens[k] += int(enc.tokens.size)
                stats.written[k] += enc.documents
                stats.sequences[k] += int(enc.lengths.size)
                stats.skipped_empty[k] += enc.empty
            stats.documents += chunk_docs
            stats.bytes += chunk_bytes
            bar.update(chunk_bytes)
            elapsed = time.perf_counter() - start
            bar.set_postfix(docs=stats.documents, docs_s=f"{stats.documents / max(elapsed, 1e-9):.0f}",
                            refresh=False)

        init = (tok_cfg, keys, append_eod, 1, split_sentences)
        if workers == 1:
            _init_worker(*init)
            for chunk in chunks:
                _check_stop()
                take(chunk.nbytes, len(chunk.records), encode_chunk(chunk))
        else:
            pool = Workers(workers, _init_worker, init, encode_chunk, STOP)
            stack.callback(pool.stop)  # on error or interrupt: SIGKILL
            pool.start()
            pending: collections.deque = collections.deque()  # (bytes, documents) of each chunk in flight
            for chunk in chunks:
                while len(pending) >= 4 * workers:  # bounded look-ahead: memory never holds the input
                    take(*pending.popleft(), pool.result())
                _check_stop()
                pool.submit(chunk)
                pending.append((chunk.nbytes, len(chunk.records)))
            while pending:
                take(*pending.popleft(), pool.result())
            pool.stop(graceful=True)
        _require_documents(files, keys, stats)  # raised here, the writers abort
        for k in keys:  # an older run's record must not outlive the files it described
            sidecar_path(stats.outputs[k]).unlink(missing_ok=True)
    for k in keys:  # after the .bin/.idx are in place
        counts: Dict[str, int] = {"sentences": stats.sequences[k]} if split_sentences else {}
        write_provenance(stats.outputs[k], main_tok, documents=stats.written[k], tokens=stats.tokens[k], **counts)
    stats.seconds = time.perf_counter() - start
    for k in keys:
        if stats.skipped_empty[k]:
            log.warning("preprocess: skipped %d empty document(s) in %r (nothing to tokenize)",
                        stats.skipped_empty[k], k)
    log.info("preprocess: %d documents, %.1f MB in %.1f s: %.0f docs/s, %.2f MB/s; %s", stats.documents,
             stats.bytes / 1e6, stats.seconds, stats.docs_per_s, stats.mb_per_s,
             "; ".join(f"{stats.outputs[k]}: {stats.written[k]} documents"
                       + (f" ({stats.sequences[k]} sentences)" if split_sentences else "")
                       + f", {stats.tokens[k]} tokens" for k in keys))
    return stats


STOP = threading.Event()  # set by the command's SIGINT / SIGTERM handler


def _check_stop() -> None:
    if STOP.is_set():
        raise KeyboardInterrupt("stop requested")


def _merged_tokenizer(prefixes: Sequence[str]) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """The tokenizer record every input carries (None when one has none), and the inputs without one."""
    made = {p: (read_provenance(p) or {}).get("tokenizer") for p in prefixes}
    known = {p: t for p, t in made.items() if t is not None}
    if len({t.get("identity") for t in known.values()}) > 1:
        # Refused rather than merged without a record: the result would mix ids that mean other
        # tokens in each part, and without a record no training run could notice.
        raise DataError("cannot merge corpora made by different tokenizers: "
                        + "; ".join(f"{p}: {describe(t)}" for p, t in known.items())
                        + ". Preprocess them again with one tokenizer")
    unrecorded = [p for p, t in made.items() if t is None]
    return (None if unrecorded else next(iter(known.values()))), unrecorded


def merge(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Merge datasets (prefixes or glob patterns of them, in order) into output_prefix."""
    resolved: List[str] = []
    for p in prefixes:
        p = os.path.expanduser(str(p))
        for suffix in (".idx", ".bin"):
            if p.endswith(suffix):
                p = p[:-len(suffix)]
        if any(ch in p for ch in "*?["):
            matches = sorted(m[:-4] for m in globlib.glob(p + ".idx"))
            if not matches:
                raise MissingFileError(f"merge pattern {p!r} matches no .idx files")
            resolved += matches
        else:
            resolved.append(p)
    start = time.perf_counter()
    tokenizer, unrecorded = _merged_tokenizer(resolved)  # before writing: a refusal leaves nothing
    out = merge_datasets(resolved, output_prefix)
    sidecar_path(output_prefix).unlink(missing_ok=True)
    if tokenizer is not None:
        write_record(output_prefix, tokenizer, documents=out.num_documents, tokens=out.num_tokens,
                     merged_from=resolved)
    elif len(unrecorded) < len(resolved):
        log.warning("merge: %s carry no tokenizer record, so %s gets none and training cannot check it",
                    ", ".join(unrecorded), output_prefix)
    log.info("merge: %d datasets -> %s (%d documents, %d tokens) in %.1f s", len(resolved), output_prefix,
             out.num_documents, out.num_tokens, time.perf_counter() - start)
    return out
