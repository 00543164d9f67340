"""The random state a checkpoint carries: the streams every rank shares ("rng"), and each rank's own
(RANK_RNG), so that a resume at the same layout continues bitwise."""

from __future__ import annotations

import logging
from typing import Any, Dict

import torch
import torch.distributed as dist

log = logging.getLogger("megalm.checkpoint")
RANK_RNG = "rng_ranks"  # each rank's own random streams (see rank_streams)


def rng_state() -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _role(layout, tp_group) -> str:
    """The part of the model this rank runs: its streams carry over only to a rank in that role."""
    tp = f"{dist.get_rank(tp_group)}/{dist.get_world_size(tp_group)}" if tp_group is not None else "0/1"
    stage_ids, num_stages = (layout.stage_ids, layout.num_stages) if layout is not None else ([0], 1)
    return f"world {dist.get_world_size()} tp {tp} stages {stage_ids}/{num_stages}"


def rank_streams(layout, tp_group, metadata=None) -> Dict[str, Any]:
    """This rank's random streams under its own rank, {RANK_RNG: {"<rank>": ...}}; {} alone.

    "rng" holds one copy for all ranks (DCP keeps one of equal keys), but pipeline stages draw
    dropout for different layers, so their default generators part, and each tp rank has its
    own "tp" stream (megalm.parallel.random): each needs its own to resume bitwise. With
    `metadata` (loading), the template of what the checkpoint holds for this rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    rank = str(dist.get_rank())
    mine: Dict[str, Any] = {"role": _role(layout, tp_group), "default": rng_state()}
    tp_rng = layout.tp_rng if layout is not None else None
    if tp_rng is not None:
        mine["tp"] = tp_rng.state_dict()["states"]
    if metadata is not None:
        if f"{RANK_RNG}.{rank}.role" not in metadata:
            return {}
        mine = {part: {k: v for k, v in value.items() if f"{RANK_RNG}.{rank}.{part}.{k}" in metadata}
                if isinstance(value, dict) else value for part, value in mine.items()}
    return {RANK_RNG: {rank: mine}}


def set_rank_streams(layout, tp_group, state: Dict[str, Any]) -> None:
    """After "rng": this rank's own streams, if it runs the part of the model it ran at the save
    (a layout change keeps "rng" alone: tp ranks must share their default stream)."""
    for mine in state.get(RANK_RNG, {}).values():  # this rank's entry only
        if mine["role"] != _role(layout, tp_group):
            log.info("checkpoint written at another layout (%s, now %s): every rank starts from the shared "
                     "random state", mine["role"], _role(layout, tp_group))
            return
        set_rng_state(dict(state["rng"], **mine["default"]))
        tp_rng = layout.tp_rng if layout is not None else None
        if tp_rng is not None and set(mine.get("tp", {})) == set(tp_rng.STREAMS):
            tp_rng.load_state_dict({"states": mine["tp"]})
