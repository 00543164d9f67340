"""The tiny single-process GPT run of the end-to-end tests: its overrides (TINY), the validated
Config a list of overrides composes to (load, as `python -m megalm.train` would run it in one
process), and a run's metrics records."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megalm.config import conf_dir
from megalm.models.registry import register_configs
from megalm.validation import validate

register_configs()
TINY = ["model=gpt_tiny", "data=mock", "logging.curves=false", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
        "trainer.eval_steps=2", "trainer.log_interval=1", "trainer.progress_bar=false",
        "optimizer.warmup_steps=2", "trainer.num_threads=1", "cluster.peak_flops=1e12"]


def load(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=list(overrides)))
    validate(cfg, 1)
    return cfg


def records(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
