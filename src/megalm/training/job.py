"""One rank's training job: from a validated Config to a finished fit.

`run` is what every rank executes, whoever started it (this process, the local launcher's
spawned ranks, torchrun or srun; megalm.launch owns the rank's lifecycle around it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megalm.config import Config
from megalm.data import build_data, build_data_tokenizer, num_samples_for
from megalm.distributed.device import resolve_device
from megalm.distributed.mesh import ParallelDims, build_mesh
from megalm.errors import DataError
from megalm.models import build_model, flops_per_token, init_weights
from megalm.models.registry import family_of
from megalm.parallel import build_data_parallel, materialize, parallelize
from megalm.parallel.pipeline import after_weight_passes, build_pipeline
from megalm.report import write_run_curves
from megalm.training import cpu_memory
from megalm.training.compiling import apply_compile
from megalm.training.memory import check_host_memory
from megalm.training.metrics import MetricLogger, Throughput, peak_flops_for
from megalm.training.optim import LRSchedule, build_optimizer
from megalm.training.precision import param_dtype

log = logging.getLogger("megalm.train")


def omp_threads() -> int:
    """$OMP_NUM_THREADS as a positive number of threads, else 0 (unset, empty or not a positive integer)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 0


def run(cfg: Config, run_dir: Path, world_size: int = 1) -> Optional[float]:
    """Train on this rank; return the final validation loss (None when evaluation is off).

    Order: what the config and file headers can refuse (the tokenizer against the model, the
    checkpoint to resume against tokenizer and model) comes before the corpus is tokenized or the
    model built, and the run directory changes only once the start is accepted.
    """
    # lazy: these three import torch.distributed.checkpoint (~1 s), kept out of `megalm.train --help`
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.resume import nothing_left, plan_start
    from megalm.training.trainer import Trainer
    t = cfg.trainer
    device = resolve_device(t.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cpu":
        torch.set_num_threads(t.num_threads or omp_threads() or max(1, (os.cpu_count() or 1) // local_ranks))
        why = cpu_memory.apply_cpu_allocator(t.cpu_allocator)  # through the module: a test replaces it there
        if why is not None and rank == 0:
            log.warning("trainer.cpu_allocator=%s: %s", t.cpu_allocator, why)
    torch.manual_seed(t.seed)  # the stream shared by every rank (dropout on replicated activations)

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    mesh = build_mesh(dims, device.type)
    tokenizer = build_data_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    family = family_of(cfg.model.arch)
    samples = family.samples(cfg.model) if family.samples is not None else None
    if t.epochs is not None:
        cfg = steps_for_epochs(cfg, tokenizer, samples)
        t = cfg.trainer
    frozen = OmegaConf.structured(cfg)  # once: a structured copy of the whole config costs ~0.1 s
    config_yaml = OmegaConf.to_yaml(frozen)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, mesh["tp"].get_group() if mesh is not None else None,
                                config_yaml)
    start = plan_start(cfg, checkpointer, tokenizer, run_dir)
    why = nothing_left(start, t.max_steps)
    if why is not None:
        if rank == 0:
            log.warning("%s", why)
        return start.state.get("val_loss")

    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed, tokenizer=tokenizer,
                      num_samples=num_samples_for(t.max_steps, t.global_batch_size, t.eval_interval, t.eval_steps),
                      samples=samples)
    model = build_model(cfg.model, device="meta")
    layout = parallelize(model, family, mesh, cfg.parallel, seed=t.seed)
    check_host_memory(cfg, sum(p.numel() for p in model.parameters()), dims.dp, device)  # still on meta: free
    materialize(model, device)
    init_weights(model, cfg.model, t.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters on this rank (%s, world %d: %s); run directory %s", cfg.model.name,
             n_params / 1e6, device, world_size, dims, run_dir)

    pipeline = None
    if dims.pp > 1:
        pipeline = build_pipeline(model, family, layout, mesh["pp"].get_group(), cfg.parallel,
                                  t.global_batch_size // (t.micro_batch_size * dims.dp), device)
    apply_compile(model, family.parts, t.compile, t.compile_backend, device.type, pipeline)
    data_parallel = build_data_parallel(model, family, mesh, layout, cfg.parallel.zero_stage, cfg.parallel.bucket_size_mb,
                                        param_dtype(t), cfg.parallel.overlap_param_gather)
    if pipeline is not None and data_parallel is not None and data_parallel.main_params:
        after_weight_passes(pipeline, data_parallel.absorb)
    optimizer = build_optimizer(cfg.optimizer, model, data_parallel)
    peak = peak_flops_for(cfg.cluster, t.precision, device)
    if rank == 0 and not (cfg.cluster.peak_flops or t.precision in cfg.cluster.peak_flops_per_dtype):
        log.info("MFU is against a %s matmul measured now on this %s: %.3g TFLOP/s a device; it moves with what "
                 "else the machine runs (set cluster.peak_flops for a fixed denominator)", t.precision, device.type,
                 peak / 1e12)
    trainer = Trainer(
        t, model=model, optimizer=optimizer, schedule=LRSchedule(cfg.optimizer, t.max_steps), data=data,
        family=family, checkpointer=checkpointer, mesh=mesh, layout=layout, pipeline=pipeline, data_parallel=data_parallel,
        throughput=Throughput(flops_per_token(cfg.model), peak, dims.world_size), device=device,
        is_rank0=rank == 0, run_dir=run_dir, prefetch=cfg.data.prefetch)
    if start.path is not None:
        trainer.load(start.path, weights_only=start.weights_only, metadata=start.metadata)
    checkpointer.check_writable()  # the last check: said now, not at the first save after the training it would lose
    # The start is accepted: only now does the run directory change.
    if rank == 0 and cfg.logging.curves and not cfg.logging.jsonl:
        log.warning("logging.curves=true draws metrics.jsonl, which logging.jsonl=false leaves unwritten: no "
                    "curves.png for this run")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)  # the frozen, resolved config
        data.tokenizer.save_to(run_dir)
    trainer.metrics = MetricLogger(cfg.logging if rank == 0 else None, run_dir,
                                   OmegaConf.to_container(frozen), start_step=start.step)
    val_loss = trainer.fit()
    if rank == 0 and cfg.logging.jsonl and cfg.logging.curves:
        write_run_curves(run_dir)
    return val_loss


def steps_for_epochs(cfg: Config, tokenizer, samples) -> Config:
    """cfg with trainer.max_steps = ceil(trainer.epochs x one epoch's training samples / global batch):
    the fine-tuning data read once to count them (the run then reads it again for its steps)."""
    t = cfg.trainer
    data_log = logging.getLogger("megalm.data")  # the run's own build says what it read: once, not here too
    level = data_log.level
    data_log.setLevel(logging.WARNING)
    try:
        one_epoch = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed, tokenizer=tokenizer,
                               samples=samples)
    finally:
        data_log.setLevel(level)
    n = len(one_epoch.train)
    steps = max(1, math.ceil(t.epochs * n / t.global_batch_size))
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("trainer.epochs=%d over %d training samples at global batch %d: trainer.max_steps=%d", t.epochs, n,
                 t.global_batch_size, steps)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, max_steps=steps))
