"""Activation recomputation (arXiv:2205.05198): keep fewer activations, recompute them in backward.

- selective: only what the family names in each layer (Parts.selective: the attention core,
  softmax(QK^T)V and its dropout), whose activations grow with the square of the sequence while
  its FLOPs are a small share of the layer.
- full: whole layers (Transformer blocks) — every layer of a stage, or the first
  `recompute_num_layers` of each stage (Megatron's "uniform"/"block" trade-off: recompute only as much as memory needs).

torch.utils.checkpoint restores the default RNG for the replay, so dropout on replicated
activations draws the same masks. Dropout in tensor-parallel regions draws from the TPRNG
"tp" stream instead, which checkpoint does not know: `recompute_forward` saves that stream at the
forward and replays it, then puts the stream back where training had moved it. Inside a compiled
graph the tp forks draw from the default generator (megalm.parallel.styles.ForkRNG), whose draws
the compiled checkpoint replays itself, so the plain checkpoint serves there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalm.config import ParallelConfig
from megalm.family import Parts
from megalm.parallel.styles import ForkRNG


def recompute_forward(module: nn.Module, rng=None) -> None:
    """Make `module.forward` run under activation checkpointing, in place.

    The forward is replaced on the instance rather than the module wrapped, so parameter names
    (`blocks.3.attn.qkv.weight`) stay the same with and without recomputation.
    """
    inner = module.forward
    # Tensor parallelism wrapped the module before recomputation does (megalm.parallel.parallelize).
    forks = [m for m in module.modules() if isinstance(m, ForkRNG)] if rng is not None else []

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling() or not any(fork._draws() for fork in forks):
            # Nothing to replay by hand: a plain checkpoint, which torch.compile can also trace (the replay
            # bookkeeping below is a side effect its checkpoint operator refuses, so it breaks the graph there).
            # Inside a compiled graph the forks draw from the default generator (ForkRNG), which the compiled
            # checkpoint replays itself.
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        saved = rng.state_dict()
        calls = []

        def run(*a, **kw):
            if calls:  # the replay in backward: same tp-stream draws as the forward
                now = rng.state_dict()
                rng.load_state_dict(saved)
                try:
                    return inner(*a, **kw)
                finally:
                    rng.load_state_dict(now)
            calls.append(True)
            return inner(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(model: nn.Module, parts: Parts, cfg: ParallelConfig, layout) -> None:
    """Wrap layers (full) or the family's selective submodules of each layer (the attention core)
    of `model` in place, by its family's `parts`; `layout` (megalm.parallel.Layout) says which stages
    this rank runs and holds the tp streams."""
    layers = getattr(model, parts.layers)
    if cfg.recompute_activation:  # each dense MLP frees its activation output (megalm.models.layers.MLP)
        for layer in layers.values():
            for module in layer.modules():
                if hasattr(module, "recompute_activation"):
                    module.recompute_activation = True
    if cfg.recompute == "none":
        return
    if cfg.recompute == "selective":
        for layer in layers.values():
            for path in parts.selective:
                try:
                    inner = layer.get_submodule(path)
                except AttributeError:  # a layer kind without it (T5's encoder layers have no cross-attention)
                    continue
                # Inside a tp fork the checkpoint saves the fork's stream as the RNG it restores.
                recompute_forward(inner.inner if isinstance(inner, ForkRNG) else inner)
        return
    n = cfg.recompute_num_layers
    chosen = set()
    for r in (layout.stage_ranges[s] for s in layout.stage_ids):
        held = [i for i in r if str(i) in layers]
        chosen.update(held if n is None else held[:n])
    for key, layer in layers.items():
        if int(key) in chosen:
            recompute_forward(layer, layout.tp_rng)
