"""Initialisation by global parameter name, shared by the model families.

Each parameter draws from a generator keyed by (seed, global parameter name), so the same seed
gives the same full model at any layout, whatever subset of parameters a rank holds.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.distributed.shards import shard_specs
from megalm.models.layers import output_init_std


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_by_name(model: nn.Module, cfg: ModelConfig, seed: int, vocab_params: Sequence[str],
                 scaled: Sequence[str] = ("attn.proj.weight", "mlp.fc2.weight", "experts.fc2.weight")) -> None:
    """Linear and embedding weights ~ N(0, init_std); residual output projections (names ending
    in `scaled`) use init_std / sqrt(2 * num_layers) as GPT-2 and Megatron do; norms get 1,
    biases 0. `vocab_params` draw their real vocabulary rows only (padding rows are 0)."""
    out_std = output_init_std(cfg)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            p.zero_()
        elif ".norm" in f".{name}" and p.ndim == 1:
            p.fill_(1.0)
        else:
            std = out_std if name.endswith(tuple(scaled)) else cfg.init_std
            # A tensor-parallel shard (tagged `tp_shard` by megalm.parallel) draws the full tensor
            # of its global name and keeps its own slice, so the weights do not depend on tp.
            specs = shard_specs(p)  # and an expert-parallel shard, the stack of every expert
            shape = list(p.shape)
            for shard in specs:
                shape[shard.dim] *= shard.world
            # The last pipeline stage's copy of a tied embedding draws as the embedding does.
            key = getattr(p, "tied_copy_of", name)
            g = torch.Generator(device="cpu").manual_seed(_name_seed(seed, key))
            if key in vocab_params:  # draw the real rows only; padding rows (which vary with tp) are 0
                full = torch.zeros(shape, dtype=torch.float32)
                full[:cfg.vocab_size].normal_(0.0, std, generator=g)
            else:
                full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            for shard in specs:
                full = shard.local(full)
            p.copy_(full)
