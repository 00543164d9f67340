"""Single process vs tensor parallel, side by side in one run, with the communication share.

    python scripts/bench_tp.py [--tp 2] [--model gpt_cpu] [--rounds 5] [--steps 3] [--sp]

Starts `tp` gloo ranks. Each round, rank 0 first trains the plain model alone (the other ranks
wait, and rank 0 uses all the cores), then all ranks train the tensor-parallel model (one
core each); rounds alternate so drift on a noisy machine hits both. Reports the median
tokens/s of each, their ratio, the bytes each rank sent through collectives per step against
the analytic volume, and the share of a tp step spent inside collectives.
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


def build(cfg, mesh):
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import materialize, parallelize
    from megalm.training.optim import build_optimizer
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel)
    materialize(model, "cpu")
    init_weights(model, cfg.model, 0)
    return model, layout, build_optimizer(cfg.optimizer, model)


def train_steps(model, layout, opt, batch, steps, mesh=None):
    from megalm.parallel.grads import clip_grads, finalize_grads
    tp_group = mesh["tp"].get_group() if mesh is not None else None
    t0 = time.perf_counter()
    for _ in range(steps):
        model(batch[:, :-1], labels=batch[:, 1:]).backward()
        finalize_grads(model, mesh, layout)
        clip_grads(list(model.parameters()), 1.0, tp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def worker(rank, world, store_path, args, queue):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.distributed.comm import count_comm
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import flops_per_token
    register_configs()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        single_cfg = OmegaConf.to_object(compose("config", overrides=[f"model={args.model}"]))
        tp_cfg = OmegaConf.to_object(compose("config", overrides=[
            f"model={args.model}", f"parallel.tp={world}", f"parallel.sequence_parallel={args.sp}"]))
    mesh = build_mesh(ParallelDims.from_config(tp_cfg.parallel, world), "cpu")
    m = tp_cfg.model
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, m.vocab_size, (args.micro_batch, m.seq_length + 1), generator=g)
    tokens = args.micro_batch * m.seq_length * args.steps
    single = build(single_cfg, None) if rank == 0 else None
    tp_model, tp_layout, tp_opt = build(tp_cfg, mesh)
    cores = os.cpu_count() or 1
    rates = {"single": [], "tp": []}
    comm_share, comm_bytes = [], None
    for r in range(args.rounds + 1):  # round 0 warms up
        dist.barrier()
        if rank == 0:
            torch.set_num_threads(cores)
            dt = train_steps(*single, batch, args.steps)
            if r:
                rates["single"].append(tokens / dt)
        dist.barrier()
        torch.set_num_threads(max(1, cores // world))
        with count_comm() as stats:
            dt = train_steps(tp_model, tp_layout, tp_opt, batch, args.steps, mesh)
        if r:
            rates["tp"].append(tokens / dt)
            comm_share.append(stats.seconds / dt)
            comm_bytes = {k: v // args.steps for k, v in stats.bytes.items()}
    if rank == 0:
        queue.put({"rates": rates, "comm_share": comm_share, "comm_bytes": comm_bytes,
                   "flops_per_token": flops_per_token(m), "shape": (m.num_layers, m.hidden_size, m.seq_length),
                   "rope": m.position_embedding == "rope",
                   "params": sum(p.numel() for p in single[0].parameters())})
    dist.destroy_process_group()


def analytic_bytes(layers, hidden, seq, batch, tp, sp, rope):
    """Per-rank bytes per step of the activation collectives, fp32 (tests/test_parallel_model.py
    checks the same counts exactly); loss, norm and sequence-parallel weight sums come on top."""
    act = batch * seq * hidden * 4
    if not sp:  # 2 all-reduces forward and 2 backward per layer; embedding forward, head backward
        return {"all_reduce": act * (4 * layers + 2)}
    shard = act // tp
    # forward: 2 all-gathers and 2 reduce-scatters per layer, the head's all-gather; backward the
    # mirror image, each column-parallel linear's kept input shard gathered again, and the
    # embedding's split (or reduce-scatter) all-gathers back.
    out = {"all_gather": 3 * shard * (2 * layers + 1), "reduce_scatter": act * (4 * layers + 1)}
    if rope:  # the embedding reduce-scatters straight into sequence shards
        out["reduce_scatter"] += act
    else:  # positions are added after an all-reduce, then the sequence is split
        out["all_reduce"] = act
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--model", default="gpt_cpu", help="model preset under conf/model (default gpt_cpu)")
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per step (default 8)")
    ap.add_argument("--steps", type=int, default=3, help="steps per round and layout (default 3)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds after one warm-up (default 5)")
    ap.add_argument("--sp", action="store_true", help="sequence parallel as well")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, args.tp, os.path.join(tmp, "store"), args, queue))
                 for r in range(args.tp)]
        for p in procs:
            p.start()
        out = queue.get(timeout=1800)
        for p in procs:
            p.join()
    single, tp = statistics.median(out["rates"]["single"]), statistics.median(out["rates"]["tp"])
    L, h, s = out["shape"]
    expect = analytic_bytes(L, h, s, args.micro_batch, args.tp, args.sp, out["rope"])
    print(f"model {args.model}: {out['params'] / 1e6:.2f}M params, {L} layers, hidden {h}, seq {s}; "
          f"micro-batch {args.micro_batch}; {args.rounds} rounds x {args.steps} steps; {os.cpu_count()} cores")
    print("| layout | tokens/s (median) | rounds min-max |")
    print("|---|---|---|")
    print(f"| single (1 process, {os.cpu_count()} threads) | {single:.0f} | "
          f"{min(out['rates']['single']):.0f}-{max(out['rates']['single']):.0f} |")
    print(f"| tp{args.tp}{'+sp' if args.sp else ''} ({args.tp} processes) | {tp:.0f} | "
          f"{min(out['rates']['tp']):.0f}-{max(out['rates']['tp']):.0f} |")
    print(f"ratio tp/single: {tp / single:.3f}")
    print(f"time inside collectives: {100 * statistics.median(out['comm_share']):.1f}% of a tp step (median)")
    print(f"bytes per rank per step: measured {out['comm_bytes']}; analytic for the activations {expect} "
          "(the measured all_reduce adds the loss's max and sums, the norm, sequence-parallel weight grads)")
    out.update(single_tokens_per_s=single, tp_tokens_per_s=tp, ratio=tp / single)
    return out


if __name__ == "__main__":
    sys.exit(main() is None)
