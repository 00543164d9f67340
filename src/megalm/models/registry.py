"""The family registry: `model.arch` -> its Family, and what needs the family by name.

A family is a package under megalm.models defining `FAMILY` (a megalm.family.Family); the registry
names the package and imports it on first use, so the list of families is known without importing
every model. The commands (train, generate, serve, evaluate, convert, plan) look a family up here once,
from the config, and pass it down; nothing below them looks it up. Also here, since they need the
family's schema: a model section typed by it (`model_config_from`, a run's `load_config`), the schemas
registered with Hydra (`register_configs`) and a model config written as a preset (`preset_yaml`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megalm.config import Config, ModelConfig
from megalm.errors import ConfigError, MissingFileError
from megalm.family import Family

FAMILY_MODULES: Dict[str, str] = {
    "gpt": "megalm.models.gpt",
    "bert": "megalm.models.bert",
    "t5": "megalm.models.t5",
    "neox": "megalm.models.neox",
}
"""model.arch -> the package defining its FAMILY; a new family adds its line here."""


def family_names() -> Tuple[str, ...]:
    return tuple(FAMILY_MODULES)


def family_of(arch: str) -> Family:
    """The registered family `arch` names; a ConfigError listing the families otherwise."""
    module = FAMILY_MODULES.get(arch)
    if module is None:
        raise ConfigError(f"model.arch={arch!r} is not a model family megalm has; choose one of "
                          f"{', '.join(family_names())}")
    family: Optional[Family] = getattr(importlib.import_module(module), "FAMILY", None)
    if not isinstance(family, Family) or family.name != arch:
        raise RuntimeError(f"{module} must define FAMILY = Family(name={arch!r}, ...)")  # a bug in the family
    return family


def register_configs() -> None:
    """Register the schema so conf/config.yaml can put it first in its defaults list, and each
    family's model schema as `model/<arch>_schema` for its presets to name."""
    cs = ConfigStore.instance()
    cs.store(name="megalm_schema", node=Config)
    for arch in family_names():
        cs.store(group="model", name=f"{arch}_schema", node=family_of(arch).config)


def model_config_from(section: Any) -> ModelConfig:
    """A model section typed by its family's schema: a run's config.yaml `model:` (it names its
    arch) or a conf/model preset (it names `<arch>_schema` in its defaults); neither: GPT, as
    files from before families had schemas."""
    node = OmegaConf.create(OmegaConf.to_container(section) if isinstance(section, DictConfig) else section)
    defaults = node.pop("defaults", None) or []
    named = [str(d)[:-len("_schema")] for d in defaults if str(d).endswith("_schema")]
    arch = node.get("arch") or (named[0] if named else "gpt")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(family_of(arch).config), node))


def load_config(path: Any) -> Config:
    """A run's frozen config.yaml as a Config, its model section typed by its family's schema."""
    raw = OmegaConf.load(path)
    model = model_config_from(raw.model) if "model" in raw else None
    if model is not None:
        del raw["model"]
    cfg = OmegaConf.merge(OmegaConf.structured(Config), raw)
    if model is not None:
        cfg.model = OmegaConf.structured(model)
    return OmegaConf.to_object(cfg)


def preset_yaml(model: ModelConfig) -> str:
    """`model` as a conf/model preset: its family's schema first, then the values."""
    return f"defaults:\n  - {model.arch}_schema\n  - _self_\n" + OmegaConf.to_yaml(OmegaConf.structured(model))


def load_run_config(run_dir: Path) -> Config:
    """The frozen config of a run directory megalm.train wrote; what else it was given, said."""
    if not run_dir.is_dir():
        raise MissingFileError(f"{run_dir} does not exist or is not a directory: point at a run directory "
                               "written by megalm.train (its hydra.run.dir)")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist: point at a run directory written by megalm.train")
    try:
        return load_config(path)
    except Exception as e:  # YAML syntax, unknown keys and wrong types come as several omegaconf types
        raise ConfigError(f"{path} is not a megalm run config: {e}") from None
