"""The built-in corpora tokenized once into the cache, as Megatron .bin/.idx files
(cache_dir/corpora/<hash>/tokens.bin/.idx, or sentences.bin/.idx: data=stdlib and stdlib_prose),
with the tokenizer and the provenance record beside them so the folder also serves as
data.source=indexed.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import List, Union

import numpy as np

from megalm.data.corpora.sentences import split_sentences
from megalm.data.corpora.stdlib import StdlibCorpus, StdlibDocstrings
from megalm.data.formats.cache import locked, stable_hash
from megalm.data.formats.indexed import IndexedDataset, best_dtype
from megalm.data.formats.indexed_writer import IndexedDatasetWriter
from megalm.data.provenance import write_provenance
from megalm.data.tokenizers.base import Tokenizer

log = logging.getLogger("megalm.data")

_CORPUS_FORMAT = "tokens-v1"  # bump when the tokenized layout changes, to invalidate caches
_ENCODE_BATCH_BYTES = 4_000_000  # text per encode_batch call: enough work for all threads


def tokenize_corpus(corpus: Union[StdlibCorpus, StdlibDocstrings], tokenizer: Tokenizer, cache_dir: Path,
                    split_sentences: bool = False) -> IndexedDataset:
    """Tokenize every document (+ eod) into cache_dir/corpora/<hash>/tokens.bin/.idx, once. With
    split_sentences, one sequence per sentence and no eod (a Megatron BERT corpus), into sentences.bin/.idx."""
    key = stable_hash(_CORPUS_FORMAT, corpus.fingerprint(), tokenizer.identity, *(["sentences"] * split_sentences))
    root = cache_dir / "corpora"
    entry = root / key
    prefix = entry / ("sentences" if split_sentences else "tokens")
    with locked(root / f"{key}.lock"):
        if prefix.with_suffix(".idx").is_file():
            log.info("tokens: reusing %s.bin/.idx", prefix)
            return IndexedDataset(prefix)
        start = time.perf_counter()
        log.info("tokens: tokenizing up to %d documents%s", len(corpus), " into sentences" if split_sentences else "")
        # Saved next to the tokens so the folder is self-contained for source=indexed.
        tokenizer.save_to(entry)
        num_tokens = num_chars = 0
        write = _write_sentences if split_sentences else _write_batch
        with IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size)) as writer:
            batch: List[str] = []
            size = 0
            for text in corpus.texts():
                batch.append(text)
                size += len(text)
                if size >= _ENCODE_BATCH_BYTES:
                    num_tokens += write(writer, tokenizer, batch)
                    num_chars, batch, size = num_chars + size, [], 0
            num_tokens += write(writer, tokenizer, batch)
            num_chars += size
            documents, sequences = writer.num_documents, writer.num_sequences
        seconds = time.perf_counter() - start
        counts = {"sentences": sequences} if split_sentences else {}
        write_provenance(prefix, tokenizer, documents=documents, tokens=num_tokens, **counts)
        (entry / "stats.json").write_text(json.dumps(
            {"documents": documents, **counts, "characters": num_chars, "tokens": num_tokens,
             "seconds": round(seconds, 2), "tokenizer": tokenizer.identity}, indent=1))
        log.info("tokens: %d documents%s, %d tokens (%.2f characters/token) in %.1f s", documents,
                 f" ({sequences} sentences)" if split_sentences else "", num_tokens,
                 num_chars / max(num_tokens, 1), seconds)
    return IndexedDataset(prefix)


def _write_sentences(writer: IndexedDatasetWriter, tokenizer: Tokenizer, texts: List[str]) -> int:
    """Each text as one document of its sentences' ids (sentences of no ids left out, as preprocess does)."""
    per_text = [split_sentences(t) for t in texts]
    encoded = iter(tokenizer.encode_batch([s for sents in per_text for s in sents]))
    count = 0
    for sents in per_text:
        ids = [i for i in (next(encoded) for _ in sents) if i]
        if ids:
            writer.add_documents(np.concatenate(ids), [len(i) for i in ids], sequences_per_document=[len(ids)])
            count += sum(map(len, ids))
    return count


def _write_batch(writer: IndexedDatasetWriter, tokenizer: Tokenizer, texts: List[str]) -> int:
    count = 0
    for ids in tokenizer.encode_batch(texts):
        ids.append(tokenizer.eod)
        writer.add_document(ids)
        count += len(ids)
    return count
