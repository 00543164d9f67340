"""Tied weights and parameter tags kept across the swaps parallelize makes and the allocation after it."""

from __future__ import annotations

from typing import List

from torch import nn


def shared_names(model: nn.Module) -> List[List[str]]:
    """Names of the parameters that are one tensor (tied weights), grouped, in registration order."""
    by_id: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: List[List[str]]) -> None:
    """Share each group's parameters again (the first one's) where this rank holds several of them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in groups:
        held = [n for n in names if n in params]
        for name in held[1:]:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, params[held[0]])


def materialize(model: nn.Module, device) -> nn.Module:
    """Allocate a meta-device model on `device` (uninitialised), keeping ties and parameter tags.

    `to_empty` makes new Parameter objects when leaving the meta device, which drops attributes
    such as `tp_shard` / `sequence_parallel` and unties shared weights: restore both.
    """
    tags = {name: dict(vars(p)) for name, p in model.named_parameters(remove_duplicate=False)}
    tied = shared_names(model)
    model.to_empty(device=device)
    retie(model, tied)
    for name, p in model.named_parameters(remove_duplicate=False):
        p.__dict__.update(tags[name])
    return model
