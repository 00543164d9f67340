"""Decoder-only GPT / Llama-style language model, single-device code.

Blocks live in a ModuleDict keyed by their *global* layer index, and the embedding, final
norm and head may be absent (a pipeline stage holds only some of them), so parameter names
are the same at every parallel layout: `blocks.7.attn.qkv.weight` is layer 7 everywhere.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.models.layers import Block, KVCache, build_norm, output_init_std, rope_tables


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        V, h = cfg.padded_vocab_size, cfg.hidden_size
        self.embed: Optional[nn.Embedding] = nn.Embedding(V, h)
        self.pos_embed: Optional[nn.Embedding] = (
            nn.Embedding(cfg.seq_length, h) if cfg.position_embedding == "learned" else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm: Optional[nn.Module] = build_norm(cfg)
        self.head: Optional[nn.Linear] = nn.Linear(h, V, bias=False)
        self.tie_weights()
        self._rope: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def tie_weights(self) -> None:
        """Share embedding and head weights; call again after to_empty(), which unties them."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight

    def rope(self, length: int, device: torch.device):
        if self.cfg.position_embedding != "rope":
            return None
        key = (device, length)
        if key not in self._rope:
            # Tables are recomputed rather than stored as buffers so meta-device init needs no fix-up.
            self._rope = {key: rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device)}
        return self._rope[key]

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                start: int = 0) -> torch.Tensor:
        """tokens (B, T) ids → logits (B, T, V); with labels (B, T) → mean cross-entropy loss."""
        B, T = tokens.shape
        x = self.embed(tokens)  # (B, T, h)
        if self.pos_embed is not None:
            if start + T > self.cfg.seq_length:
                raise ValueError(f"position {start + T} exceeds model.seq_length={self.cfg.seq_length}")
            x = x + self.pos_embed(torch.arange(start, start + T, device=tokens.device))
        x = self.drop(x)
        rope = self.rope(start + T, tokens.device)
        for block in self.blocks.values():
            x = block(x, rope, cache, start)
        logits = self.head(self.norm(x))  # (B, T, V)
        if labels is None:
            return logits
        return lm_loss(logits, labels, loss_mask)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens the mask keeps (all when no mask), in fp32."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.flatten().float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter from a generator keyed by (seed, global parameter name).

    The same seed gives the same full model at any layout, whatever subset of parameters a rank
    holds. Linear and embedding weights ~ N(0, init_std); residual output projections
    (attn.proj, mlp.fc2) use init_std / sqrt(2 * num_layers) as GPT-2 does; norms get 1, biases 0.
    """
    out_std = output_init_std(cfg)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            p.zero_()
        elif ".norm" in f".{name}" and p.ndim == 1:
            p.fill_(1.0)
        else:
            std = out_std if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else cfg.init_std
            g = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
            full = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            p.copy_(full)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> GPT:
    """The plain single-device model, its parameters allocated on `device` but not yet initialised.

    Pass device="meta" to build a model that takes no memory (for planning and for parallelize
    to shard before allocating).
    """
    with torch.device(device):
        return GPT(cfg)
