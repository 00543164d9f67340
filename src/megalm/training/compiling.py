"""torch.compile for training (`trainer.compile`): which modules are compiled, the fallback, the cost.

Two granularities, as the two reference frameworks do it:
- `model`: the whole forward a rank runs, compiled as one graph: the model at pp = 1, each pipeline
  stage's view (megalm.parallel.pipeline.StageView) under pipeline parallelism;
- `blocks`: each transformer block on its own (torchtitan's way): one graph a block, reused by every
  block of the same shape, so compilation time does not grow with depth.
Modules are compiled in place (nn.Module.compile), so parameter names, checkpoints, the optimizer and
the data-parallel gradient hooks see the same modules as eagerly.

Tensor and sequence parallelism compile into whole graphs: their collectives are traced as functional
collectives (megalm.distributed.comm), and dropout that draws per tp rank takes its rank's share of one
draw from the default generator instead of forking a stream (megalm.parallel.styles.ForkRNG).
Recomputation compiles too (torch.utils.checkpoint, which replays the graph's random draws itself).

Dynamo falls back to eager execution by itself around what it cannot trace (a graph break); the count
of breaks and the compilation time are logged after the first step and written in the next metrics
record (`compile_stats`). A backend that cannot run at all here (inductor on CPU without a C++
compiler) is refused up front with a warning, and the run goes on eagerly.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Dict, List, Optional

from torch import nn

from megalm.family import Parts

log = logging.getLogger(__name__)

MODES = ("none", "model", "blocks")


def _backend_usable(backend: str, device_type: str) -> Optional[str]:
    """None when `backend` can compile here; otherwise why not."""
    if backend == "inductor" and device_type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        if shutil.which(cxx) is None and shutil.which("c++") is None:
            return f"inductor generates C++ on CPU and no compiler ({cxx}, c++) is on PATH"
    return None


def compile_targets(model: nn.Module, parts: Parts, mode: str, pipeline=None) -> List[nn.Module]:
    """The modules `mode` compiles on this rank (see the module docstring); `parts`: its family's."""
    if mode == "none":
        return []
    if mode == "blocks":
        return list(getattr(model, parts.layers).values())
    if mode == "model":
        return [stage.submod for stage in pipeline.stages] if pipeline is not None else [model]
    raise ValueError(f"trainer.compile={mode!r}; choose one of {', '.join(MODES)}")


def apply_compile(model: nn.Module, parts: Parts, mode: str, backend: str, device_type: str, pipeline=None) -> int:
    """Compile this rank's `compile_targets` in place with `backend`; returns how many were compiled
    (0 when `mode` is none or the backend cannot run here, which is logged)."""
    targets = compile_targets(model, parts, mode, pipeline)
    if not targets:
        return 0
    why = _backend_usable(backend, device_type)
    if why is not None:
        log.warning("trainer.compile=%s: %s; training runs eagerly", mode, why)
        return 0
    import torch._dynamo
    # Graphs are cached per code object (Module._call_impl for every module), and a process that ran another
    # model before (tests, sweeps in one process) would reuse or exhaust that cache: start this run afresh.
    torch._dynamo.reset()
    if pipeline is not None:
        # The pipeline schedules run a stage's backward in two passes (the input's gradient, then the
        # weights'), keeping the graph between them; AOT autograd's donated buffers refuse that.
        import torch._functorch.config
        torch._functorch.config.donated_buffer = False
    for module in targets:
        module.compile(backend=backend)
    log.info("trainer.compile=%s: %d module(s) compiled with backend %s on first use", mode, len(targets), backend)
    return len(targets)


def compile_stats(since: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """What compilation cost in this process (or since the stats `since`): seconds compiling, graphs
    built, graph breaks (code dynamo ran eagerly between graphs)."""
    from torch._dynamo.utils import compile_times, counters
    names, times = compile_times(repr="csv", aggregate=True)
    seconds = sum(float(t) for name, t in zip(names, times) if name == "_compile.compile_inner")
    now = {"compile_s": seconds, "compile_graphs": counters["stats"].get("unique_graphs", 0),
           "compile_graph_breaks": sum(counters["graph_break"].values())}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def compile_report(stats: Dict[str, float]) -> str:
    """`compile_stats` in words, with the commonest reasons for graph breaks in this process."""
    from torch._dynamo.utils import counters
    s = stats
    reasons = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])[:3] if s["compile_graph_breaks"] else []
    detail = "; ".join(f"{reason.strip().splitlines()[0][:100]} (x{n})" for reason, n in reasons)
    return (f"{s['compile_s']:.1f} s compiling, {s['compile_graphs']} graph(s), {s['compile_graph_breaks']} graph "
            f"break(s) run eagerly" + (f": {detail}" if detail else ""))
