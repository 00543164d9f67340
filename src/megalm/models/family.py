"""The model-family registry: `model.arch` -> what a family declares about its models.

A family is a module under megalm.models that defines `FAMILY`, a Family. The registry names
the module and imports it on first use, so the list of families is known without importing
every model. Code outside a family's own files reaches its models
through `family_of(arch)`: how to build and initialise one, which parameters hold vocabulary
rows, which are tied, and its FLOPs per token.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from megalm.errors import ConfigError

FAMILY_MODULES: Dict[str, str] = {
    "gpt": "megalm.models.gpt",
}
"""model.arch -> the module defining its FAMILY; a new family adds its line here."""


@dataclass(frozen=True)
class Family:
    name: str
    """The model.arch value that selects it."""
    build: Callable[..., Any]
    """(ModelConfig, tp) -> the plain model on the current default device, not initialised."""
    init_weights: Callable[..., None]
    """(model, ModelConfig, seed) -> None: fill every parameter from (seed, global name)."""
    flops_per_token: Callable[..., float]
    """(ModelConfig, seq_length or None) -> training FLOPs per token (megalm.models.flops)."""
    vocab_params: Tuple[str, ...] = ()
    """Parameters whose rows are the padded vocabulary: a checkpoint stores the real rows only."""
    tied: Tuple[Tuple[str, str], ...] = ()
    """(copy, source) pairs shared when the config ties them (the head to the embedding)."""


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
