"""What the step-time breakdown (trainer.time_breakdown) costs: steps/s with it and without it, one run.

    python scripts/bench_step_time.py                                 # the embedded default (gpt_cpu, stdlib)
    python scripts/bench_step_time.py model=gpt_tiny data=mock --steps 50 --rounds 9 --json out.json

Builds one single-process Trainer with megalm's own functions from the config that `python -m
megalm.train` would compose with the same overrides, then times rounds of --steps training steps,
alternating the trainer's timer between the breakdown (StepTimer) and none (NoTimer) on the same
model, optimizer and data stream: the breakdown first in even rounds, second in odd ones, so a
drift on a noisy machine hits both alike. Reports the median steps/s of each, the ratio of the
medians and the median of the per-round ratios, and the breakdown of the timed steps.

On a shared machine the A/B spread can exceed the cost itself, so the script also measures that
cost directly, which load hardly moves: the seconds a step's phase marks take (the trainer's
sequence for the config's micro-batches per step, StepTimer minus NoTimer, --mark-repeats times),
and what timing adds to each collective (megalm.distributed.comm's record with a CommClock open,
against none open, 50 collectives a step and the step's in-flight union).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides, as megalm.train takes them")
    p.add_argument("--steps", type=int, default=20, help="timed steps per setting per round")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--mark-repeats", type=int, default=20000, help="steps of phase marks alone, for the direct cost")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def build_trainer(overrides, max_steps: int, run_dir: Path):
    """The Trainer megalm.train would build in one process (no checkpoints, no metrics written)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import family_of, register_configs
    from megalm.data import build_data, build_data_tokenizer, num_samples_for
    from megalm.distributed.device import resolve_device
    from megalm.models import build_model, flops_per_token, init_weights
    from megalm.parallel import materialize, parallelize
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.metrics import Throughput
    from megalm.training.optim import LRSchedule, build_optimizer
    from megalm.training.trainer import Trainer
    from megalm.validation import validate
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[*overrides, f"trainer.max_steps={max_steps}",
                                                               "checkpoint.save=false"]))
    validate(cfg, 1)
    t = cfg.trainer
    device = resolve_device(t.device)
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    torch.manual_seed(t.seed)
    tokenizer = build_data_tokenizer(cfg.data)
    family = family_of(cfg.model.arch)
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed, tokenizer=tokenizer,
                      num_samples=num_samples_for(t.max_steps, t.global_batch_size, 0, 0),
                      samples=family.samples(cfg.model) if family.samples is not None else None)
    model = build_model(cfg.model, device="meta")
    layout = parallelize(model, family_of(model.cfg.arch), None, cfg.parallel, seed=t.seed)
    materialize(model, device)
    init_weights(model, cfg.model, t.seed)
    trainer = Trainer(t, model=model, family=family, optimizer=build_optimizer(cfg.optimizer, model, None),
                      schedule=LRSchedule(cfg.optimizer, t.max_steps), data=data,
                      checkpointer=Checkpointer(cfg.checkpoint, run_dir), layout=layout,
                      throughput=Throughput(flops_per_token(cfg.model), 1.0, 1), device=device, run_dir=run_dir)
    return cfg, trainer


def timed(trainer, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return steps / (time.perf_counter() - t0)


def marks_seconds(timer, micro_batches: int, repeats: int) -> float:
    """Seconds per step of the trainer's phase marks alone (no pipeline)."""
    t0 = time.perf_counter()
    for _ in range(repeats):
        with timer.step():
            timer.phase("data")
            timer.phase("other")
            for _ in range(micro_batches):
                timer.phase("forward")
                timer.phase("backward")
                timer.phase("other")
            timer.phase("optimizer")
            timer.phase("other")
    return (time.perf_counter() - t0) / repeats


def collective_seconds(timed: bool, repeats: int, per_step: int = 50) -> float:
    """Seconds per collective of comm.py's recording, with a CommClock open (and the step's in-flight
    union) or without; the collective itself is left out."""
    from megalm.distributed.comm import CommClock, _record, time_comm
    clock = CommClock()
    t0 = time.perf_counter()
    with time_comm(clock) if timed else contextlib.nullcontext():
        for _ in range(repeats):
            start = time.perf_counter()
            clock.reset()
            for _ in range(per_step):
                with _record("all_reduce", 4):
                    pass
            if timed:
                clock.in_flight(start, time.perf_counter())
    return (time.perf_counter() - t0) / (repeats * per_step)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megalm.training.step_time import NoTimer, StepTimer, describe
    with tempfile.TemporaryDirectory() as tmp:
        cfg, trainer = build_trainer(args.overrides, args.warmup + 2 * args.rounds * args.steps, Path(tmp))
        breakdown, none = StepTimer(trainer.device), NoTimer()
        trainer.timer = breakdown
        timed(trainer, args.warmup)
        breakdown.report()
        on, off, ratios = [], [], []
        for r in range(args.rounds):
            order = [(breakdown, on), (none, off)] if r % 2 == 0 else [(none, off), (breakdown, on)]
            for timer, into in order:
                trainer.timer = timer
                into.append(timed(trainer, args.steps))
            ratios.append(on[-1] / off[-1])
        sample = breakdown.report()  # the mean over every timed step with the breakdown on
        micro = cfg.trainer.global_batch_size // cfg.trainer.micro_batch_size
        marks = [marks_seconds(StepTimer(trainer.device), micro, args.mark_repeats)
                 - marks_seconds(NoTimer(), micro, args.mark_repeats) for _ in range(3)]
        per_collective = [collective_seconds(True, args.mark_repeats // 50) - collective_seconds(False, args.mark_repeats // 50)
                          for _ in range(3)]
    m = cfg.model
    result = {
        "model": f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}",
        "overrides": args.overrides, "micro_batch_size": cfg.trainer.micro_batch_size,
        "global_batch_size": cfg.trainer.global_batch_size, "threads": torch.get_num_threads(),
        "steps_per_round": args.steps, "rounds": args.rounds,
        "steps_per_s_breakdown_on": statistics.median(on), "steps_per_s_breakdown_off": statistics.median(off),
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "median_round_ratio": statistics.median(ratios),
        "round_ratios": [round(x, 4) for x in ratios], "breakdown": sample,
        "marks_us_per_step": min(marks) * 1e6, "marks_share_of_step": min(marks) / sample["time_step_s"],
        "added_us_per_collective": min(per_collective) * 1e6,
    }
    print(f"{result['model']}; {args.rounds} rounds of {args.steps} steps each way, {result['threads']} threads")
    print(f"| breakdown | steps/s (median) |\n|---|---|\n| on | {result['steps_per_s_breakdown_on']:.3f} |\n"
          f"| off | {result['steps_per_s_breakdown_off']:.3f} |")
    print(f"on / off: {result['ratio_of_medians']:.4f} (ratio of medians), {result['median_round_ratio']:.4f} "
          f"(median of per-round ratios; rounds: {result['round_ratios']})")
    print(f"breakdown: {describe(sample)}")
    print(f"direct cost: the phase marks {result['marks_us_per_step']:.1f} us a step ({micro} micro-batches; "
          f"{100 * result['marks_share_of_step']:.4f}% of the breakdown's step time), "
          f"{result['added_us_per_collective']:.2f} us added to each collective")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
