"""bf16 training step: trainer.mixed_precision=main_params against autocast, side by side in one process.

Both modes train the same GPT (same weights, same micro-batches) in rounds that alternate which mode
goes first; each round profiles `--steps` steps of `--micro-batches` micro-batches per mode. Reported,
as medians over rounds: the step time, the part of it in matmuls and attention (the same kernels in both
modes), the rest (casts, gradient accumulation, norms, losses: what the modes change), the model
state each mode holds (weights, gradients, optimizer state with the main parameters) and the bytes autograd
saves for backward over one micro-batch (its activations, autocast's weight copies among them).

    python scripts/bench_precision.py                       # hidden 256, 4 layers, ~1-2 min on 2 cores
    python scripts/bench_precision.py --hidden 512 --layers 8 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from torch.profiler import profile

from megalm.models import build_model, family_of, init_weights
from megalm.models.registry import model_config_from
from megalm.parallel import build_data_parallel, materialize, parallelize
from megalm.config import OptimizerConfig, ParallelConfig
from megalm.training.memory import measured_model_state_bytes
from megalm.training.optim import build_optimizer

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")


def _setup(args, mode: str):
    cfg = model_config_from({"arch": "gpt", "name": "bench", "vocab_size": args.vocab, "hidden_size": args.hidden,
                             "ffn_hidden_size": 4 * args.hidden, "num_layers": args.layers,
                             "num_attention_heads": args.hidden // 64, "seq_length": args.seq, "dropout": 0.0})
    model = build_model(cfg, "meta")
    family = family_of(cfg.arch)
    layout = parallelize(model, family, None, ParallelConfig())
    materialize(model, "cpu")
    init_weights(model, cfg, 0)
    dp = build_data_parallel(model, family, None, layout, 0, 25.0, torch.bfloat16 if mode == "main_params" else None)
    optimizer = build_optimizer(OptimizerConfig(), model, dp)
    return model, dp, optimizer


def _step(model, dp, optimizer, batches, zero: bool = True) -> None:
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x[:, :-1], labels=x[:, 1:]) / len(batches)
        loss.backward()
    if dp is not None:
        dp.finish()
    optimizer.step()
    if zero:
        optimizer.zero_grad(set_to_none=True)


def _saved_bytes(model, dp, batch) -> int:
    """Bytes autograd keeps for backward after one micro-batch's forward: each storage counted once, the weights'
    own storages left out (model state, not activations). Then the backward runs and the gradients are dropped."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], labels=batch[:, 1:])
    loss.backward()
    if dp is not None:
        dp.finish()
        dp.zero_grad()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per mode and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.micro_batch_size, args.seq + 1), generator=g)
               for _ in range(args.micro_batches)]
    modes = {m: _setup(args, m) for m in ("autocast", "main_params")}
    for m in modes.values():  # warm-up: the optimizer's state, the allocator's blocks
        _step(*m, batches)
    rows = collections.defaultdict(list)
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in order:
            t0 = time.perf_counter()
            with profile() as prof:
                for _ in range(args.steps):
                    _step(*modes[name], batches)
            wall = (time.perf_counter() - t0) / args.steps
            self_ms = collections.Counter()
            for e in prof.key_averages():
                self_ms[e.key] += e.self_cpu_time_total / 1000 / args.steps
            kernels = sum(v for k, v in self_ms.items() if k in MATMUL or "scaled_dot_product" in k)
            rows[name].append({"step_ms": wall * 1000, "matmul_attention_ms": kernels,
                               "rest_ms": sum(self_ms.values()) - kernels})
    out = {"shape": vars(args), "modes": {}}
    for name, (model, dp, optimizer) in modes.items():
        _step(model, dp, optimizer, batches, zero=False)  # the state right after an update, gradients still held
        state = measured_model_state_bytes(model, optimizer, dp)
        out["modes"][name] = {k: statistics.median(r[k] for r in rows[name]) for k in rows[name][0]}
        out["modes"][name]["model_state_bytes_per_param"] = (state["weights"] + state["grads"] + state["optimizer"]) / state["params"]
        optimizer.zero_grad(set_to_none=True)
        out["modes"][name]["saved_bytes_per_microbatch"] = _saved_bytes(model, dp, batches[0])
    a, m = out["modes"]["autocast"], out["modes"]["main_params"]
    print(f"{'':14}{'step ms':>10}{'matmul+attn':>13}{'rest ms':>10}{'state B/param':>15}{'saved MiB/mb':>14}")
    for name, v in out["modes"].items():
        print(f"{name:14}{v['step_ms']:>10.1f}{v['matmul_attention_ms']:>13.1f}{v['rest_ms']:>10.1f}"
              f"{v['model_state_bytes_per_param']:>15.2f}{v['saved_bytes_per_microbatch'] / 2**20:>14.2f}")
    print(f"main_params / autocast: step {m['step_ms'] / a['step_ms']:.3f}, rest {m['rest_ms'] / a['rest_ms']:.3f}, "
          f"saved activations {m['saved_bytes_per_microbatch'] / a['saved_bytes_per_microbatch']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
