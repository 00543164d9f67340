"""The checkpoint's state dict as each rank holds it: blocks of global tensors, no gathering.

Keys and stored shapes are the same at every layout: the model's parameters under their global
names (`blocks.7.attn.qkv.weight`; a single process's tied head under `head.weight` too), the
optimizer state flattened per parameter (`state.<name>.exp_avg`, `state.<name>.step`,
`param_groups.<name>.lr`), vocabulary matrices with only the real rows. Each tensor entry is a
`Chunked` of views of this rank's memory (megalm.training.checkpoint.chunks), so a save writes
what the rank holds and a load fills the rank's tensors in place, whatever layout wrote the file:

- tensor parallel: the rank's shard, placed by its TPShard;
- ZeRO 1/2: full weights (replicated over dp, written once), optimizer state of the rank's flat
  range of each parameter; ZeRO 3: the weights' flat ranges too;
- main parameters (trainer.mixed_precision=main_params): the fp32 main parameters under the model's
  keys, in the flat ranges the rank holds, so a checkpoint keeps fp32 weights whatever the weights'
  dtype in training, and loads across precisions and modes;
- pipeline: the stage's own layers; a tied copy of the embedding on the last stage writes its
  weight as `head.weight` and its optimizer state under the embedding's name, as a single process
  does (the two copies take the same update, so both stages write the same blocks, kept once).

Replicated blocks (the same offsets on several ranks) are deduplicated by DCP's planner.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from megalm.models.registry import family_of
from megalm.parallel.optim_state import create_state
from megalm.training.checkpoint.chunks import Chunked, place


def _vocab_rows(model: nn.Module, name: str, p: nn.Parameter) -> Optional[int]:
    key = getattr(p, "tied_copy_of", None) or name
    vocab = family_of(model.cfg.arch).vocab_params
    if key in vocab or name in vocab:
        return model.cfg.vocab_size
    return None


def _chunked(model: nn.Module, name: str, p: nn.Parameter, flat: torch.Tensor, start: int, stop: int) -> Chunked:
    return Chunked(*place(flat, p.shape, start, stop, getattr(p, "tp_shard", None), _vocab_rows(model, name, p),
                          experts=getattr(p, "ep_shard", None)))


def _shards_of(data_parallel) -> Dict[nn.Parameter, Any]:
    return {s.param: s for s in data_parallel.shards} if data_parallel is not None and data_parallel.has_shards else {}


def _weights_in_shards(data_parallel) -> bool:
    """The rank's weights to save and load are its shards: ZeRO-3 (the parameters' storage is freed
    between uses), or main parameters (the fp32 values, not the rounded weights)."""
    return data_parallel is not None and (data_parallel.zero_stage == 3 or data_parallel.main_params)


def model_entries(model: nn.Module, data_parallel=None) -> Dict[str, Chunked]:
    """Global name → this rank's blocks of every parameter (under ZeRO-3 or with main parameters: of its
    flat shards)."""
    in_shards = _weights_in_shards(data_parallel)
    shards = _shards_of(data_parallel) if in_shards else {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if in_shards and p.requires_grad:
            s = shards.get(p)
            out[name] = (_chunked(model, name, p, s.tensor.detach(), s.start, s.stop) if s is not None
                         else _chunked(model, name, p, p.new_empty(0), 0, 0))
        else:
            out[name] = _chunked(model, name, p, p.detach().view(-1), 0, p.numel())
    return out


def _stored_name(names: Dict[nn.Parameter, str], p: nn.Parameter) -> str:
    return getattr(p, "tied_copy_of", None) or names[p]


def optim_entries(model: nn.Module, optimizer, data_parallel=None) -> Dict[str, Any]:
    """Flattened optimizer state: tensors shaped like a parameter as Chunked, the rest plain."""
    names = {p: n for n, p in model.named_parameters()}
    out: Dict[str, Any] = {}
    if hasattr(optimizer, "inner"):  # ZeRO: state lives on the rank's flat shards
        optimizer._ensure_state()
        inner, holder = optimizer.inner, {s.tensor: s for s in data_parallel.shards}
        for group in inner.param_groups:
            for t in group["params"]:
                s = holder[t]
                name = _stored_name(names, s.param)
                _state_entries(out, model, name, s.param, inner.state[t], s.start, s.stop)
                _group_entries(out, name, group)
        return out
    create_state(optimizer, [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad])
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _stored_name(names, p)
            _state_entries(out, model, name, p, optimizer.state[p], 0, p.numel())
            _group_entries(out, name, group)
    return out


def _state_entries(out, model, name, p, state, start, stop) -> None:
    for key, v in state.items():
        if torch.is_tensor(v) and v.dim() > 0:  # moments: a view of the state's own memory
            out[f"state.{name}.{key}"] = _chunked(model, name, p, v.view(-1), start, stop)
        else:  # Adam's step (a scalar tensor) and the like: replicated
            out[f"state.{name}.{key}"] = v


def _group_entries(out, name, group) -> None:
    for k, v in group.items():
        if k != "params":
            out[f"param_groups.{name}.{k}"] = v


def zero_vocab_padding(model: nn.Module, optimizer=None, data_parallel=None) -> None:
    """Zero the vocabulary matrices (and their optimizer moments) of this rank before a load.

    A checkpoint holds only their real rows, so the load fills those and the padding rows stay
    0, as init_weights makes them (they are never looked up and masked in the loss)."""
    vocab = {p for name, p in model.named_parameters(remove_duplicate=False) if _vocab_rows(model, name, p)}
    with torch.no_grad():
        if _weights_in_shards(data_parallel):
            for s in data_parallel.shards:
                if s.param in vocab:
                    s.tensor.zero_()
        else:
            for p in vocab:
                p.zero_()
        if optimizer is None:
            return
        if hasattr(optimizer, "inner"):
            optimizer._ensure_state()
            states = [optimizer.inner.state[s.tensor] for s in data_parallel.shards if s.param in vocab]
        else:
            states = [optimizer.state[p] for p in vocab if p in optimizer.state]
        for state in states:
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    v.zero_()
