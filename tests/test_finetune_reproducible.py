"""A fine-tune is reproducible: the same `python -m megalm.train` command, run twice from the same pretrained
run (seed, machine and thread count alike), logs the same numbers, every one of them but the clock's and the
memory's. Dropout, a background data thread, several epochs and a best checkpoint are on, so their random streams
and the state a save creates are part of what must come out equal."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

MEASURED = ("elapsed_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_mem_gb")
"""What a run measures of the machine (wall time, throughput, memory) rather than computes: these may differ."""


def _numbers(run_dir):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.append({k: v for k, v in record.items() if not (k in MEASURED or k.startswith("time_"))})
    return out


def test_the_same_fine_tune_twice_logs_the_same_numbers(bert_run, tmp_path):
    rng = np.random.default_rng(3)
    good, bad = ["great", "good", "lovely", "fine"], ["awful", "bad", "dull", "poor"]
    rows = [f"__label__{'pos' if y else 'neg'} the film was {(good if y else bad)[int(rng.integers(0, 4))]} and "
            f"{'long' if rng.integers(0, 2) else 'short'}" for y in rng.integers(0, 2, size=60)]
    (tmp_path / "train.txt").write_text("\n".join(rows[:48]) + "\n")
    (tmp_path / "dev.txt").write_text("\n".join(rows[48:]) + "\n")
    command = ["model=bert_tiny", "model.vocab_size=1024", "model.num_labels=2", "model.dropout=0.1",
               "model.attention_dropout=0.1", "data=classification", "data.task=fasttext", "data.labels=[neg,pos]",
               f"data.paths=[{tmp_path / 'train.txt'}]", f"data.valid_paths=[{tmp_path / 'dev.txt'}]",
               f"data.tokenizer.model={bert_run / 'tokenizer.model'}", f"checkpoint.load={bert_run / 'checkpoints'}",
               "checkpoint.finetune=true", "checkpoint.save_best=true", "trainer.monitor=val_acc", "data.prefetch=2",
               "trainer.epochs=3", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
               "trainer.eval_interval=6", "trainer.eval_steps=1", "trainer.log_interval=1", "trainer.seed=7",
               "optimizer.lr=1e-3", "optimizer.warmup_steps=2", "logging.curves=false"]
    runs = []
    for name in ("first", "second"):
        r = subprocess.run([sys.executable, "-m", "megalm.train", *command, f"hydra.run.dir={tmp_path / name}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(_numbers(tmp_path / name))
    first, second = runs
    assert len(first) >= 18 + 4 and sum("loss" in r for r in first) == 18  # 3 epochs of 48 at 8: every step logged
    assert len({r["loss"] for r in first if "loss" in r}) > 1  # the numbers compared are a run's, not constants
    assert first == second
