"""Worker processes that a stop signal can never hang (for preprocessing's tokenizers).

Not multiprocessing.Pool: Pool.terminate() SIGTERMs its workers and then waits for them while
holding the lock of the task queue they share, which hangs in two ways seen in practice (see
`Workers`). Here each worker has its own two pipes, nothing is shared, and stopping is SIGKILL.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from queue import SimpleQueue
from typing import Any, Callable, List

from megalm.errors import MegalmError

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _WorkerTraceback(Exception):
    """The traceback of an error raised in a worker, shown as the cause of the re-raised error."""


def _worker_main(tasks: Connection, results: Connection, init: Callable, init_args: tuple, work: Callable,
                 inherited_fds: List[int]) -> None:
    """One worker process: tasks arrive on `tasks`, each one's result (or error) leaves on `results`."""
    # Started with SIGINT/SIGTERM blocked (see Workers.start): set this process's own handling
    # before either can arrive. Ctrl-C reaches the whole terminal group, and the parent alone
    # decides what it means; a SIGTERM ends a worker at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    for fd in inherited_fds:  # the parent's pipe ends, copied by fork: holding them would hide the
        with contextlib.suppress(OSError):  # parent's and the other workers' exits (no EOF, no EPIPE)
            os.close(fd)
    queue: SimpleQueue = SimpleQueue()

    def receive() -> None:  # drains `tasks` while the main thread may be blocked sending a result
        try:
            while True:
                chunk = tasks.recv()
                queue.put(chunk)
                if chunk is None:
                    return
        except (EOFError, OSError):  # the parent is gone
            queue.put(None)

    threading.Thread(target=receive, daemon=True).start()
    init(*init_args)
    while (chunk := queue.get()) is not None:
        try:
            reply: tuple = ("ok", work(chunk))
        except Exception as e:
            reply = ("error", e, traceback.format_exc())
        try:
            results.send(reply)
        except (EOFError, OSError):
            return
        except Exception:  # a reply that does not pickle: send its text
            results.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {str(reply[1])[:2000]}"),
                          traceback.format_exc()))


class Workers:
    """Processes that run `work(task)` after `init(*init_args)`: tasks submitted in turn to each,
    results taken back in the same order; `stop` (an Event) set ends any wait with KeyboardInterrupt.

    Not multiprocessing.Pool: Pool.terminate() SIGTERMs its workers and then waits for them while
    holding the lock of the task queue they share. It hangs when a worker is stopped before its
    initializer has replaced the parent's SIGTERM handler (a fresh fork runs that handler, which
    only sets a flag, and lives on), and when a worker died holding that lock (a SIGTERM to the
    whole process group, as a scheduler sends, killed it inside `get`). Here each worker has its
    own two pipes, nothing is shared, and stopping is SIGKILL, which no worker can miss or delay.
    """

    def __init__(self, n: int, init: Callable, init_args: tuple, work: Callable, stop: threading.Event):
        self.n, self._init, self._init_args, self._work, self._stop = n, init, init_args, work, stop
        self._procs: List[Any] = []
        self._tasks: List[Connection] = []  # parent ends: chunks out ...
        self._results: List[Connection] = []  # ... and results in
        self._sent = self._received = 0

    def start(self) -> None:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        ctx = multiprocessing.get_context(method)
        # A child inherits the signal mask (across fork and exec); _worker_main unblocks it after
        # installing its own handlers, so a signal sent meanwhile waits instead of meeting ours.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS) if hasattr(signal, "pthread_sigmask") else None
        try:
            for i in range(self.n):
                task_out, task_in = ctx.Pipe(duplex=False)  # (receiving end, sending end)
                result_out, result_in = ctx.Pipe(duplex=False)
                self._tasks.append(task_in)
                self._results.append(result_out)
                inherited = [c.fileno() for c in self._tasks + self._results] if method == "fork" else []
                proc = ctx.Process(target=_worker_main, args=(task_out, result_in, self._init, self._init_args, self._work, inherited),
                                   name=f"megalm-worker-{i}", daemon=True)
                proc.start()
                self._procs.append(proc)
                task_out.close()
                result_in.close()
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def submit(self, task: Any) -> None:
        i = self._sent % self.n
        try:
            self._tasks[i].send(task)  # the worker's receiving thread takes it at once
        except OSError:  # EPIPE: that worker is gone
            self._lost(self._procs[i])
        self._sent += 1

    def result(self) -> Any:
        """The next result in submission order; a stop request or a dead worker ends the wait."""
        i = self._received % self.n
        conn, proc = self._results[i], self._procs[i]
        while not conn.poll(0.2):  # data, or EOF once the worker is gone
            self._check_stop()
            if proc.exitcode is not None and not conn.poll():
                self._lost(proc)
        self._check_stop()
        try:
            reply = conn.recv()
        except (EOFError, OSError):  # gone before, or while, sending it
            self._lost(proc)
        self._received += 1
        if reply[0] == "ok":
            return reply[1]
        _, error, remote_traceback = reply
        if isinstance(error, MegalmError):
            raise error  # a user's mistake, message complete
        raise error from _WorkerTraceback(remote_traceback)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise KeyboardInterrupt("stop requested")

    def _lost(self, proc) -> None:
        proc.join(1)
        code = proc.exitcode
        if self._stop.is_set() or code in (-signal.SIGTERM, -signal.SIGINT):  # the job is being stopped
            raise KeyboardInterrupt(f"{proc.name} was stopped")
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with code {code}"
        raise RuntimeError(f"{proc.name} (pid {proc.pid}) {how} before returning its result")

    def stop(self, graceful: bool = False) -> None:
        """End every worker; `graceful` (every result is in) lets them exit on their own first."""
        if graceful:
            for conn in self._tasks:
                with contextlib.suppress(OSError):
                    conn.send(None)
            deadline = time.monotonic() + 5
            for proc in self._procs:
                while proc.exitcode is None and time.monotonic() < deadline and not self._stop.is_set():
                    proc.join(0.1)
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._tasks + self._results:
            conn.close()
        self._procs, self._tasks, self._results = [], [], []
