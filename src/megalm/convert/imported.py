"""What makes an imported checkpoint dir a run directory: a whole run's config.yaml (the default run with the
imported model, its tokenizer and chat template, its checkpoints in the dir itself) and the tokenizer with its
end token, so generate, serve, evaluate and plan take the dir as they take a trained run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from megalm.config import ModelConfig, conf_dir
from megalm.data.tokenizers.huggingface import HF_SIDECAR
from megalm.models.registry import register_configs


def copy_tokenizer(hf_dir: Path, out: Path) -> bool:
    """tokenizer.json and megalm's note of its end token (tokenizer_config.json's eos_token) into `out`; False when
    the folder has no tokenizer.json."""
    if not (hf_dir / "tokenizer.json").is_file():
        return False
    shutil.copyfile(hf_dir / "tokenizer.json", out / "tokenizer.json")
    eos = None
    if (hf_dir / "tokenizer_config.json").is_file():
        eos = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos  # older files: an AddedToken's fields
    (out / HF_SIDECAR).write_text(json.dumps({"type": "huggingface", "eod_token": eos, "add_special_tokens": False},
                                             indent=1) + "\n")
    return True


def run_config_yaml(cfg: ModelConfig, header: str, out: Path, tokenizer: bool, chat_template: Optional[str]) -> str:
    """config.yaml of the default run (conf/config.yaml) with this model; checkpoint.dir is the dir itself."""
    from hydra import compose, initialize_config_dir  # lazy: Hydra's compose, off `--help`
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = compose("config")
    run.model = OmegaConf.structured(cfg)
    run.checkpoint.dir = "."
    if tokenizer:
        run.data.tokenizer.type = "huggingface"
        run.data.tokenizer.model = str(out / "tokenizer.json")
    if chat_template is not None:
        run.data.chat_template = chat_template
    return "".join(f"# {line}\n" for line in header.splitlines()) + OmegaConf.to_yaml(run)
