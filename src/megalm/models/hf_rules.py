"""The pieces a family's Hugging Face mapping is written in (its `Family.hf` module uses them).

A mapping is a list of Rules per Hugging Face architecture: each joins some HF tensors into one
megalm parameter (import) and splits it back (export); "{i}" in a name stands for the layer
index. Nothing here names a model's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from megalm.config import ModelConfig
from megalm.errors import ConfigError, DataError

Tensor = torch.Tensor


class UnsupportedArchitecture(ConfigError):
    """A megalm config or HF config.json that the other side cannot represent exactly."""


@dataclass(frozen=True)
class Transform:
    """split: megalm tensor → the HF tensors of a rule; join: the inverse."""
    split: Callable[[Tensor, ModelConfig], List[Tensor]]
    join: Callable[[List[Tensor], ModelConfig], Tensor]


SAME = Transform(lambda t, c: [t], lambda ts, c: ts[0])
# GPT-2's Conv1D keeps (in, out); nn.Linear keeps (out, in).
CONV1D = Transform(lambda t, c: [t.t()], lambda ts, c: ts[0].t())


def rows(sizes: Callable[[ModelConfig], List[int]]) -> Transform:
    """Stacked along dim 0 (weights and biases alike): split into / concatenate from parts of `sizes`."""
    return Transform(lambda t, c: list(torch.split(t, sizes(c), dim=0)), lambda ts, c: torch.cat(ts, dim=0))


QKV = rows(lambda c: [c.num_attention_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim])


@dataclass(frozen=True)
class Rule:
    megalm: str  # parameter name, "{i}" = layer index
    hf: Tuple[str, ...]  # HF tensor names, in the order the transform splits / joins them
    transform: Transform = SAME


def expand(rules: Sequence[Rule], cfg: ModelConfig) -> Dict[str, Rule]:
    """megalm parameter name → its rule with "{i}" filled in, for every layer of cfg."""
    out: Dict[str, Rule] = {}
    for rule in rules:
        for i in range(cfg.num_layers) if "{i}" in rule.megalm else [0]:
            name = rule.megalm.format(i=i)
            out[name] = Rule(name, tuple(n.format(i=i) for n in rule.hf), rule.transform)
    return out


def unsupported(field: str, value: Any, target: str, allowed: str, why: str = "") -> UnsupportedArchitecture:
    return UnsupportedArchitecture(f"{field}={value!r} cannot be represented as {target}{why}: allowed: {allowed}")


def get(hf: Dict[str, Any], key: str, default: Any = ..., *, source: str = "config.json") -> Any:
    """config.json's `key`; without a default, its absence is an error."""
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise DataError(f"{source} has no {key!r}, which a {hf.get('model_type')} config needs")
    return default


def check(hf: Dict[str, Any], key: str, default: Any, allowed: Sequence[Any], why: str = "") -> Any:
    """config.json's `key`, which must be one of `allowed` for megalm to compute the same."""
    value = hf.get(key, default)
    if value not in allowed:
        arch = hf.get("model_type")
        raise UnsupportedArchitecture(
            f"config.json: {key}={value!r} ({arch}) has no exact megalm equivalent{why}: allowed: "
            + ", ".join(repr(a) for a in allowed))
    return value
