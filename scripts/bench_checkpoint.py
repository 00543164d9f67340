"""Checkpoint save and load at several layouts side by side: what each rank writes, and how long.

    python scripts/bench_checkpoint.py [--model gpt_cpu] [--rounds 3] [--world 2]

Starts `world` gloo ranks that build one model per layout (dp with ZeRO 0 / 1 / 3, tp), exactly as `megalm.train` builds them, and take one optimizer step so Adam's
moments exist. Each round then, for every layout in turn: a synchronous save, a load of it, and
an async save (the time until `save` returns, which is what training waits for, and until
`finish` has published it). Reports the medians on rank 0 and the bytes each rank's DCP file
holds against the whole checkpoint: with sharded writes no rank writes more than what it holds,
and replicated tensors are written once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero import _batches, build, config, train  # noqa: E402  (the same model builders)

LAYOUTS = {  # name -> overrides ({world}: --world)
    "dp zero0": ["parallel.dp={world}", "parallel.zero_stage=0"],
    "dp zero1": ["parallel.dp={world}", "parallel.zero_stage=1"],
    "dp zero3": ["parallel.dp={world}", "parallel.zero_stage=3"],
    "tp": ["parallel.tp={world}", "parallel.dp=1"],
}


def _rank_bytes(step_dir: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in step_dir.glob(f"__{rank}_*.distcp"))


def worker(rank: int, world: int, store: str, out_dir: str, args, queue) -> None:
    from megalm.config import CheckpointConfig
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.training.checkpoint import Checkpointer
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    runs = {}
    for name, overrides in LAYOUTS.items():
        cfg = config(args.model, *[o.format(world=world) for o in overrides])
        mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
        model, dp, opt = build(cfg, mesh)
        train(cfg, model, dp, opt, _batches(cfg, 8 // (4 * mesh["dp"].size()), seed=rank), 1)
        tp_group = mesh["tp"].get_group()
        d = Path(out_dir) / name.replace(" ", "_")
        savers = {a: Checkpointer(CheckpointConfig(dir=str(d / ("async" if a else "sync")), keep_last=1,
                                                   async_save=a), d, tp_group) for a in (False, True)}
        runs[name] = (model, dp, opt, savers)
    times = {name: {"save": [], "load": [], "async_stall": [], "async_total": []} for name in runs}
    for r in range(args.rounds):
        for name, (model, dp, opt, savers) in runs.items():
            state = {"consumed_samples": 0}
            dist.barrier()
            t0 = time.perf_counter()
            path = savers[False].save(r + 1, model, opt, state, dp)
            t1 = time.perf_counter()
            savers[False].load(path, model, opt, dp)
            t2 = time.perf_counter()
            savers[True].save(r + 1, model, opt, state, dp)
            t3 = time.perf_counter()
            savers[True].finish()
            t4 = time.perf_counter()
            for key, v in (("save", t1 - t0), ("load", t2 - t1), ("async_stall", t3 - t2), ("async_total", t4 - t2)):
                times[name][key].append(v)
    out = {}
    for name, (model, dp, opt, savers) in runs.items():
        step_dir = savers[False].latest()
        out[name] = {k: statistics.median(v) for k, v in times[name].items()}
        out[name]["rank_bytes"] = _rank_bytes(step_dir, rank)
        out[name]["total_bytes"] = sum(p.stat().st_size for p in step_dir.iterdir() if p.is_file())
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(r, args.world, store, tmp, args, queue)) for r in range(args.world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    print(f"model={args.model}, {args.world} gloo ranks, fp32 weights + Adam, median of {args.rounds} rounds (rank 0)")
    print(f"{'layout':<10}{'save s':>8}{'load s':>8}{'async stall s':>15}{'async total s':>15}"
          f"{'MiB per rank':>16}{'checkpoint MiB':>16}")
    for name in LAYOUTS:
        r = results[0][name]
        per_rank = "/".join(f"{results[k][name]['rank_bytes'] / 2**20:.1f}" for k in sorted(results))
        print(f"{name:<10}{r['save']:>8.2f}{r['load']:>8.2f}{r['async_stall']:>15.2f}{r['async_total']:>15.2f}"
              f"{per_rank:>16}{r['total_bytes'] / 2**20:>16.1f}")


if __name__ == "__main__":
    sys.exit(main())
