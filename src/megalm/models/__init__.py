"""Plain single-device model code, one package a family (gpt/, bert/, t5/) over shared layers;
parallelism is applied from outside (megalm.parallel), by the plans each family's parallelize.py gives.

`build_model`, `init_weights` and `flops_per_token` find the family of `model.arch` in the registry
(megalm.models.registry), for the commands that start from a config; code below them is handed the
Family instead.
"""

from __future__ import annotations

from typing import Any

from megalm.models.registry import family_names, family_of

_BUILD = ("build_model", "flops_per_token", "init_weights")


def __getattr__(name: str) -> Any:
    """build_model, init_weights and flops_per_token (megalm.models.build), imported on first use: they need
    torch, which `from megalm.models import family_of` and the registry do without."""
    if name in _BUILD:
        from megalm.models import build  # lazy: torch, off the paths that only need the registry
        return getattr(build, name)
    raise AttributeError(f"module 'megalm.models' has no attribute {name!r}")


__all__ = ["build_model", "family_names", "family_of", "flops_per_token", "init_weights"]
