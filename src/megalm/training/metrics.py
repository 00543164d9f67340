"""Metric sinks (metrics.jsonl, wandb, TensorBoard), throughput and MFU.

Only rank 0 writes; other ranks get a MetricLogger with no sinks.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from megalm.config import LoggingConfig
from megalm.errors import ConfigError

log = logging.getLogger("megalm.metrics")


class JsonlSink:
    """One JSON object a line: training steps carry `step` and `loss`, evaluations `val_loss`.

    A run that starts at `start_step` (0, or the step of the checkpoint it resumed) first drops
    the records of later steps: they belong to an attempt that died after that checkpoint and
    will be written again, so the file holds each step once.
    """

    def __init__(self, path: Path, start_step: int = 0):
        keep_records_through(path, start_step)
        self.file = open(path, "a", buffering=1)

    def write(self, record: Dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def keep_records_through(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) without the records after `step`; all of them when step is 0."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line torn by a kill mid-write
        if step > 0 and isinstance(record_step, int) and record_step <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class WandbSink:
    def __init__(self, cfg, run_dir: Path, config: Dict[str, Any]):
        import wandb  # a dependency, imported lazily: it is slow to import and most tests disable it
        try:
            self.run = wandb.init(mode=cfg.mode, project=cfg.project, entity=cfg.entity, dir=str(run_dir),
                                  config=config, name=run_dir.name, reinit="finish_previous")
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:  # no API key, or a bad one
            raise ConfigError(f"logging.wandb.mode={cfg.mode}: wandb did not start ({e}): run `wandb login` or set "
                              "WANDB_API_KEY, or set logging.wandb.mode=offline (or disabled)") from None

    def write(self, record: Dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package "
                              "(pip install 'megalm[tensorboard]'), or set logging.tensorboard=false") from None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: Dict[str, Any]) -> None:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.writer.close()


class MetricLogger:
    def __init__(self, cfg: Optional[LoggingConfig], run_dir: Optional[Path], config: Dict[str, Any],
                 start_step: int = 0):
        self.sinks: List[Any] = []
        if cfg is None or run_dir is None:
            return
        if cfg.jsonl:
            self.sinks.append(JsonlSink(run_dir / "metrics.jsonl", start_step))
        if cfg.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir))
        if cfg.wandb.mode != "disabled":
            self.sinks.append(WandbSink(cfg.wandb, run_dir, config))

    def write(self, record: Dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class Throughput:
    """Tokens/s, model TFLOP/s per device and MFU over the steps since the last report."""

    def __init__(self, flops_per_token: float, peak_flops: float, num_devices: int):
        self.flops_per_token, self.peak, self.devices = flops_per_token, peak_flops, num_devices
        self.reset()

    def reset(self) -> None:
        self.t0, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> Dict[str, float]:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        tps = self.tokens / dt
        flops = tps * self.flops_per_token / self.devices
        out = {"tokens_per_s": tps, "tflops_per_device": flops / 1e12}
        if self.peak > 0:
            out["mfu"] = flops / self.peak
        self.reset()
        return out


MATMUL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def peak_flops_for(cluster, precision: str, device: torch.device) -> float:
    """The MFU denominator of a run in `precision`: cluster.peak_flops, else the profile's peak for that
    precision, else a matmul measured in it (an fp32 peak under a bf16 run would inflate MFU ~2-15x)."""
    if cluster.peak_flops:
        return float(cluster.peak_flops)
    if precision in cluster.peak_flops_per_dtype:
        return float(cluster.peak_flops_per_dtype[precision])
    return measure_matmul_peak(device, MATMUL_DTYPES.get(precision, torch.float32))


def measure_matmul_peak(device: torch.device, dtype=torch.float32, n: int = 1024, seconds: float = 0.3) -> float:
    """Achievable dense matmul FLOP/s on this device: the MFU denominator when no peak is configured."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b  # warm up kernels and caches
    _sync(device)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    _sync(device)
    return 2.0 * n ** 3 * count / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
