"""`python -m megalm.train [overrides]`: compose the config, validate it, launch, train.

Thin on purpose: every piece is a builder that receives only its own config section.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from megalm.config import Config, conf_dir, register_configs, reject_unknown_keys, validate
from megalm.launch import plan_world

log = logging.getLogger("megalm.train")
register_configs()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def run(cfg: Config, run_dir: Path, world_size: int = 1) -> Optional[float]:
    """Train on this rank; return the final validation loss (None when evaluation is off)."""
    from megalm.data import build_data
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, flops_per_token, init_weights
    from megalm.parallel import parallelize
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.metrics import MetricLogger, Throughput, measure_matmul_peak
    from megalm.training.optim import LRSchedule, build_optimizer
    from megalm.training.trainer import Trainer

    t = cfg.trainer
    device = resolve_device(t.device)
    if device.type == "cpu":
        torch.set_num_threads(t.num_threads or max(1, (os.cpu_count() or 1) // world_size))
    torch.manual_seed(t.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")  # the frozen, resolved config

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    mesh = build_mesh(dims, device.type)
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed)
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}; set model.vocab_size >= {data.tokenizer.vocab_size}")
    data.tokenizer.save_to(run_dir)

    model = build_model(cfg.model, device="meta")
    model = parallelize(model, mesh, cfg.parallel)
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, cfg.model, t.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters on %s; run directory %s", cfg.model.name, n_params / 1e6, device, run_dir)

    optimizer = build_optimizer(cfg.optimizer, model)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir)
    peak = cfg.cluster.peak_flops or measure_matmul_peak(device)
    trainer = Trainer(
        t, model=model, optimizer=optimizer, schedule=LRSchedule(cfg.optimizer, t.max_steps), data=data,
        checkpointer=checkpointer,
        metrics=MetricLogger(cfg.logging, run_dir, OmegaConf.to_container(OmegaConf.structured(cfg))),
        throughput=Throughput(flops_per_token(cfg.model), peak, dims.world_size), device=device)
    latest = checkpointer.latest()
    if latest is not None:  # auto-resume: the run directory already holds a complete checkpoint
        trainer.load(latest)
    elif cfg.checkpoint.load:
        trainer.load(cfg.checkpoint.load)
    return trainer.fit()


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def main(dcfg: DictConfig) -> Optional[float]:
    """Hydra task function; returns the final validation loss so sweepers can optimise it."""
    try:
        reject_unknown_keys(dcfg)
        cfg: Config = OmegaConf.to_object(dcfg)
        world = plan_world(cfg)
        validate(cfg, world)
    except (ValueError, MissingMandatoryValue) as e:
        raise SystemExit(f"megalm: invalid config: {e}") from None
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir)
    return run(cfg, run_dir, world)


if __name__ == "__main__":
    main()
