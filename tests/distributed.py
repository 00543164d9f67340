"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

    results = run_ranks(4, fn, arg1, arg2)    # fn(rank, world_size, *args) on every rank

Each rank joins one process group (gloo, over a FileStore in a temp dir), runs fn, and sends
back its return value (CPU tensors and plain Python values). A rank that raises fails the
test with its traceback.
"""

from __future__ import annotations

import os
import pickle
import tempfile
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
    except BaseException:  # report everything, including assertion failures inside fn
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 240.0) -> List[Any]:
    """fn must be a module-level function (it is pickled into spawned processes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: List[Any] = [None] * world_size
        errors = []
        import queue as queue_mod
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                codes = [p.exitcode for p in procs]
                errors.append(f"no answer from every rank within {timeout} s (exit codes {codes})")
                break
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
                break  # the other ranks may now hang in a collective; stop them below
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
        if errors:
            raise AssertionError("\n".join(errors))
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
        if bad:
            raise AssertionError(f"ranks exited abnormally: {bad}")
    return results
