"""Input overlapped with compute (data.prefetch): how long a step waits on its batch with the next batches
built in the background and without, one run.

    python scripts/bench_input.py                                   # the embedded default (gpt_cpu, stdlib)
    python scripts/bench_input.py model=bert_cpu data=stdlib_prose  # BERT: masking drawn per sample
    python scripts/bench_input.py --steps 20 --rounds 5 --json out.json

Builds one single-process Trainer as scripts/bench_step_time.py does (the config `python -m megalm.train`
composes with the same overrides) and times rounds of --steps training steps, alternating its loader
between the prefetching one (data.prefetch batches ahead, at least 1) and the plain loader on the same
model, optimizer and data stream (the next round continues where the last one stopped): prefetching
first in even rounds, second in odd ones. Reports, from the step-time breakdown, the data phase per step
(the wait for the batch: building it, without prefetching) and the step, and the steps/s of each, with
the ratio of the medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step_time import build_trainer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides, as megalm.train takes them")
    p.add_argument("--steps", type=int, default=10, help="timed steps per setting per round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megalm.data.loader import MicroBatchLoader, Prefetcher
    from megalm.training.step_time import StepTimer
    with tempfile.TemporaryDirectory() as tmp:
        cfg, trainer = build_trainer(args.overrides, args.warmup + 2 * args.rounds * args.steps, Path(tmp))
        depth = max(cfg.data.prefetch, 1)
        plain = trainer.loader.loader if isinstance(trainer.loader, Prefetcher) else trainer.loader
        assert isinstance(plain, MicroBatchLoader)
        ahead = Prefetcher(plain, depth, pin=trainer.device.type == "cuda")

        def use(prefetch: bool) -> None:  # the other loader continues at the same sample
            if prefetch and trainer.loader is not ahead:
                ahead.consumed_samples = plain.consumed_samples
                trainer.loader = ahead
            elif not prefetch and trainer.loader is not plain:
                ahead.close()
                plain.consumed_samples = ahead.consumed_samples
                trainer.loader = plain

        def run(steps: int) -> dict:
            trainer.timer = StepTimer(trainer.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            out = trainer.timer.report()
            out["steps_per_s"] = steps / (time.perf_counter() - t0)
            return out

        use(True)
        run(args.warmup)
        rows = {True: [], False: []}
        for r in range(args.rounds):
            for prefetch in ((True, False) if r % 2 == 0 else (False, True)):
                use(prefetch)
                rows[prefetch].append(run(args.steps))
        ahead.close()

    def median(prefetch: bool, key: str) -> float:
        return statistics.median(row[key] for row in rows[prefetch])

    ratios = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(rows[True], rows[False])]
    m = cfg.model
    result = {
        "model": f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}",
        "data": cfg.data.name, "overrides": args.overrides, "prefetch": depth,
        "micro_batch_size": cfg.trainer.micro_batch_size, "global_batch_size": cfg.trainer.global_batch_size,
        "threads": torch.get_num_threads(), "steps_per_round": args.steps, "rounds": args.rounds,
        **{f"{name}_{key}": median(prefetch, key) for prefetch, name in ((True, "prefetch"), (False, "plain"))
           for key in ("time_data_s", "time_step_s", "steps_per_s")},
        "ratio_of_medians": median(True, "steps_per_s") / median(False, "steps_per_s"),
        "median_round_ratio": statistics.median(ratios), "round_ratios": [round(x, 4) for x in ratios],
    }
    print(f"{result['model']}, data={result['data']}; {args.rounds} rounds of {args.steps} steps each way, "
          f"{result['threads']} threads")
    print("| loader | data wait ms/step | step ms | data share | steps/s (median) |\n|---|---|---|---|---|")
    for name in ("prefetch", "plain"):
        data, step = result[f"{name}_time_data_s"], result[f"{name}_time_step_s"]
        label = f"data.prefetch={depth}" if name == "prefetch" else "data.prefetch=0"
        print(f"| {label} | {1e3 * data:.3f} | {1e3 * step:.1f} | {100 * data / step:.3f}% | "
              f"{result[f'{name}_steps_per_s']:.3f} |")
    print(f"prefetch / plain steps/s: {result['ratio_of_medians']:.4f} (ratio of medians), "
          f"{result['median_round_ratio']:.4f} (median of per-round ratios; rounds: {result['round_ratios']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
