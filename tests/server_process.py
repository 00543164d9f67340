"""A megalm.serve server in a process of its own, as users start it: on a free port of 127.0.0.1,
waited for until /health answers (start_server), and stopped with SIGTERM (stop_server)."""

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(run_dir: Path, *extra: str):
    """The server's output (its log: a line a request) goes to a file, `proc.log_path`: a pipe nobody reads would
    fill and block the server."""
    port = _port()
    log = tempfile.NamedTemporaryFile("w", prefix="megalm-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "megalm.serve", str(run_dir), "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()
    proc.log_path = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not answer /health in 120 s")


def stop_server(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.log_path.unlink(missing_ok=True)
