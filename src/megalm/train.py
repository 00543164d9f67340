"""`python -m megalm.train [overrides]`: compose the config, validate it, launch, train.

Thin on purpose: every piece is a builder that receives only its own config section.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from megalm.cli import run_hydra_app
from megalm.config import Config, conf_dir, register_configs
from megalm.errors import ConfigError, DataError, DeviceError, MegalmError, cli_errors
from megalm.validation import reject_unknown_keys, validate
from megalm.launch import detect_rank_env, init_distributed, plan_world, spawn_local

log = logging.getLogger("megalm.train")
register_configs()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def setup_rank_logging(rank: int, run_dir: Path) -> None:
    """Spawned ranks do not run Hydra: rank 0 logs to the console and train.log, others warnings only."""
    fmt = logging.Formatter(f"[%(asctime)s][%(name)s][%(levelname)s][rank {rank}] - %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        root.addHandler(file)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def run(cfg: Config, run_dir: Path, world_size: int = 1) -> Optional[float]:
    """Train on this rank; return the final validation loss (None when evaluation is off).

    Order: what the config and file headers can refuse (the tokenizer against the model, the
    checkpoint to resume against tokenizer and model) comes before the corpus is tokenized or the
    model built, and the run directory changes only once the start is accepted.
    """
    from megalm.data import build_data, build_data_tokenizer, num_samples_for
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, flops_per_token, init_weights
    from megalm.parallel import materialize, parallelize
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.metrics import MetricLogger, Throughput, peak_flops_for
    from megalm.training.optim import LRSchedule, build_optimizer
    from megalm.training.resume import nothing_left, plan_start
    from megalm.training.trainer import Trainer

    t = cfg.trainer
    device = resolve_device(t.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cpu":
        torch.set_num_threads(t.num_threads or max(1, (os.cpu_count() or 1) // local_ranks))
    torch.manual_seed(t.seed)  # the stream shared by every rank (dropout on replicated activations)

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    mesh = build_mesh(dims, device.type)
    tokenizer = build_data_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, mesh["tp"].get_group() if mesh is not None else None,
                                config_yaml)
    start = plan_start(cfg, checkpointer, tokenizer, run_dir)
    why = nothing_left(start, t.max_steps)
    if why is not None:
        if rank == 0:
            log.warning("%s", why)
        return start.state.get("val_loss")

    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed, tokenizer=tokenizer,
                      num_samples=num_samples_for(t.max_steps, t.global_batch_size, t.eval_interval, t.eval_steps))
    model = build_model(cfg.model, device="meta", tp=dims.tp)
    model = parallelize(model, mesh, cfg.parallel, seed=t.seed)
    materialize(model, device)
    init_weights(model, cfg.model, t.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters on this rank (%s, world %d: %s); run directory %s", cfg.model.name,
             n_params / 1e6, device, world_size, dims, run_dir)

    pipeline = None
    if dims.pp > 1:
        from megalm.parallel.pipeline import build_pipeline
        plan = model.pp_plan
        pipeline = build_pipeline(model, plan["ranges"], plan["stage_ids"], plan["num_stages"],
                                  mesh["pp"].get_group(), cfg.parallel,
                                  t.global_batch_size // (t.micro_batch_size * dims.dp), device)
    from megalm.parallel.data import build_data_parallel
    data_parallel = build_data_parallel(model, mesh, cfg.parallel.zero_stage, cfg.parallel.bucket_size_mb)
    optimizer = build_optimizer(cfg.optimizer, model, data_parallel)
    peak = peak_flops_for(cfg.cluster, t.precision, device)
    trainer = Trainer(
        t, model=model, optimizer=optimizer, schedule=LRSchedule(cfg.optimizer, t.max_steps), data=data,
        checkpointer=checkpointer, mesh=mesh, pipeline=pipeline, data_parallel=data_parallel,
        throughput=Throughput(flops_per_token(cfg.model), peak, dims.world_size), device=device,
        is_rank0=rank == 0)
    if start.path is not None:
        trainer.load(start.path, weights_only=start.weights_only)
    # The start is accepted: only now does the run directory change.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)  # the frozen, resolved config
        data.tokenizer.save_to(run_dir)
    trainer.metrics = MetricLogger(cfg.logging if rank == 0 else None, run_dir,
                                   OmegaConf.to_container(OmegaConf.structured(cfg)), start_step=start.step)
    return trainer.fit()


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def hydra_main(dcfg: DictConfig) -> Optional[float]:
    """Hydra task function; returns the final validation loss so sweepers can optimise it."""
    with cli_errors("megalm"):  # printed here: Hydra would add its own line to a raised exception
        return _task(dcfg)


def _task(dcfg: DictConfig) -> Optional[float]:
    try:
        reject_unknown_keys(dcfg)
        cfg: Config = OmegaConf.to_object(dcfg)
        world = plan_world(cfg)
        validate(cfg, world)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} has no value (??? in the config); set it, e.g. {e.full_key}=...") from None
    except ValueError as e:  # validation is pure arithmetic: any ValueError there is about the config
        if isinstance(e, MegalmError):
            raise
        raise ConfigError(str(e)) from None
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)
    if detect_rank_env() is not None:  # started by torchrun or srun: this process is one rank
        init_distributed(cfg, resolve_device(cfg.trainer.device).type)
        shared = [str(run_dir)]  # ranks may have started seconds apart: take rank 0's directory
        dist.broadcast_object_list(shared, src=0)
        if dist.get_rank() != 0:  # Hydra set up logging on every rank; only rank 0 reports progress
            logging.getLogger().setLevel(logging.WARNING)
        try:
            return run(cfg, Path(shared[0]), world)
        finally:
            dist.destroy_process_group()
    if world == 1:
        return run(cfg, run_dir, 1)
    return spawn_local(cfg, run_dir, world)


def main() -> Optional[float]:
    """`python -m megalm.train` / `megalm-train`: the Hydra app, with megalm's error reporting."""
    return run_hydra_app(hydra_main)


if __name__ == "__main__":
    main()
