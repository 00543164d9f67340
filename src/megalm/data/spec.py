"""The data config's small languages, parsed without torch or numpy: the split and the blend.

Validation checks them before anything is allocated and the loader reads them the same way, so
both import them from here (neither imports the other).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, List, Sequence, Tuple

from megalm.config import DataConfig
from megalm.errors import ConfigError, DataError


def split_weights(split: str) -> List[float]:
    """The train, validation[, test] weights of data.split ("98,2,0" or Megatron's "98/2/0")."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data.split={split!r} must be comma-separated numbers, e.g. '98,2,0'") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or len(weights) < 2 or weights[0] <= 0 or weights[1] <= 0:
        raise ConfigError(
            f"data.split={split!r} needs 2 or 3 non-negative weights (train, validation[, test]) "
            "with positive train and validation parts")
    return weights


def _as_weight(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise DataError(f"{where}: weight {value!r} is not a number")
    if isinstance(value, Real):
        w = float(value)
    else:
        try:
            w = float(str(value))
        except ValueError:
            raise DataError(f"{where}: weight {value!r} is not a number") from None
    if not math.isfinite(w):
        raise DataError(f"{where}: weight {value!r} is not finite")
    return w


def parse_blend(spec: Sequence[Any], what: str = "data.blend") -> List[Tuple[float, str]]:
    """[(weight, prefix), ...] from [[w, prefix], ...] or Megatron's flat [w, prefix, w, prefix, ...].

    Weights may be numbers or numeric strings; a lone [prefix] means weight 1. Raises ValueError
    on negative weights, all-zero weights, or a malformed list, naming the entries.
    """
    items = list(spec)
    if not items:
        raise DataError(f"{what} is empty")
    pairs: List[Tuple[float, str]] = []
    if all(isinstance(x, (list, tuple)) or _is_sequence_node(x) for x in items):
        for k, pair in enumerate(items):
            pair = list(pair)
            if len(pair) != 2:
                raise DataError(f"{what}[{k}]={pair!r} must be [weight, prefix]")
            pairs.append((_as_weight(pair[0], f"{what}[{k}]"), str(pair[1])))
    elif len(items) == 1:
        pairs.append((1.0, str(items[0])))
    else:
        if len(items) % 2:
            raise DataError(f"{what}={items!r}: the flat form alternates weight and prefix, but it has "
                            f"{len(items)} entries")
        for k in range(0, len(items), 2):
            pairs.append((_as_weight(items[k], f"{what}[{k}]"), str(items[k + 1])))
    for k, (w, prefix) in enumerate(pairs):
        if w < 0:
            raise DataError(f"{what}: weight {w} of {prefix} is negative; weights must be >= 0")
        if not prefix or prefix == "None":
            raise DataError(f"{what}: entry {k} has no dataset prefix")
    if sum(w for w, _ in pairs) <= 0:
        raise DataError(f"{what}: all weights are zero ({', '.join(f'{w} {p}' for w, p in pairs)}); "
                        "at least one must be positive")
    return pairs


def _is_sequence_node(x: Any) -> bool:
    try:
        from omegaconf import ListConfig
        return isinstance(x, ListConfig)
    except ImportError:  # pragma: no cover
        return False


def blend_spec(cfg: DataConfig) -> List[Tuple[float, str]]:
    """(weight, prefix) pairs of a source=indexed config, from data.blend or data.paths."""
    blend, paths = list(cfg.blend or []), list(cfg.paths or [])
    if blend and paths:
        raise DataError(f"set data.paths (one prefix) or data.blend (weighted prefixes), not both "
                        f"(got paths={paths}, blend={blend})")
    if blend:
        return parse_blend(blend, "data.blend")
    if len(paths) == 1:
        return [(1.0, str(paths[0]))]
    if len(paths) > 1:
        try:
            return parse_blend(paths, "data.paths")  # Megatron's --data-path "w1 p1 w2 p2"
        except ValueError as e:
            raise DataError(f"data.paths takes one prefix, or Megatron's flat [weight, prefix, ...]; for "
                            f"blending several datasets use data.blend=[[w, prefix], ...] ({e})") from None
    raise DataError("data.source=indexed needs data.paths=[prefix] or data.blend=[[weight, prefix], ...]")
