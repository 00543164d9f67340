"""Zero stages side by side at dp2, then precision and recomputation costs in one process.

    python scripts/bench_zero.py [--model gpt_cpu] [--rounds 5] [--steps 3] [--dp 2]

Part 1 starts `dp` gloo ranks, each holding one model per zero stage (0, 1, 2, 3) built exactly as
`megalm.train` builds them; each round trains every stage for `steps` steps in turn, so drift on
a noisy machine hits all alike. Reports the median tokens/s of each stage, the model-state bytes
a rank holds (weights, gradients, Adam moments) against Megatron's formula, the most weight bytes
it holds during a step (ZeRO-3 gathers layers as they run), and the bytes each rank's dp
collectives carry per step. Then each stage runs alone in fresh ranks, for the peak resident
memory a rank's model and training steps add to a process that has imported torch. Part 2, in this process with every core: fp32 vs bf16
autocast, and recompute none / selective / full, the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STAGES = (0, 1, 2, 3)


def config(model: str, *overrides: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=[f"model={model}", "trainer.micro_batch_size=4",
                                                                "trainer.global_batch_size=8", *overrides]))


def build(cfg, mesh):
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import build_data_parallel, materialize, parallelize
    from megalm.training.optim import build_optimizer
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel)
    materialize(model, "cpu")
    init_weights(model, cfg.model, 0)
    dp = build_data_parallel(model, family_of(model.cfg.arch), mesh, layout, cfg.parallel.zero_stage, cfg.parallel.bucket_size_mb)
    return model, dp, build_optimizer(cfg.optimizer, model, dp)


def train(cfg, model, dp, opt, batches, steps: int, precision: str = "fp32") -> float:
    """Seconds for `steps` optimizer steps over the micro-batches `batches`."""
    from megalm.parallel.grads import clip_grads
    from megalm.training.precision import autocast
    params = dp.grad_params if dp is not None else list(model.parameters())
    group = dp.dp_group if dp is not None and dp.sharded else None
    t0 = time.perf_counter()
    for _ in range(steps):
        for x in batches:
            with autocast(precision, "cpu"):
                loss = model(x[:, :-1], labels=x[:, 1:]) / len(batches)
            loss.backward()
        if dp is not None:
            dp.finish()
        clip_grads(params, cfg.trainer.grad_clip, None, None, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _batches(cfg, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mbs, T = cfg.trainer.micro_batch_size, cfg.model.seq_length
    return [torch.randint(0, cfg.model.vocab_size, (mbs, T + 1), generator=g) for _ in range(n)]


def dp_worker(rank: int, world: int, store: str, args, queue) -> None:
    from megalm.distributed.comm import count_comm
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.training.memory import expected_bytes_per_param, measured_model_state_bytes
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    runs = {}
    for z in STAGES:
        cfg = config(args.model, f"parallel.dp={world}", f"parallel.zero_stage={z}")
        mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
        runs[z] = (cfg, *build(cfg, mesh))
    micro = 8 // (4 * world)
    batches = _batches(runs[0][0], micro, seed=rank)
    for cfg, model, dp, opt in runs.values():
        train(cfg, model, dp, opt, batches, 1)  # warm-up; also the step that learns the bucket order
    times = {z: [] for z in STAGES}
    for _ in range(args.rounds):
        for z, (cfg, model, dp, opt) in runs.items():
            dist.barrier()
            times[z].append(train(cfg, model, dp, opt, batches, args.steps) / args.steps)
    out = {}
    for z, (cfg, model, dp, opt) in runs.items():
        peak = [dp.weight_bytes()]  # weights held as each unit runs and each gradient is computed
        hooks = [m.register_forward_pre_hook(lambda *a: peak.append(dp.weight_bytes()))
                 for m in (model.embed, *model.blocks.values(), model.norm, model.head)]
        hooks += [q.register_hook(lambda g: peak.append(dp.weight_bytes())) for q in model.parameters()]
        with count_comm() as stats:
            train(cfg, model, dp, opt, batches, 1)
        for h in hooks:
            h.remove()
        for x in batches:  # state as the optimizer step sees it: gradients reduced, moments allocated
            model(x[:, :-1], labels=x[:, 1:]).backward()
        dp.finish()
        got = measured_model_state_bytes(model, opt, dp)
        opt.zero_grad()
        n = got["params"]
        out[z] = {"step_s": statistics.median(times[z]), "state": got["weights"] + got["grads"] + got["optimizer"],
                  "expected": expected_bytes_per_param(zero_stage=z, dp=world) * n, "params": n,
                  "comm": dict(stats.bytes), "buckets": len(dp.buckets), "weights_peak": max(peak)}
    queue.put((rank, out))
    dist.destroy_process_group()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_worker(rank: int, world: int, store: str, args, zero: int, queue) -> None:
    """One zero stage alone in fresh ranks: the peak resident memory a training step adds to a
    process that has imported torch and joined the group (Linux: ru_maxrss, in KiB)."""
    import resource
    from megalm.distributed.mesh import ParallelDims, build_mesh
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = config(args.model, f"parallel.dp={world}", f"parallel.zero_stage={zero}")
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
    dist.barrier()
    base = _rss_bytes()
    model, dp, opt = build(cfg, mesh)
    train(cfg, model, dp, opt, _batches(cfg, 8 // (4 * world), seed=rank), 1 + args.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((rank, {"base": base, "peak": peak}))
    dist.destroy_process_group()


def _spawn(target, world: int, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, store, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    return results


def single_process(args) -> None:
    """fp32 vs bf16 autocast, recompute none / selective / full: rounds alternate between them."""
    variants = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"),
                "recompute=selective": ("fp32", "selective"), "recompute=full": ("fp32", "full")}
    runs = {}
    for name, (precision, recompute) in variants.items():
        cfg = config(args.model, f"parallel.recompute={recompute}")
        runs[name] = (cfg, precision, *build(cfg, None))
    batches = _batches(runs["fp32"][0], 2, seed=0)
    for cfg, precision, model, dp, opt in runs.values():
        train(cfg, model, dp, opt, batches, 1, precision)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (cfg, precision, model, dp, opt) in runs.items():
            times[name].append(train(cfg, model, dp, opt, batches, args.steps, precision) / args.steps)
    tokens = 8 * runs["fp32"][0].model.seq_length
    base = statistics.median(times["fp32"])
    print(f"\nsingle process, {torch.get_num_threads()} threads ({tokens} tokens a step):")
    print(f"{'variant':<22}{'tokens/s':>10}{'vs fp32':>9}")
    for name in runs:
        med = statistics.median(times[name])
        print(f"{name:<22}{tokens / med:>10.0f}{base / med:>9.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2)
    args = ap.parse_args()
    results = _spawn(dp_worker, args.dp, args)
    rss = {z: _spawn(rss_worker, args.dp, args, z) for z in STAGES}
    cfg = config(args.model)
    tokens = 8 * cfg.model.seq_length
    print(f"model={args.model}, dp={args.dp}, global batch 8 x {cfg.model.seq_length} tokens, fp32, "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'zero':<6}{'tokens/s':>10}{'vs 0':>7}{'state MiB/rank':>16}{'formula MiB':>13}{'weights peak':>14}"
          f"{'peak RSS added MiB/rank':>25}   collective bytes a rank sends a step")
    base = results[0][0]["step_s"]
    for z in STAGES:
        r = results[0][z]
        per_rank = "/".join(f"{results[rk][z]['state'] / 2**20:.1f}" for rk in sorted(results))
        comm = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(r["comm"].items()))
        added = "/".join(f"{(m['peak'] - m['base']) / 2**20:.0f}" for _, m in sorted(rss[z].items()))
        print(f"{z:<6}{tokens / r['step_s']:>10.0f}{base / r['step_s']:>6.2f}x{per_rank:>16}"
              f"{r['expected'] / 2**20:>13.1f}{r['weights_peak'] / 2**20:>14.1f}{added:>25}   {comm}")
    single_process(args)


if __name__ == "__main__":
    sys.exit(main())
