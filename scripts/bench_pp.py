"""Pipeline bubble on CPU: every megalm schedule at pp = 2, measured against the stage work alone.

    python scripts/bench_pp.py [--layers 8] [--micro-batch 4] [--m 4 8] [--rounds 3] [--steps 2]
    python scripts/bench_pp.py --quick --json out.json      # tiny shape, one round (the smoke test)

Starts `pp` gloo ranks, one core each, and builds on every rank one model per schedule with
megalm's own functions (build_model on meta → parallelize → materialize → init_weights →
build_pipeline), shaped like conf/model/gpt_cpu.yaml but with --layers layers (8 by default, so
every schedule's stage count divides it), fp32, AdamW, random tokens. For each schedule and
each m (micro-batches per step) it measures per rank:

- wall: the time of `Pipeline.step` (from a barrier to the loss broadcast that ends it, so every
  rank's wall covers the same interval) and of the full training step (+ tied-embedding
  gradient sum, clipping, AdamW), which gives tokens/s;
- busy: the same rank's StageView(s) forward + backward for m micro-batches back to back,
  locally, without the pipeline (random input activations that require grad, the loss on the
  last stage, a random output gradient on the others); both ranks do it at the same time, so
  they share the machine as in the pipeline;
- idle share = 1 - busy / wall (the bubble as a share of the pipeline step), against the theory
  for equal stages (p - 1) / (m v + p - 1) and against the same model fed with the measured busy
  times (ideal step = max busy + the other ranks' busy / (m v): the last stage's head and loss
  make stages unequal); and idle / busy = (wall - busy) / busy against Megatron's bubble
  fraction (p - 1) / (m v), the bubble time over the ideal compute time (arXiv:2104.04473);
- compute inside the schedule (time in the stages' forward / backward / weight-gradient calls
  and the loss), which splits the idle time into waiting and schedule overhead;
- the bytes every stage sends across a rank boundary per micro-batch (the activation forward,
  its gradient backward), checked against micro_batch x seq x hidden x 4 bytes (fp32).

Before the rounds, the ranks measure the figures megalm.plan's bubble is computed from: their matmul
rate, their memory bandwidth, and a boundary message's time and the CPU time it takes from each end
(a ping-pong of one activation). The plan's bubble is printed against the measured spreads.

Each round also times the single-process model (rank 0 alone, all cores) at the largest m.
Rounds run the (schedule, m) cells forward and backward in turn, so drift on a noisy machine
hits all of them alike; the tables report medians over rounds of per-round values (a warm-up
round of one step per cell comes first and is not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_mod
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalm.config import TrainerConfig
from megalm.training.cpu_memory import CHOICES as CPU_ALLOCATORS

SCHEDULE_V = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zb": 2, "zbv": 2}
QUICK = dict(layers=4, hidden=64, heads=4, seq=32, vocab=512, micro_batch=2, m=[4], rounds=1, steps=1,
             busy_repeats=3)


def compose_cfg(args, parallel):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    register_configs()  # the schemas the presets extend (the ranks register them at start-up too)
    over = [f"model={args.model}", f"model.num_layers={args.layers}", "data=mock"]  # batches are drawn here
    for key, val in (("hidden_size", args.hidden), ("num_attention_heads", args.heads),
                     ("seq_length", args.seq), ("vocab_size", args.vocab)):
        if val is not None:
            over.append(f"model.{key}={val}")
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=over + parallel))


def count_sends(stage, counts: Counter) -> None:
    """Record (direction, stage, shape, dtype, bytes) of every tensor the stage sends to a peer."""
    for kind in ("fwd", "bwd"):
        orig = getattr(stage, f"get_{kind}_send_ops")

        def wrapped(chunk_id, orig=orig, kind=kind):
            ops = orig(chunk_id)
            for op in ops:
                t = op.tensor
                counts[(kind, stage.stage_index, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                        t.nelement() * t.element_size())] += 1
            return ops
        setattr(stage, f"get_{kind}_send_ops", wrapped)


def time_compute(pipe, clock: list) -> None:
    """Add the seconds spent in each stage's compute calls (and the loss) to clock[0]."""
    def timed(fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[0] += time.perf_counter() - t0
        return inner
    for stage in pipe.stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed(getattr(stage, name)))
    if hasattr(pipe.schedule, "_compute_loss"):  # the last stage's loss forward runs in the schedule
        pipe.schedule._compute_loss = timed(pipe.schedule._compute_loss)


def build_layout(args, schedule, world):
    """One model per schedule on this rank, and a Pipeline for each m over it."""
    from megalm.validation import validate
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import materialize, parallelize
    from megalm.parallel.pipeline import build_pipeline
    from megalm.training.optim import build_optimizer
    v = SCHEDULE_V[schedule]
    cfg = compose_cfg(args, [f"parallel.pp={world}", "parallel.dp=1", f"parallel.pipeline_schedule={schedule}",
                             f"parallel.virtual_pipeline_size={v}", f"trainer.micro_batch_size={args.micro_batch}",
                             f"trainer.global_batch_size={args.micro_batch * max(args.m)}"])
    validate(cfg, world)
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel)
    materialize(model, "cpu")
    init_weights(model, cfg.model, 0)
    pipes = {}
    for m in args.m:
        pipe = build_pipeline(model, family_of(model.cfg.arch), layout, mesh["pp"].get_group(), cfg.parallel, m, "cpu")
        sends, clock = Counter(), [0.0]
        for stage in pipe.stages:
            count_sends(stage, sends)
        time_compute(pipe, clock)
        pipes[m] = {"pipe": pipe, "sends": sends, "clock": clock, "steps": 0}
    stages = [{"stage": s, "layers": [layout.stage_ranges[s].start, layout.stage_ranges[s].stop],
               "first": s == 0, "last": s == layout.num_stages - 1} for s in layout.stage_ids]
    return {"cfg": cfg, "mesh": mesh, "model": model, "layout": layout, "opt": build_optimizer(cfg.optimizer, model), "pipes": pipes,
            "stages": stages, "owner": pipes[args.m[0]]["pipe"].owner,
            "params": sum(p.numel() for p in model.parameters())}


def pipeline_step(lay, m, tokens, labels):
    """One training step as the trainer runs it; (seconds in Pipeline.step, seconds of the whole step)."""
    from megalm.parallel.grads import clip_grads, finalize_grads
    entry = lay["pipes"][m]
    dist.barrier()
    t0 = time.perf_counter()
    entry["pipe"].step({"tokens": tokens, "labels": labels})
    t1 = time.perf_counter()
    finalize_grads(lay["model"], lay["mesh"], lay["layout"])
    clip_grads(list(lay["model"].parameters()), lay["cfg"].trainer.grad_clip, None, lay["mesh"]["pp"].get_group())
    lay["opt"].step()
    lay["opt"].zero_grad(set_to_none=True)
    entry["steps"] += 1
    return t1 - t0, time.perf_counter() - t0


def busy_pass(lay, m, tokens, labels, gen):
    """This rank's stage work for m micro-batches, back to back, without the pipeline: seconds."""
    model, mc = lay["model"], lay["cfg"].model
    mb = tokens.shape[0] // m
    act_shape = (mb, mc.seq_length, mc.hidden_size)
    work = []
    for stage in lay["pipes"][m]["pipe"].stages:
        view = stage.submod
        for i in range(m):
            x = tokens[i * mb:(i + 1) * mb] if view.part.first else torch.randn(act_shape, generator=gen).requires_grad_()
            grad = None if view.part.last else torch.randn(act_shape, generator=gen)
            work.append((view, x, labels[i * mb:(i + 1) * mb], grad))
    dist.barrier()
    t0 = time.perf_counter()
    for view, x, y, grad in work:
        out = view(x)
        if view.part.last:
            (model.loss(out, {"labels": y}) / m).backward()
        else:
            out.backward(grad)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def single_step(model, opt, batch, m, clip):
    from megalm.parallel.grads import clip_grads
    t0 = time.perf_counter()
    for mb in batch.chunk(m):
        (model(mb[:, :-1], labels=mb[:, 1:]) / m).backward()
    clip_grads(list(model.parameters()), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def device_figures(tokens: int, hidden: int, ffn: int, repeats: int = 5) -> dict:
    """This rank's matmul FLOP/s (the MLP's first matmul of a micro-batch) and memory bandwidth (bytes
    read + written by a 64 MiB copy), best of `repeats`, taken while every rank measures at once, so they
    share the machine as in the pipeline: what megalm.plan's stage times read instead of a datasheet."""
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, ffn)
    src, dst = torch.randn(16 * 2 ** 20), torch.empty(16 * 2 ** 20)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    return {"flops_per_s": 2 * tokens * hidden * ffn / best(lambda: a @ b),
            "bytes_per_s": 2 * src.numel() * 4 / best(lambda: dst.copy_(src))}


def message_figures(rank: int, world: int, shape, round_trips: int = 20) -> dict:
    """The time of one boundary message (an fp32 activation of `shape`) between neighbouring ranks, and the
    CPU time each message takes from a rank at either end (gloo moves it on the cores that compute):
    ranks 2k and 2k + 1 send it back and forth `round_trips` times, twice (the first warms up); median
    over ranks in `summarize`. A rank without a partner measures nothing (None)."""
    peer = rank ^ 1
    x = torch.randn(*shape)
    if peer >= world:
        for _ in range(2):
            dist.barrier()
        return {"message_s": None, "message_cpu_s": None}
    for _ in range(2):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(2 * round_trips):
            if i % 2 == rank % 2:
                dist.send(x, peer)
            else:
                dist.recv(x, peer)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"message_s": wall / (2 * round_trips), "message_cpu_s": cpu / (2 * round_trips)}


def worker(rank, world, store_path, args, queue):
    try:
        queue.put((rank, "ok", _worker(rank, world, store_path, args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(rank, world, store_path, args):
    from megalm.models.registry import register_configs
    from megalm.models import build_model, init_weights
    from megalm.training.cpu_memory import apply_cpu_allocator
    from megalm.training.optim import build_optimizer
    register_configs()
    why = apply_cpu_allocator(args.cpu_allocator)  # as a training rank does
    if why is not None and rank == 0:
        print(f"--cpu-allocator {args.cpu_allocator}: {why}", file=sys.stderr)
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    layouts = {s: build_layout(args, s, world) for s in args.schedules}  # same order on every rank
    mc = next(iter(layouts.values()))["cfg"].model
    dist.barrier()
    device = device_figures(args.micro_batch * mc.seq_length, mc.hidden_size, mc.ffn_size)  # all ranks at once
    device.update(message_figures(rank, world, (args.micro_batch, mc.seq_length, mc.hidden_size)))
    gen = torch.Generator().manual_seed(0)
    batches = {m: torch.randint(0, mc.vocab_size, (args.micro_batch * m, mc.seq_length + 1), generator=gen)
               for m in args.m}
    single = None
    if rank == 0 and not args.no_single:
        scfg = compose_cfg(args, [])
        smodel = build_model(scfg.model, "cpu")
        init_weights(smodel, scfg.model, 0)
        single = (smodel, build_optimizer(scfg.optimizer, smodel), scfg.trainer.grad_clip)
    cells = [(s, m) for s in args.schedules for m in args.m]
    res = {f"{s}/{m}": {"pipe": [], "step": [], "busy": [], "compute": []} for s, m in cells}
    single_times = {max(args.m): []}
    for r in range(args.warmup + args.rounds):
        measured = r >= args.warmup
        dist.barrier()
        steps = args.steps if measured else 1  # one step per cell warms up (shape inference, allocator)
        if single is not None:  # rank 0 alone on every core, at the largest m; the others wait
            torch.set_num_threads(cores)
            m = max(args.m)
            for _ in range(steps):
                dt = single_step(single[0], single[1], batches[m], m, single[2])
                if measured:
                    single_times[m].append(dt)
        dist.barrier()
        torch.set_num_threads(max(1, cores // world))
        order = cells if r % 2 == 0 else cells[::-1]  # alternate the order from round to round
        for s, m in order:
            lay, out = layouts[s], res[f"{s}/{m}"]
            tokens, labels = batches[m][:, :-1], batches[m][:, 1:]
            pipe_t, step_t, comp_t = [], [], []
            for _ in range(steps):
                clock = lay["pipes"][m]["clock"]
                clock[0] = 0.0
                a, b = pipeline_step(lay, m, tokens, labels)
                pipe_t.append(a)
                step_t.append(b)
                comp_t.append(clock[0])
            if measured:
                busy = min(busy_pass(lay, m, tokens, labels, gen) for _ in range(args.busy_repeats))
                out["pipe"].append(statistics.median(pipe_t))
                out["step"].extend(step_t)
                out["compute"].append(statistics.median(comp_t))
                out["busy"].append(busy)
    sends = {f"{s}/{m}": [{"dir": k[0], "stage": k[1], "shape": list(k[2]), "dtype": k[3], "bytes": k[4],
                           "per_step": n / layouts[s]["pipes"][m]["steps"]}
                          for k, n in sorted(layouts[s]["pipes"][m]["sends"].items())] for s, m in cells}
    return {"rank": rank, "res": res, "sends": sends, "single": single_times, "device": device,
            "layouts": {s: {"stages": lay["stages"], "owner": lay["owner"], "params": lay["params"]}
                        for s, lay in layouts.items()},
            "shape": {"layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_attention_heads,
                      "seq": mc.seq_length, "vocab": mc.vocab_size},
            "single_params": sum(p.numel() for p in single[0].parameters()) if single else None}


def run_ranks(args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    out = [None] * args.pp
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, args.pp, os.path.join(tmp, "store"), args, queue), daemon=True)
                 for r in range(args.pp)]
        for p in procs:
            p.start()
        error = None
        try:
            for _ in range(args.pp):
                rank, status, payload = queue.get(timeout=args.timeout)
                if status == "error":
                    error = f"rank {rank} failed:\n{payload}"
                    break
                out[rank] = payload
        except queue_mod.Empty:
            error = f"no answer from every rank within {args.timeout} s"
        for p in procs:
            p.join(timeout=5 if error else 60)
            if p.is_alive():
                p.kill()
        if error:
            raise RuntimeError(error)
    return out


def check(ok: bool, msg: str) -> None:
    """An assertion that `python -O` keeps."""
    if not ok:
        raise AssertionError(msg)


def check_boundaries(ranks, schedule, m, act_bytes, act_shape):
    """Every cross-rank boundary sends one fp32 activation forward and its gradient backward per
    micro-batch, nothing else; returns the rows for the report (AssertionError otherwise)."""
    owner = ranks[0]["layouts"][schedule]["owner"]  # global rank of each stage (= pp rank: world is pp)
    seen = {}
    for rk in ranks:
        for row in rk["sends"][f"{schedule}/{m}"]:
            s = row["stage"]
            boundary = (s, s + 1) if row["dir"] == "fwd" else (s - 1, s)
            key = (boundary, row["dir"])
            check(key not in seen, f"{schedule}: two kinds of tensor sent on {key}: {seen.get(key)} and {row}")
            seen[key] = dict(row, rank=rk["rank"])
    rows = []
    for s in range(len(owner) - 1):
        crosses = owner[s] != owner[s + 1]
        for d in ("fwd", "bwd"):
            row = seen.pop(((s, s + 1), d), None)
            if not crosses:
                check(row is None, f"{schedule}: stages {s} and {s + 1} share a rank but sent {row}")
                continue
            check(row is not None, f"{schedule}: nothing sent {d} across the boundary of stages {s}/{s + 1}")
            check(row["bytes"] == act_bytes and row["dtype"] == "float32" and row["shape"] == list(act_shape),
                  f"{schedule}: {d} across stages {s}/{s + 1} sends {row}, expected {act_shape} fp32 = {act_bytes} B")
            check(row["per_step"] == m, f"{schedule}: {row['per_step']} {d} sends per step across {s}/{s + 1}, "
                  f"not m={m}")
            rows.append({"boundary": f"{s}->{s + 1}", "dir": d, "from_rank": owner[s] if d == "fwd" else owner[s + 1],
                         "bytes": row["bytes"], "shape": row["shape"], "dtype": row["dtype"],
                         "per_step": row["per_step"]})
    check(not seen, f"{schedule}: unexpected sends {seen}")
    return rows


def planned_idle(args, schedule, m, device=None, messages=True):
    """megalm.plan's bubble for this cell (megalm.plan.schedules.compute_bubble): the schedule's order
    simulated with each stage's time; the share of the step each rank does not compute. The time is the
    stage's FLOPs, or with `device` (the ranks' measured figures) FLOPs / FLOP/s plus the stage's memory
    traffic outside the matmuls (megalm.plan.traffic.stage_traffic: layers, embedding, heads, loss) / bandwidth,
    and with `messages` each boundary message's measured time and the CPU time it takes from either end."""
    from megalm.plan.schedules import compute_bubble
    v = SCHEDULE_V[schedule]
    cfg = compose_cfg(args, [f"parallel.pp={args.pp}", "parallel.dp=1", f"parallel.pipeline_schedule={schedule}",
                             f"parallel.virtual_pipeline_size={v}", f"trainer.micro_batch_size={args.micro_batch}",
                             f"trainer.global_batch_size={args.micro_batch * m}"])
    figures = (device["flops_per_s"], device["bytes_per_s"]) if device else ()
    sent = {"message_seconds": device["message_s"], "message_cpu_seconds": device["message_cpu_s"]} \
        if device and messages else {}
    return list(compute_bubble(cfg, args.pp, m, *figures, **sent).values())


def summarize(args, ranks):
    p = args.pp
    shape = ranks[0]["shape"]
    tokens_mb = args.micro_batch * shape["seq"]
    act_shape = (args.micro_batch, shape["seq"], shape["hidden"])
    act_bytes = args.micro_batch * shape["seq"] * shape["hidden"] * 4
    med = statistics.median
    device = {k: med(rk["device"][k] for rk in ranks if rk["device"].get(k) is not None)
              for k in ("flops_per_s", "bytes_per_s", "message_s", "message_cpu_s")}
    results = []
    for s in args.schedules:
        v = SCHEDULE_V[s]
        for m in args.m:
            key = f"{s}/{m}"
            per = [rk["res"][key] for rk in ranks]
            step_max = [max(ts) for ts in zip(*(x["step"] for x in per))]  # the layout's step: slowest rank
            idle = [med([1 - b / w for b, w in zip(x["busy"], x["pipe"])]) for x in per]
            ratio = [med([(w - b) / b for b, w in zip(x["busy"], x["pipe"])]) for x in per]
            wait = [med([1 - c / w for c, w in zip(x["compute"], x["pipe"])]) for x in per]
            busy = [med(x["busy"]) for x in per]
            # Megatron's model with unequal stages: the slowest rank works all step, the others add
            # their fill / drain, one chunk (busy / (m v)) each; equal stages give (p-1)/(m v + p-1).
            ideal = max(busy) + (sum(busy) - max(busy)) / (m * v)
            results.append({
                "schedule": s, "v": v, "m": m, "tokens_per_step": tokens_mb * m,
                "tokens_per_s": tokens_mb * m / med(step_max), "step_s": med(step_max),
                "pipe_s": [med(x["pipe"]) for x in per], "busy_s": busy,
                "compute_s": [med(x["compute"]) for x in per],
                "idle_share": idle, "idle_over_busy": ratio, "wait_share": wait,
                "theory_idle_share": (p - 1) / (m * v + p - 1), "theory_bubble_ratio": (p - 1) / (m * v),
                "theory_idle_share_imbalanced": [1 - b / ideal for b in busy], "ideal_s": ideal,
                "idle_share_range": [[min(1 - b / w for b, w in zip(x["busy"], x["pipe"])),
                                      max(1 - b / w for b, w in zip(x["busy"], x["pipe"]))] for x in per],
                "wait_share_range": [[min(1 - c / w for c, w in zip(x["compute"], x["pipe"])),
                                      max(1 - c / w for c, w in zip(x["compute"], x["pipe"]))] for x in per],
                "planned_idle_share": planned_idle(args, s, m, device),
                "planned_idle_share_free_messages": planned_idle(args, s, m, device, messages=False),
                "planned_idle_share_flops_only": planned_idle(args, s, m),
                "boundaries": check_boundaries(ranks, s, m, act_bytes, act_shape),
                "stages": [rk["layouts"][s]["stages"] for rk in ranks],
                "params": [rk["layouts"][s]["params"] for rk in ranks],
            })
    single = {m: tokens_mb * m / med(ts) for m, ts in ranks[0]["single"].items() if ts}
    return {"args": vars(args), "shape": shape, "cores": os.cpu_count(), "torch": torch.__version__,
            "boundary_bytes_analytic": act_bytes, "activation_shape": list(act_shape),
            "single_tokens_per_s": single, "single_params": ranks[0]["single_params"], "device": device,
            "results": results}


def inside_spread(results, key: str) -> int:
    """How many (cell, rank) plans fall inside the measured idle or wait spread, at the tables' 0.1-point
    rounding."""
    def inside(x, lo_hi):
        return round(lo_hi[0], 3) <= round(x, 3) <= round(lo_hi[1], 3)
    return sum(inside(x, idle) or inside(x, wait)
               for r in results for x, idle, wait in zip(r[key], r["idle_share_range"], r["wait_share_range"]))


def pct(x):
    return f"{100 * x:.1f}%"


def report(out, args):
    sh, p = out["shape"], args.pp
    print(f"model {args.model} x {sh['layers']} layers, hidden {sh['hidden']}, heads {sh['heads']}, seq {sh['seq']}, "
          f"vocab {sh['vocab']}; fp32, AdamW; micro-batch {args.micro_batch}; pp={p} gloo ranks x 1 core, cpu allocator "
          f"{args.cpu_allocator}; "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up; {out['cores']} cores; "
          f"torch {out['torch']}")
    for m, rate in out["single_tokens_per_s"].items():
        print(f"single process (rank 0 alone, {out['cores']} threads), {m} micro-batches/step: {rate:.0f} tokens/s")
    ranks = " | ".join(f"r{r}" for r in range(p))
    print("\nidle share = 1 - busy/wall of Pipeline.step (median of rounds); theory for equal stages "
          "(p-1)/(m*v+p-1); theory with the measured busy times: ideal = max busy + (sum of the others' busy)"
          "/(m*v), idle = 1 - busy/ideal. idle/busy = (wall-busy)/busy against (p-1)/(m*v), Megatron's bubble "
          "fraction (bubble time over ideal compute time). Zero-bubble schedules aim below these theories.")
    print(f"| schedule | v | m | tokens/s | idle share {ranks} | theory, equal stages | theory, measured stages "
          f"{ranks} | idle/busy {ranks} | (p-1)/(m*v) |")
    print("|---|---|---|---|" + "---|" * p + "---|" + "---|" * p + "---|" * p + "---|")
    for r in out["results"]:
        print(f"| {r['schedule']} | {r['v']} | {r['m']} | {r['tokens_per_s']:.0f} | "
              + " | ".join(pct(x) for x in r["idle_share"]) + f" | {pct(r['theory_idle_share'])} | "
              + " | ".join(pct(x) for x in r["theory_idle_share_imbalanced"]) + " | "
              + " | ".join(pct(x) for x in r["idle_over_busy"]) + f" | {pct(r['theory_bubble_ratio'])} |")
    print("\nper rank seconds (median): wall of Pipeline.step / busy alone / compute inside the schedule; "
          "wait share = 1 - compute/wall")
    print(f"| schedule | m | stages (layers) per rank | wall s {ranks} | busy s {ranks} | compute s {ranks} | "
          f"wait share {ranks} |")
    print("|---|---|---|" + "---|" * (4 * p))
    for r in out["results"]:
        st = "; ".join(f"r{i}: " + ", ".join(f"{x['stage']}[{x['layers'][0]}:{x['layers'][1]}]"
                                              + ("+emb" if x["first"] else "") + ("+head" if x["last"] else "")
                                              for x in rk) for i, rk in enumerate(r["stages"]))
        print(f"| {r['schedule']} | {r['m']} | {st} | " + " | ".join(f"{x:.3f}" for x in r["pipe_s"]) + " | "
              + " | ".join(f"{x:.3f}" for x in r["busy_s"]) + " | " + " | ".join(f"{x:.3f}" for x in r["compute_s"])
              + " | " + " | ".join(pct(x) for x in r["wait_share"]) + " |")
    dev = out["device"]
    print(f"\nmegalm.plan's bubble (the schedule's order simulated with each stage's time: FLOPs at the ranks' "
          f"measured matmul rate, {dev['flops_per_s'] / 1e9:.1f} GFLOP/s, plus the memory traffic outside the matmuls at their "
          f"measured bandwidth, {dev['bytes_per_s'] / 1e9:.1f} GB/s, plus each boundary message's measured time, "
          f"{dev['message_s'] * 1e3:.2f} ms, and the CPU time it takes from either end, {dev['message_cpu_s'] * 1e3:.2f} ms; "
          "then with the messages free; and FLOPs alone) against the measured spread over rounds of the idle share "
          "and of the wait share")
    print(f"| schedule | m | planned idle {ranks} | messages free {ranks} | FLOPs only {ranks} | "
          f"measured idle min-max {ranks} | wait share min-max {ranks} |")
    print("|---|---|" + "---|" * (5 * p))
    span = lambda lo_hi: f"{pct(lo_hi[0])}-{pct(lo_hi[1])}"  # noqa: E731
    for r in out["results"]:
        print(f"| {r['schedule']} | {r['m']} | " + " | ".join(pct(x) for x in r["planned_idle_share"]) + " | "
              + " | ".join(pct(x) for x in r["planned_idle_share_free_messages"]) + " | "
              + " | ".join(pct(x) for x in r["planned_idle_share_flops_only"]) + " | "
              + " | ".join(span(x) for x in r["idle_share_range"]) + " | "
              + " | ".join(span(x) for x in r["wait_share_range"]) + " |")
    cells = len(out["results"]) * p
    for key, label in (("planned_idle_share", "planned"), ("planned_idle_share_free_messages", "messages free"),
                       ("planned_idle_share_flops_only", "FLOPs only")):
        print(f"{label}: inside a measured spread in {inside_spread(out['results'], key)} of {cells} cells")
    b = out["boundary_bytes_analytic"]
    print(f"\nboundary bytes per micro-batch: analytic micro_batch x seq x hidden x 4 = "
          f"{' x '.join(map(str, out['activation_shape']))} x 4 = {b:,} B (fp32)")
    for r in out["results"]:
        if r["m"] != args.m[0]:
            continue
        rows = ", ".join(f"{x['boundary']} {x['dir']} from r{x['from_rank']}: {x['bytes']:,} B {x['dtype']} "
                         f"x{x['per_step']:g}/step" for x in r["boundaries"])
        print(f"- {r['schedule']}: {rows}  (all equal to the analytic value: checked)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (one core each)")
    ap.add_argument("--model", default="gpt_cpu", help="model preset under conf/model")
    ap.add_argument("--layers", type=int, default=8, help="layers (every schedule's stage count must divide it)")
    ap.add_argument("--hidden", type=int, default=None, help="override model.hidden_size")
    ap.add_argument("--heads", type=int, default=None, help="override model.num_attention_heads")
    ap.add_argument("--seq", type=int, default=None, help="override model.seq_length")
    ap.add_argument("--vocab", type=int, default=None, help="override model.vocab_size")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULE_V), choices=list(SCHEDULE_V),
                    help="schedules to run (interleaved ones and zbv with 2 stages per rank)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (not measured)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per round and cell")
    ap.add_argument("--busy-repeats", type=int, default=1,
                    help="busy passes per round and cell; the fastest counts (more: busy biased low, idle high)")
    ap.add_argument("--cpu-allocator", default=TrainerConfig.cpu_allocator, choices=CPU_ALLOCATORS,
                    help="malloc's policy on every rank, as trainer.cpu_allocator (default %(default)s, the trainer's)")
    ap.add_argument("--no-single", action="store_true", help="skip the single-process reference")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape for tests: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the ranks")
    ap.add_argument("--json", default=None, help="write the results here")
    if ap.parse_args(argv).quick:  # the tiny shape as defaults: explicit options still win
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    t0, load0 = time.perf_counter(), os.getloadavg()
    out = summarize(args, run_ranks(args))
    out["wall_time_s"] = time.perf_counter() - t0
    out["loadavg_1min"] = {"start": load0[0], "end": os.getloadavg()[0]}  # other jobs on the machine
    report(out, args)
    print(f"\n{out['wall_time_s']:.0f} s in all; 1-minute load average {out['loadavg_1min']['start']:.1f} at the "
          f"start, {out['loadavg_1min']['end']:.1f} at the end ({out['cores']} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(main() is None)
