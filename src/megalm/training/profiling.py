"""trainer.profile_steps: chosen training steps under torch.profiler, a Chrome trace per rank.

Each rank writes `<run dir>/profiles/step_XXXXXXXX_rankR.pt.trace.json` (the `.pt.trace.json`
ending is what TensorBoard's profiler plugin and Holistic Trace Analysis look for); open it in
chrome://tracing or https://ui.perfetto.dev. CPU activity always, CUDA kernels when the run is on a GPU.
The profiler's own cost lands in that step's time (and in the breakdown's next record).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("megalm.trainer")


def trace_path(run_dir: Path, step: int, rank: int) -> Path:
    return Path(run_dir) / "profiles" / f"step_{step:08d}_rank{rank}.pt.trace.json"


@contextlib.contextmanager
def profile_step(run_dir: Optional[Path], step: int, device: torch.device) -> Iterator[None]:
    """Run the block (one training step) under torch.profiler and write this rank's trace."""
    from torch.profiler import ProfilerActivity, profile
    if run_dir is None:
        raise ValueError("trainer.profile_steps needs the run directory to write traces into (Trainer(run_dir=...))")
    rank = dist.get_rank() if dist.is_initialized() else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    path = trace_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    if rank == 0:
        log.info("step %d: profiler trace written to %s (one per rank: %s)", step, path,
                 path.name.replace("rank0", "rank*"))
