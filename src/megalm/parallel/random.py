"""Random streams for dropout under tensor parallelism (Megatron-LM, arXiv:1909.08053, sec. 3).

Replicated activations (the residual stream, and anything outside a tp region) must get the
same dropout mask on every tp rank, or the replicas drift apart; activations that are sharded
(attention probabilities of this rank's heads, sequence-parallel chunks of arXiv:2205.05198)
need a different mask per rank, or the shards would repeat one pattern. Two streams serve that:

    "shared"  seeded from seed                   identical on every tp rank
    "tp"      seeded from seed + 2718 + tp_rank  distinct per tp rank (Megatron's offset)

`with rng.fork("tp"): ...` swaps the stream's state into the device's default generator (so
F.dropout and friends draw from it unchanged), then saves the advanced state and puts the
caller's state back, leaving the outer sequence of draws exactly as if the block never ran.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

TP_SEED_OFFSET = 2718


class TPRNG:
    """The "shared" and "tp" generator states of one rank, for the CPU or one CUDA device."""

    STREAMS = ("shared", "tp")

    def __init__(self, seed: int, tp_rank: int, device="cpu"):
        if tp_rank < 0:
            raise ValueError(f"tp_rank={tp_rank} must be non-negative")
        self.seed, self.tp_rank = int(seed), int(tp_rank)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"TPRNG supports cpu and cuda devices, not {device}")
        self.device = device
        seeds = {"shared": self.seed, "tp": self.seed + TP_SEED_OFFSET + self.tp_rank}
        self._states: Dict[str, torch.Tensor] = {name: self._seeded_state(s) for name, s in seeds.items()}
        self._open: set = set()

    # The default generator of the device, read and written as a state tensor.
    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _seeded_state(self, seed: int) -> torch.Tensor:
        # Seed the default generator itself (so the state format is exactly the one _set takes),
        # then put the caller's state back; torch.manual_seed would also reseed every GPU.
        outer = self._get()
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            else:
                torch.default_generator.manual_seed(seed)
            return self._get()
        finally:
            self._set(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Run the block drawing from stream `name`; the outer state is restored afterwards."""
        if name not in self._states:
            raise ValueError(f"unknown RNG stream {name!r}; streams are {sorted(self._states)}")
        if name in self._open:
            # Re-entering would restart the stream from its saved state and repeat its draws.
            raise ValueError(f"RNG stream {name!r} is already forked in an enclosing block")
        outer = self._get()
        self._set(self._states[name])
        self._open.add(name)
        try:
            yield
        finally:
            self._open.discard(name)
            self._states[name] = self._get()
            self._set(outer)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "tp_rank": self.tp_rank,
                "states": {k: v.clone() for k, v in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        states = state["states"]
        if set(states) != set(self._states):
            raise ValueError(f"RNG state has streams {sorted(states)}; expected {sorted(self._states)}")
        self._states = {k: v.clone() for k, v in states.items()}
        self.seed, self.tp_rank = int(state.get("seed", self.seed)), int(state.get("tp_rank", self.tp_rank))
