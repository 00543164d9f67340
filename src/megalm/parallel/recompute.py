"""Activation recomputation (arXiv:2205.05198): keep fewer activations, recompute them in backward.

- selective: only the attention core (softmax(QK^T)V and its dropout), whose activations grow
  with the square of the sequence while its FLOPs are a small share of the layer.
- full: whole Transformer blocks — every block of a stage, or the first `recompute_num_layers`
  of each stage (Megatron's "uniform"/"block" trade-off: recompute only as much as memory needs).

torch.utils.checkpoint restores the default RNG for the replay, so dropout on replicated
activations draws the same masks. Dropout in tensor-parallel regions draws from the TPRNG
"tp" stream instead, which checkpoint does not know: `Recompute` saves that stream at the
forward and replays it, then puts the stream back where training had moved it.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.utils.checkpoint import checkpoint

from megalm.config import ParallelConfig


def recompute_forward(module: nn.Module, rng=None) -> None:
    """Make `module.forward` run under activation checkpointing, in place.

    The forward is replaced on the instance rather than the module wrapped, so parameter names
    (`blocks.3.attn.qkv.weight`) stay the same with and without recomputation.
    """
    inner = module.forward

    def forward(*args):
        saved = rng.state_dict() if rng is not None else None
        calls = []

        def run(*a):
            if calls and saved is not None:  # the replay in backward: same tp-stream draws as the forward
                now = rng.state_dict()
                rng.load_state_dict(saved)
                try:
                    return inner(*a)
                finally:
                    rng.load_state_dict(now)
            calls.append(True)
            return inner(*a)

        return checkpoint(run, *args, use_reentrant=False)

    module.forward = forward


def apply_recompute(model: nn.Module, cfg: ParallelConfig, stage_ranges: Optional[list] = None) -> None:
    """Wrap blocks (full) or attention cores (selective) of `model` in place."""
    if cfg.recompute == "none":
        return
    keys = list(model.blocks.keys())
    if cfg.recompute == "selective":
        for key in keys:
            core = model.blocks[key].attn.core
            # Inside a tp fork the checkpoint saves the fork's stream as the RNG it restores.
            recompute_forward(core.inner if hasattr(core, "inner") else core)
        return
    if stage_ranges is None:
        stage_ranges = [range(int(keys[0]), int(keys[-1]) + 1)] if keys else []
    n = cfg.recompute_num_layers
    chosen = set()
    for r in stage_ranges:
        layers = [i for i in r if str(i) in model.blocks]
        chosen.update(layers if n is None else layers[:n])
    for key in keys:
        if int(key) in chosen:
            recompute_forward(model.blocks[key], getattr(model, "tp_rng", None))
