"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

    results = run_ranks(4, fn, arg1, arg2)    # fn(rank, world_size, *args) on every rank

Each rank joins one process group (gloo, over a TCPStore this process holds), runs fn, and sends
back its return value (CPU tensors and plain Python values). A rank that raises fails the
test with its traceback; one that dies without reporting (a crash, a kill) fails it as soon as
its process is gone, with its exit code.

Starting N processes that import torch costs seconds (14 s for 8 ranks on two cores), far more
than most functions run, so the ranks of a world size are kept for the session (each
pytest-xdist worker keeps its own) and take one call after another: before each call every rank's
torch seed and thread count are reset to a fresh process's, and compiled graphs are dropped. A
call that fails (a rank raising, dying or timing out) ends that set of ranks, and the next call of
its size starts a fresh one. A function that patches a module or class for its run must put it
back before it returns.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_port: int, inbox, outbox, parent: int) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    seed = torch.initial_seed()
    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        try:
            job = inbox.get(timeout=2.0)
        except queue_module.Empty:
            if os.getppid() != parent:  # the test process is gone without closing us: nobody will call again
                os._exit(0)
            continue
        if job is None:
            break
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        try:
            fn, args = pickle.loads(job)
            out = fn(rank, world_size, *args)
            _drop_subgroups()
            # Pickled here, by value: the queue's own pickler would share tensor storage through
            # file descriptors, which the parent cannot fetch once this process has exited.
            outbox.put((rank, "ok", pickle.dumps(out)))
        except BaseException:  # report everything, including assertion failures inside fn
            outbox.put((rank, "error", traceback.format_exc()))
            return  # the caller ends this set of ranks: the others may hang in a collective
    # No rank tears its sockets down while another may still be connecting to it.
    dist.barrier()
    dist.destroy_process_group()


def _drop_subgroups() -> None:
    """Destroy every group a call made (a DeviceMesh makes one a dimension), keeping the world
    group. Left alive they would hold their gloo sockets for the session: a 2x2x2 mesh holds 48,
    and thousands of held ports make a random rendezvous port elsewhere (submitit's) collide."""
    from torch.distributed.distributed_c10d import _world
    world = dist.group.WORLD
    others = [g for g in list(_world.pg_map) if g is not world]
    if others:
        dist.barrier()  # no rank closes a socket a peer may still be reading from
        for g in others:
            dist.destroy_process_group(g)


class _Ranks:
    """One process a rank, in one gloo group, waiting for calls."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        # The group's store lives here, in memory: every group a call creates adds keys to it, which a
        # FileStore would read back from its ever longer file on each operation.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.store.port, self.inboxes[r], self.outbox,
                                                        os.getpid()), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def close(self, kill: bool) -> None:
        if not kill:
            for q in self.inboxes:
                q.put(None)
        for p in self.procs:
            p.join(timeout=1 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_RANKS: Dict[int, _Ranks] = {}


@atexit.register
def close_all() -> None:
    """End every set of ranks (conftest's session teardown calls it: a pytest-xdist worker may exit without
    running atexit's handlers)."""
    for ranks in _RANKS.values():
        ranks.close(kill=False)
    _RANKS.clear()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 240.0) -> List[Any]:
    """fn must be a module-level function (it is pickled into the rank processes).

    The answers are read in short slices, and between them every rank's process is checked: one
    that exited without reporting (a segfault, an OOM kill, os._exit) fails the call at once,
    naming the rank and its exit code, instead of when `timeout` (for the whole call) runs out.
    """
    ranks = _RANKS.get(world_size)
    if ranks is None or any(p.exitcode is not None for p in ranks.procs):
        if ranks is not None:
            ranks.close(kill=True)
        ranks = _RANKS[world_size] = _Ranks(world_size)
    job = pickle.dumps((fn, args))
    for q in ranks.inboxes:
        q.put(job)
    results: List[Any] = [None] * world_size
    errors = _collect(ranks.procs, ranks.outbox, results, timeout)
    if errors:
        del _RANKS[world_size]
        ranks.close(kill=True)
        raise AssertionError("\n".join(errors))
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
