"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

    results = run_ranks(4, fn, arg1, arg2)    # fn(rank, world_size, *args) on every rank

Each rank joins one process group (gloo, over a FileStore in a temp dir), runs fn, and sends
back its return value (CPU tensors and plain Python values). A rank that raises fails the
test with its traceback; one that dies without reporting (a crash, a kill) fails it as soon as
its process is gone, with its exit code.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Pickled here, by value: the queue's own pickler would share tensor storage through
        # file descriptors, which the parent cannot fetch once this process has exited.
        queue.put((rank, "ok", pickle.dumps(out)))
        # No rank tears its sockets down while another may still be connecting to it: gloo's
        # full-mesh set-up can finish on one side first, and a rank whose fn is quick would
        # otherwise close the pair under its peer ("Connection closed by peer").
        if dist.is_initialized():
            dist.barrier()
    except BaseException:  # report everything, including assertion failures inside fn
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 240.0) -> List[Any]:
    """fn must be a module-level function (it is pickled into spawned processes).

    The queue is read in short slices, and between them every rank's process is checked: one
    that exited without reporting (a segfault, an OOM kill, os._exit) fails the call at once,
    naming the rank and its exit code, instead of when `timeout` (for the whole call) runs out.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: List[Any] = [None] * world_size
        errors = _collect(procs, queue, results, timeout)
        for p in procs:
            p.join(timeout=1 if errors else timeout)  # after an error the rest usually hang in a collective
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if errors:
            raise AssertionError("\n".join(errors))
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
        if bad:
            raise AssertionError(f"ranks exited abnormally: {bad}")
    return results


def _exit_reason(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _collect(procs, queue, results: List[Any], timeout: float, poll: float = 0.2) -> List[str]:
    """Fill results from the queue; return error messages (empty when every rank reported ok)."""
    reported = set()
    deadline = time.monotonic() + timeout
    while len(reported) < len(procs):
        try:
            rank, status, payload = queue.get(timeout=poll)
        except queue_module.Empty:
            # A rank whose process is gone and has not reported never will. A rank puts its
            # answer before it exits, and the feeder thread flushes it first, so look once more.
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead:
                try:
                    rank, status, payload = queue.get(timeout=poll)
                except queue_module.Empty:
                    return [f"rank {r} exited without reporting a result ({_exit_reason(code)})"
                            for r, code in dead]
            elif time.monotonic() > deadline:
                codes = [p.exitcode for p in procs]
                return [f"no answer from every rank within {timeout} s (exit codes {codes}; "
                        f"ranks that reported: {sorted(reported)})"]
            else:
                continue
        reported.add(rank)
        if status == "error":
            return [f"rank {rank}:\n{payload}"]  # the others may now hang in a collective; stopped by the caller
        results[rank] = pickle.loads(payload)
    return []
