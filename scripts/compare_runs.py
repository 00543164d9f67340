"""Two or more runs' curves side by side, from their metrics.jsonl: validation loss at each evaluation,
the training loss (mean over each evaluation interval) and tokens/s, with each run's relative
difference from the first at the last evaluation.

    python scripts/compare_runs.py outputs/fp32 outputs/bf16
    python scripts/compare_runs.py runs/a runs/b --names fp32 bf16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List


def read(run: Path) -> List[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.exists():
        raise SystemExit(f"compare_runs: {path} does not exist (give a run directory or its metrics.jsonl)")
    return [json.loads(line) for line in path.open() if line.strip()]


def curves(records: List[dict]) -> Dict[int, dict]:
    """Per evaluation step: val_loss, the mean training loss since the previous evaluation, median tokens/s."""
    evals = sorted((r["step"], r["val_loss"]) for r in records if "val_loss" in r)
    train = [r for r in records if "loss" in r]
    out, previous = {}, -1
    for step, val in evals:
        window = [r for r in train if previous < r["step"] <= step]
        out[step] = {"val_loss": val,
                     "train_loss": statistics.mean(r["loss"] for r in window) if window else None,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in window) if window else None}
        previous = step
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl files)")
    p.add_argument("--names", nargs="+", help="a column name per run (default: the directory names)")
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    names = args.names or [r.name for r in args.runs]
    if len(names) != len(args.runs):
        raise SystemExit(f"compare_runs: {len(names)} --names for {len(args.runs)} runs")
    table = {name: curves(read(run)) for name, run in zip(names, args.runs)}
    steps = sorted(set.intersection(*(set(c) for c in table.values())))
    if not steps:
        raise SystemExit("compare_runs: the runs share no evaluation step")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print("| step | " + " | ".join(f"{n} val loss | {n} train loss" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for step in steps:
        cells = [f"{fmt(table[n][step]['val_loss'], '.4f')} | {fmt(table[n][step]['train_loss'], '.4f')}" for n in names]
        print(f"| {step} | " + " | ".join(cells) + " |")
    last, first = steps[-1], names[0]
    summary = {}
    for n in names:
        row = table[n][last]
        rel = row["val_loss"] / table[first][last]["val_loss"] - 1
        summary[n] = {"val_loss": row["val_loss"], "relative_to_first": rel,
                      "tokens_per_s_median_last_interval": row["tokens_per_s"]}
        tps = fmt(row["tokens_per_s"], ".0f")
        print(f"{n}: val loss {row['val_loss']:.4f} at step {last} ({100 * rel:+.2f}% against {first}); "
              f"{tps} tokens/s (median, last interval)")
    if args.json:
        args.json.write_text(json.dumps({"curves": table, "last_step": last, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
