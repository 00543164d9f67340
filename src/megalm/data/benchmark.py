"""Data-pipeline benchmarks: `python -m megalm.data.benchmark {index,blend,bert,preprocess,all}`.

- index: Megatron GPT indices for a synthetic billion-token corpus (10M documents, geometric
  lengths of mean 100; lengths only, no .bin), for one epoch and for 1.5 epochs (a separated,
  shuffled-apart last epoch).
- blend: the greedy blending index for 10M samples over 2, 3 and 8 datasets, against the plain
  sequential loop timed on a slice and extrapolated.
- bert: BERT's sample index (megalm.data.samples.sentence_index) for 1M sentences in documents of about
  20 and of 1-2 sentences, side by side with megatron-core's compiled build_mapping when it is
  installed (the rows are checked equal).
- preprocess: a synthetic JSON-lines corpus built from the Python standard library's sources
  (repeated to --mb MB) tokenized with a sentencepiece model trained on it, with 1 and 2 workers.
Numbers go to stdout as JSON lines; docs/PERFORMANCE.md records a run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from megalm.data.corpora.stdlib import stdlib_corpus
from megalm.data.samples.blended import blending_indices, blending_indices_reference
from megalm.data.samples.gpt import build_gpt_indices
from megalm.data.samples.sentence_index import build_sentence_mapping


def _emit(record: Dict) -> None:
    print(json.dumps(record), flush=True)


def bench_index(num_docs: int = 10_000_000, mean: int = 100, seq_length: int = 2048) -> List[Dict]:
    rng = np.random.default_rng(0)
    sizes = rng.geometric(1 / mean, size=num_docs).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    out = []
    for label, samples in (("1 epoch", None), ("1.5 epochs", int(1.5 * tokens / seq_length))):
        start = time.perf_counter()
        idx = build_gpt_indices(sizes, range(0, num_docs), seq_length, seed=1234, num_samples=samples)
        seconds = time.perf_counter() - start
        epochs, separate, _, _ = idx["info"].tolist()
        rec = {"bench": "gpt_index", "documents": num_docs, "tokens": tokens, "seq_length": seq_length,
               "num_samples": samples, "case": label, "epochs": epochs, "separate_final_epoch": bool(separate),
               "samples_built": int(idx["shuffle_index"].size), "seconds": round(seconds, 2)}
        _emit(rec)
        out.append(rec)
    return out


def bench_blend(size: int = 10_000_000) -> List[Dict]:
    out = []
    rng = np.random.default_rng(0)
    for k in (2, 3, 8):
        weights = ([0.3, 0.7] if k == 2 else (rng.random(k) + 0.1).tolist())
        start = time.perf_counter()
        dataset_index, _ = blending_indices(weights, size)
        seconds = time.perf_counter() - start
        probe = 200_000
        start = time.perf_counter()
        ref, _ = blending_indices_reference(weights, probe)
        ref_seconds = (time.perf_counter() - start) * size / probe
        assert np.array_equal(ref, dataset_index[:probe])
        rec = {"bench": "blend_index", "datasets": k, "samples": size, "seconds": round(seconds, 2),
               "sequential_loop_seconds_extrapolated": round(ref_seconds, 1)}
        _emit(rec)
        out.append(rec)
    return out


def bench_bert_index(sentences: int = 1_000_000, repeats: int = 2) -> List[Dict]:
    try:
        from megatron.core.datasets import helpers  # optional: megatron-core's C++, to compare with
    except ImportError:
        helpers = None
    rng = np.random.default_rng(0)
    out = []
    for per_doc in (20, 2):
        counts = rng.integers(1, 2 * per_doc, sentences // per_doc)
        docs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        sizes = rng.integers(1, 60, int(docs[-1])).astype(np.int32)
        for _ in range(repeats):
            start = time.perf_counter()
            rows = build_sentence_mapping(docs, sizes, None, 509, 0.1, 1234, 2)
            record = {"bench": "bert_index", "sentences": int(docs[-1]), "mean_sentences_per_doc": per_doc,
                      "samples": len(rows), "megalm_s": round(time.perf_counter() - start, 4)}
            if helpers is not None:
                start = time.perf_counter()
                ref = helpers.build_mapping(docs, sizes, 1, 2**63 - 1, 509, 0.1, 1234, False, 2)
                record["megatron_core_s"] = round(time.perf_counter() - start, 4)
                record["equal"] = bool(np.array_equal(rows, np.asarray(ref).astype(np.int64).reshape(-1, 3)))
            _emit(record)
            out.append(record)
    return out


def make_stdlib_jsonl(path: Path, mb: float) -> Dict:
    """JSON lines of the stdlib's *.py files, repeated until the file holds `mb` MB."""
    corpus = stdlib_corpus()
    limit = int(mb * 1e6)
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = written = 0
    with open(path, "w") as f:
        while written < limit:
            for rel, text in zip((r for r, _ in corpus.files), corpus.texts()):
                line = json.dumps({"text": text, "path": rel}) + "\n"
                f.write(line)
                written += len(line.encode())
                docs += 1
                if written >= limit:
                    break
    return {"path": str(path), "bytes": written, "documents": docs}


def bench_preprocess(workdir: Path, mb: float = 80.0, vocab_size: int = 8192, workers=(1, 2)) -> List[Dict]:
    # lazy: only this benchmark needs Hydra's config and sentencepiece, 0.4 s of the command's start-up
    from megalm.config import TokenizerConfig
    from megalm.data.preprocessing import pipeline as pp
    from megalm.data.tokenizers.training import train
    jsonl = workdir / "stdlib.jsonl"
    corpus = make_stdlib_jsonl(jsonl, mb) if not jsonl.is_file() or abs(jsonl.stat().st_size - mb * 1e6) > 1e6 \
        else {"path": str(jsonl), "bytes": jsonl.stat().st_size}
    tok_dir = workdir / f"sp{vocab_size}"
    if not (tok_dir / "tokenizer.model").is_file():
        start = time.perf_counter()
        train([str(jsonl)], str(tok_dir), vocab_size=vocab_size)
        _emit({"bench": "train_tokenizer", "vocab_size": vocab_size, "seconds": round(time.perf_counter() - start, 1)})
    cfg = TokenizerConfig(model=str(tok_dir / "tokenizer.model"))
    out = []
    for n in workers:
        stats = pp.preprocess([str(jsonl)], str(workdir / f"out_w{n}"), tokenizer=cfg, append_eod=True, workers=n,
                              progress=False)
        rec = {"bench": "preprocess", "workers": n, "input_mb": round(stats.bytes / 1e6, 1),
               "documents": stats.documents, "tokens": stats.tokens["text"], "seconds": round(stats.seconds, 1),
               "mb_per_s": round(stats.mb_per_s, 2), "docs_per_s": round(stats.docs_per_s, 0)}
        _emit(rec)
        out.append(rec)
    a, b = (Path(str(workdir / f"out_w{n}_text_document") + ".bin").read_bytes() for n in workers[:2])
    _emit({"bench": "preprocess", "identical_outputs": a == b, **corpus})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megalm.data.benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", default="all", choices=("index", "blend", "bert", "preprocess", "all"))
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "megalm-data-bench"),
                   help="where preprocess writes its corpus and outputs (default: megalm-data-bench in the system's temporary folder)")
    p.add_argument("--mb", type=float, default=80.0, help="size of the synthetic JSONL for preprocess")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    _emit({"machine": platform.processor() or platform.machine(), "cpus": len(os.sched_getaffinity(0)),
           "python": platform.python_version(), "numpy": np.__version__,
           "date": time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime())})
    if args.what in ("index", "all"):
        bench_index()
    if args.what in ("blend", "all"):
        bench_blend()
    if args.what in ("bert", "all"):
        bench_bert_index()
    if args.what in ("preprocess", "all"):
        bench_preprocess(Path(args.workdir), args.mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
