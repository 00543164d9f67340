"""Seconds of one optimizer step per optimizer.implementation (fused, foreach, for_loop), side by side.

    python scripts/bench_optimizer.py                       # gpt_cpu's parameters, AdamW
    python scripts/bench_optimizer.py --model gpt_125m --optimizer sgd --rounds 9 --json out.json

Builds the preset model (megalm's build_model and init_weights), gives every parameter a random gradient
and times --steps optimizer steps of each implementation, built by megalm's build_optimizer from the
same config (the decay / no-decay groups included), in alternating rounds (the order rotates each round);
reports the median milliseconds per step and each one's ratio to fused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

IMPLEMENTATIONS = ("fused", "foreach", "for_loop")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt_cpu", help="preset under conf/model")
    p.add_argument("--optimizer", default="adamw", help="preset under conf/optimizer")
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.models import build_model, init_weights
    from megalm.training.optim import build_optimizer
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[f"model={args.model}", f"optimizer={args.optimizer}"]))
    runs = {}
    for impl in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = build_model(cfg.model)
        init_weights(model, cfg.model, 0)
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        cfg.optimizer.implementation = impl
        opt = build_optimizer(cfg.optimizer, model)
        opt.step()  # creates the state
        runs[impl] = opt
    times = {impl: [] for impl in IMPLEMENTATIONS}
    for r in range(args.rounds):
        for impl in IMPLEMENTATIONS[r % 3:] + IMPLEMENTATIONS[:r % 3]:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runs[impl].step()
            times[impl].append((time.perf_counter() - t0) / args.steps)
    n = sum(p.numel() for p in build_model(cfg.model).parameters())
    result = {"model": args.model, "optimizer": cfg.optimizer.name, "parameters": n, "threads": torch.get_num_threads(),
              "ms_per_step": {i: 1e3 * statistics.median(times[i]) for i in IMPLEMENTATIONS}}
    result["ratio_to_fused"] = {i: result["ms_per_step"][i] / result["ms_per_step"]["fused"] for i in IMPLEMENTATIONS}
    print(f"{args.model} ({n:,} parameters), {cfg.optimizer.name}, {result['threads']} threads; "
          f"{args.rounds} rounds of {args.steps} steps each")
    print("| implementation | ms per step (median) | x fused's time |\n|---|---|---|")
    for i in IMPLEMENTATIONS:
        print(f"| {i} | {result['ms_per_step'][i]:.2f} | {result['ratio_to_fused'][i]:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
