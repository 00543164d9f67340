"""Peak memory and time of the LM loss, whole logits vs the fused chunked head + loss, side by side.

    python scripts/bench_loss.py [--vocab 32000 128256] [--hidden 1024] [--tokens 4096] [--chunk 1024]
                                 [--paths unfused in_forward recompute]
                                 [--dtypes fp32 bf16] [--repeats 3] [--threads 0] [--json out.json]

For each vocabulary and precision, every path runs forward + backward on the same head input (tokens, hidden)
and head weight (vocab, hidden), the order rotating each round: "unfused" is what the GPT model runs with
model.fused_loss=false (the head's matmul, then LMLoss: fp32 logits and F.cross_entropy); "in_forward" and
"recompute" are LMLoss.from_hidden (megalm.ops.fused_loss) with `--chunk` tokens a chunk and that
model.fused_loss_backward. bf16 runs under autocast, as trainer.precision=bf16 does. Ratios are against
"unfused".

Peak: on CUDA, torch's max_memory_allocated above what was allocated before the loss; on CPU the process's
peak resident set (VmHWM, reset before each run through /proc/self/clear_refs) above its resident set before
the loss; large tensors are mmapped and returned on free, so this follows the tensors' bytes. Either way it
includes the weight's gradient (vocab x hidden fp32), which every path makes. Saved: the bytes autograd keeps
for backward (saved_tensors_hooks, each storage once; the weight and the head input, which exist before the
loss, left out). Time: the median over rounds of one forward + backward, in wall seconds and (on a shared
CPU machine, where other processes stretch the wall time) in this process's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from megalm.ops.fused_loss import BACKWARDS  # noqa: E402
from megalm.models.losses import LMLoss  # noqa: E402

MB = 2 ** 20


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


class Meter:
    """Peak bytes above the start of a run: CUDA's allocator counters, or the CPU process's resident set."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            # glibc serves blocks below its mmap threshold (which grows up to 32 MB as blocks are freed) from a
            # heap that stays resident after a free: fix the threshold at 128 KB, so every tensor of note is
            # mapped on allocation and unmapped on free, and the resident set follows the live tensors.
            import ctypes
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self.base = _status_kb("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kb("VmHWM") * 1024 - self.base


class SavedBytes:
    def __init__(self, skip):
        self.skip, self.seen = {t.untyped_storage().data_ptr() for t in skip}, {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t


def run_once(path, x, w, labels, crit, dtype, chunk, meter):
    """One forward + backward: (loss, peak bytes, saved bytes, seconds, process CPU seconds)."""
    x.grad = w.grad = None
    saved = SavedBytes([w, x])
    meter.start()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            if path != "unfused":
                loss = crit.from_hidden(x, w, labels, chunk_tokens=chunk, backward=path)
            else:
                loss = crit(F.linear(x, w), labels)
    loss.backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = meter.peak()
    x.grad = w.grad = None
    return loss.item(), peak, sum(saved.seen.values()), seconds, cpu


def _ratio(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--paths", nargs="+", default=["unfused", *BACKWARDS], choices=["unfused", *BACKWARDS],
                    help="the first is the one the ratios are against")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU; 0 = every core")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count())
    meter = Meter(device)
    g = torch.Generator().manual_seed(0)
    n, h = args.tokens, args.hidden
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"torch {torch.__version__}; {n} tokens, hidden {h}, chunk {args.chunk}, {args.repeats} rounds")
    rows = []
    header = ("| vocab | dtype | path | peak MB | saved MB | time s | CPU s | peak ratio | time ratio | CPU ratio |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
    lines = []
    for vocab in args.vocab:
        x = torch.randn(n, h, generator=g).to(device).requires_grad_()
        w = (torch.randn(vocab, h, generator=g) * 0.02).to(device).requires_grad_()
        labels = torch.randint(0, vocab, (n,), generator=g).to(device)
        crit = LMLoss(vocab)
        for dtype in args.dtypes:
            paths = args.paths
            got = {path: [] for path in paths}
            for r in range(args.repeats):
                for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                    got[path].append(run_once(path, x, w, labels, crit, dtype, args.chunk, meter))
            result = {}
            for path, runs in got.items():
                result[path] = dict(vocab=vocab, dtype=dtype, path=path, loss=runs[0][0],
                                    peak_mb=max(r[1] for r in runs) / MB, saved_mb=runs[0][2] / MB,
                                    seconds=statistics.median(r[3] for r in runs),
                                    cpu_s=statistics.median(r[4] for r in runs),
                                    seconds_all=[round(r[3], 3) for r in runs])
            base = result[paths[0]]
            for path in paths[1:]:
                f = result[path]
                # A tiny run can touch no new page (peak 0) or finish inside the clock's tick: no ratio then.
                f["peak_ratio"] = base["peak_mb"] / f["peak_mb"] if f["peak_mb"] > 0 else None
                f["time_ratio"] = f["seconds"] / base["seconds"] if base["seconds"] > 0 else None
                f["cpu_ratio"] = f["cpu_s"] / base["cpu_s"] if base["cpu_s"] > 0 else None
                f["loss_rel_diff"] = abs(f["loss"] - base["loss"]) / abs(base["loss"])
            for path in paths:
                r_ = result[path]
                rows.append(r_)
                ratio = ((_ratio(r_["peak_ratio"], ".1f", "x lower"), _ratio(r_["time_ratio"], ".2f"),
                          _ratio(r_["cpu_ratio"], ".2f")) if path != paths[0] else ("", "", ""))
                lines.append(f"| {vocab} | {dtype} | {path} | {r_['peak_mb']:.0f} | {r_['saved_mb']:.1f} | "
                             f"{r_['seconds']:.2f} | {r_['cpu_s']:.2f} | {' | '.join(ratio)} |")
            print(f"vocab {vocab} {dtype}: " + ", ".join(
                f"{p} {result[p]['peak_mb']:.0f} MB {result[p]['seconds']:.2f} s {result[p]['seconds_all']} "
                f"(CPU {result[p]['cpu_s']:.2f} s) loss {result[p]['loss']:.6f}" for p in paths), flush=True)
        del x, w
    print(f"(weight gradient, in every peak: {', '.join(f'{v}: {v * h * 4 / MB:.0f} MB' for v in args.vocab)})")
    print(header)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
