"""Evaluation at a tensor- and pipeline-parallel layout, for a model too big for one device.

`load_at_layout` builds the run's model at tp x pp x dp over the ranks of the process group and
loads the run's latest checkpoint into it; checkpoints reshard, so the layout need not be the one
the run trained at. dp replicas divide the work: `across_replicas` gives each a contiguous share of
a task's items (windows, examples, prompts) and gathers the results, in order, on every rank.
`LayoutModel` is called as the single-process model is, `model(*inputs)`, and returns the whole
output on every rank of its replica: the
pipeline's stages run in order with plain sends and receives, the last stage gathers
vocabulary-parallel logits over tp, and sends its output to the other stages. Every rank then runs
the same scoring code on the same numbers (sampling included: the generators are seeded alike);
rank 0 writes the results. Generation recomputes the whole prefix for each new token: the KV
cache is the single-process path's.

`on_ranks` runs a function on tp x pp x dp ranks of this machine (gloo on CPU, NCCL on GPUs) when the
process is not one of a launcher's ranks already (torchrun sets RANK), and returns rank 0's result.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.config import ParallelConfig
from megalm.data import load_tokenizer
from megalm.distributed.comm import gather_last_dim
from megalm.distributed.mesh import ParallelDims, build_mesh
from megalm.errors import ConfigError, MegalmError, MissingFileError
from megalm.family import Part
from megalm.models import build_model, family_of
from megalm.models.registry import load_run_config
from megalm.parallel import materialize, parallelize
from megalm.parallel.pipeline import _recv, _send


class LayoutModel:
    """This rank's part of a model at a tp x pp layout, called as the whole model."""

    supports_cache = False
    """megalm.generate.generate_ids recomputes the prefix instead of keeping a KV cache."""

    def __init__(self, module: torch.nn.Module, layout, mesh):
        self.module, self.cfg = module, module.cfg
        self.dp_group = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
        """The data-parallel replicas' group (None: one replica), which across_replicas divides work over."""
        self.tp_group = mesh["tp"].get_group()
        self.tp = mesh["tp"].size()
        self.pp = mesh["pp"].size()
        self.stage = mesh["pp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        self.owners = [dist.get_global_rank(self.pp_group, r) for r in range(self.pp)]
        self.part = None
        if self.pp > 1:
            self.part = Part(tuple(layout.stage_ranges[self.stage]), self.stage == 0, self.stage == self.pp - 1)
        self.local_vocab = self.cfg.padded_vocab(self.tp) // self.tp if self.tp > 1 else None

    def parameters(self):
        return self.module.parameters()

    def eval(self) -> "LayoutModel":
        self.module.eval()
        return self

    def predictions(self, output, batch):
        """The family's reading of a fine-tuning head's output (GPT's at the last real token), if it has one."""
        read = getattr(self.module, "predictions", None)
        return read(output, batch) if read is not None else output

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor, cache=None, start: int = 0, **rows):
        """The whole model's output. `rows` (positions, attention_mask) and a `cache` that writes at
        them: the serving engine's per-rank slot cache (megalm.serve.engine), which every rank of the
        layout keeps for its own heads and layers; a KVCache of the single-process kind is refused."""
        if (cache is not None and not rows) or start:
            raise RuntimeError("a model at a layout keeps no KVCache: call it on the whole prefix")  # a bug
        if cache is not None:
            rows["cache"] = cache
        if self.pp == 1:
            return self._whole(self.module(*inputs, **rows))
        x = inputs if self.stage == 0 else _recv(self.owners[self.stage - 1], self.pp_group)
        out = self.module(*(x if isinstance(x, tuple) else (x,)), part=self.part, **rows)
        last = self.owners[-1]
        if self.stage < self.pp - 1:
            _send(out, self.owners[self.stage + 1], self.pp_group)
            return _recv(last, self.pp_group)
        out = self._whole(out)
        for rank in self.owners[:-1]:
            _send(out, rank, self.pp_group)
        return out

    def _whole(self, out):
        """Vocabulary-parallel logits gathered over tp (other outputs are replicated already)."""
        if self.local_vocab is None:
            return out
        if isinstance(out, tuple):
            return tuple(self._whole(o) for o in out)
        return gather_last_dim(out, self.tp_group) if out.shape[-1] == self.local_vocab else out


def check_layout(run_dir: Path, tp: int, pp: int):
    """The run's config, when the model splits into tp x pp (else a ConfigError)."""
    cfg = load_run_config(run_dir)
    m = cfg.model
    if pp > m.num_layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {m.num_layers} layers")
    if tp > 1 and family_of(m.arch).tp_plan is None:
        raise ConfigError(f"model.arch={m.arch} does not run tensor parallel: use --tp 1")
    if m.num_attention_heads % tp or m.kv_heads % tp:
        raise ConfigError(f"--tp {tp} must divide the model's {m.num_attention_heads} attention heads and "
                          f"{m.kv_heads} key/value heads")
    return cfg


def load_at_layout(run_dir: Path, tp: int, pp: int, device: str = "cpu", dp: int = 1):
    """(config, LayoutModel, tokenizer, checkpoint state) of the run's latest checkpoint at tp x pp, in
    each of dp replicas."""
    from megalm.training.checkpoint import Checkpointer  # lazy: torch's checkpoint library, off `--help`
    world = dist.get_world_size()
    if tp * pp * dp != world:
        raise ConfigError(f"--tp {tp} x --pp {pp} x --dp {dp} = {tp * pp * dp} must be the number of ranks, {world}")
    cfg = check_layout(run_dir, tp, pp)
    parallel = ParallelConfig(name=f"tp{tp}_pp{pp}_dp{dp}", tp=tp, pp=pp, dp=dp)
    cfg = dataclasses.replace(cfg, parallel=parallel)
    dims = ParallelDims.from_config(parallel, world)
    mesh = build_mesh(dims, torch.device(device).type)
    module = build_model(cfg.model, device="meta")
    layout = parallelize(module, family_of(module.cfg.arch), mesh, parallel, seed=cfg.trainer.seed)
    materialize(module, torch.device(device))
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, mesh["tp"].get_group())
    step_dir = checkpointer.for_reading()
    if step_dir is None:
        raise MissingFileError(f"no complete checkpoint under {run_dir / cfg.checkpoint.dir}: train this run "
                               "until it saves one (checkpoint.save=true), or point at a run that has one")
    state = checkpointer.load(step_dir, module, None, layout=layout)
    return cfg, LayoutModel(module.eval(), layout, mesh), load_tokenizer(run_dir), state


def on_ranks(world: int, on: str, fn: Callable[..., Any], *args: Any, wait_s: Optional[float] = None,
             **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on `world` ranks joined in one process group (gloo, or NCCL when `on` is a
    CUDA device); rank 0's result. Under a launcher (RANK in the environment) this process is one of
    the ranks and joins their group. `wait_s`: how long a collective may wait (None: torch's
    default; a server's ranks wait for requests as long as it runs). Every other keyword is fn's."""
    if dist.is_initialized():
        return fn(*args, **kwargs)
    backend = "nccl" if torch.device(on).type == "cuda" else "gloo"
    timeout = {} if wait_s is None else {"timeout": timedelta(seconds=wait_s)}
    if "RANK" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"the launcher started {os.environ['WORLD_SIZE']} ranks; the layout needs {world}")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, **timeout)
        try:
            return fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="megalm-eval-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, backend, os.path.join(tmp, "store"), queue, fn, args,
                                                 kwargs, timeout)) for r in range(world)]
        for p in procs:
            p.start()
        reports: Dict[int, Tuple[str, Any]] = {}
        failed_at = 0.0
        while len(reports) < world:  # read while they run: a large result fills the pipe before exit
            if queue.empty():
                failed = any(status != "ok" for status, _ in reports.values())
                if failed and time.monotonic() > failed_at + 30:
                    break  # the others may wait for the failed rank in a send or receive forever
                if any(not p.is_alive() and r not in reports for r, p in enumerate(procs)):
                    time.sleep(0.5)  # a report may still be in flight
                    if queue.empty():
                        break
                time.sleep(0.05)
                continue
            rank, status, value = queue.get()
            reports[rank] = (status, value)
            if status != "ok" and not failed_at:
                failed_at = time.monotonic()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for rank in sorted(reports):
        status, value = reports[rank]
        if status == "megalm":
            raise value
        if status == "error":
            raise RuntimeError(f"evaluation rank {rank} failed:\n{value}")
    if 0 not in reports:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise RuntimeError(f"evaluation ranks ended without a result (exit codes {codes})")
    return reports[0][1]


def _rank(rank: int, world: int, backend: str, store_path: str, queue, fn, args, kwargs, timeout) -> None:
    import traceback
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                **timeout)
        queue.put((rank, "ok", fn(*args, **kwargs)))
    except MegalmError as e:
        queue.put((rank, "megalm", e))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def across_replicas(model, fn: Callable[[list], list], items: Sequence[Any]) -> list:
    """fn(items) (a list, one result per item), each data-parallel replica of `model` computing a
    contiguous share; every rank gets all the results in order. One replica (or a single-process
    model): fn(items) itself."""
    group = getattr(model, "dp_group", None)
    items = list(items)
    if group is None:
        return list(fn(items))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = [len(items) * r // world for r in range(world + 1)]
    mine = list(fn(items[bounds[rank]:bounds[rank + 1]]))
    parts: List[Any] = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return [x for part in parts for x in part]


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


__all__ = ["LayoutModel", "across_replicas", "check_layout", "is_rank0", "load_at_layout", "on_ranks"]
