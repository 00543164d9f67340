"""Decoder-only GPT / Llama-style language model, single-device code.

Blocks live in a ModuleDict keyed by their *global* layer index, and the embedding, final
norm and head may be absent (a pipeline stage holds only some of them), so parameter names
are the same at every parallel layout: `blocks.7.attn.qkv.weight` is layer 7 everywhere.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.models.family import Family, Part, Parts
from megalm.models.flops import flops_per_token
from megalm.models.losses import LMLoss
from megalm.models.layers import Block, Embedding, KVCache, build_norm, output_init_std, rope_tables


VOCAB_PARAMS = ("embed.tok.weight", "head.weight")  # rows = padded vocabulary


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Padded as Megatron pads (tp_plan pads further for tensor parallelism); the padding is
        # masked in the loss and never sampled, so results do not depend on it.
        V = cfg.padded_vocab_size
        h = cfg.hidden_size
        self.embed: Optional[Embedding] = Embedding(cfg, V)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm: Optional[nn.Module] = build_norm(cfg)
        self.head: Optional[nn.Linear] = nn.Linear(h, V, bias=False)
        self.criterion: Optional[nn.Module] = LMLoss(cfg.vocab_size)
        self.tie_weights()
        self._rope: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def tie_weights(self) -> None:
        """Share embedding and head weights (megalm.parallel.materialize keeps shared weights shared)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.tok.weight

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
                start: int = 0, part: Optional[Part] = None) -> torch.Tensor:
        """tokens (B, T) ids → logits (B, T, V); with labels (B, T) → mean cross-entropy loss.

        With `part` (a pipeline stage) only its layers run: a stage after the first takes the
        hidden states (B, T, h) in place of tokens, and one before the last returns them.
        """
        first, last = part is None or part.first, part is None or part.last
        x = self.embed(tokens, start) if first else tokens  # (B, T, h), or this rank's sequence shard under SP
        rope = self.rope(max(self.cfg.seq_length, start + (tokens.shape[1] if first else 0)), x.device)
        blocks = self.blocks.values() if part is None else [self.blocks[str(i)] for i in part.layers]
        for block in blocks:
            x = block(x, rope, cache, start)
        if not last:
            return x
        logits = self.head(self.norm(x))  # (B, T, V), or this rank's vocabulary shard under TP
        if labels is None:
            return logits
        return self.criterion(logits, labels, loss_mask)

    def loss(self, logits: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of the last stage's output on a batch (megalm.data.gpt_batch's keys)."""
        return self.criterion(logits, batch["labels"], batch.get("loss_mask"))


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
            # A tensor-parallel shard (tagged `tp_shard` by megalm.parallel) draws the full tensor
            # of its global name and keeps its own slice, so the weights do not depend on tp.
            shard = getattr(p, "tp_shard", None)
            shape = list(p.shape)
            if shard is not None:
                shape[shard.dim] *= shard.world
            # The last pipeline stage's copy of a tied embedding draws as the embedding does.
            key = getattr(p, "tied_copy_of", name)
            g = torch.Generator(device="cpu").manual_seed(_name_seed(seed, key))
            if key in VOCAB_PARAMS:  # draw the real rows only; padding rows (which vary with tp) are 0
                full = torch.zeros(shape, dtype=torch.float32)
                full[:cfg.vocab_size].normal_(0.0, std, generator=g)
            else:
                full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            p.copy_(shard.local(full) if shard is not None else full)


def tp_plan(cfg: ModelConfig, tp: int, sp: bool) -> List[Tuple[str, object]]:
    """Megatron's tensor-parallel layout of GPT (arXiv:1909.08053, sec. 3; sequence parallel:
    arXiv:2205.05198): in each block the fused QKV and the MLP's first linear are column-parallel
    (whole heads, a slice of the ffn), the attention output and the second linear row-parallel;
    the embedding, head and loss are vocabulary-parallel."""
    from megalm.parallel.tp_plan import (ColumnParallel, RowParallel, ScatterSequence, SequenceParallelParams,
                                         TPRandom, VocabParallel, VocabParallelLoss)
    rows = cfg.padded_vocab(tp)
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    learned_pos = cfg.position_embedding == "learned"
    plan: List[Tuple[str, object]] = []
    if sp and not learned_pos:
        # No position table to add after the lookup: reduce-scatter the partial sums straight
        # into sequence shards (half the bytes of an all-reduce) and drop out on the shard.
        plan += [("embed.tok", VocabParallel(rows, reduce="reduce_scatter")), ("embed.drop", TPRandom())]
    else:
        plan += [("embed.tok", VocabParallel(rows))]
        if sp:  # positions and dropout on the full (replicated) sequence, then keep this rank's part
            plan += [("embed", ScatterSequence())]
    plan += [
        ("blocks.*.attn.qkv", ColumnParallel(segments=(q, kv, kv))),
        ("blocks.*.attn.proj", RowParallel()),
        ("blocks.*.attn.core", TPRandom()),  # attention dropout over this rank's heads
        ("blocks.*.mlp.fc1", ColumnParallel(segments=(f, f) if cfg.activation == "swiglu" else None)),
        ("blocks.*.mlp.fc2", RowParallel()),
    ]
    if sp:
        plan += [(f"blocks.*.{name}", TPRandom()) for name in ("attn.dropout", "mlp.dropout")]
        plan += [(name, SequenceParallelParams()) for name in ("blocks.*.norm1", "blocks.*.norm2", "norm")]
    plan += [("head", ColumnParallel(rows=rows)), ("criterion", VocabParallelLoss(rows))]
    return plan


FAMILY = Family(
    name="gpt", build=GPT, init_weights=init_weights, flops_per_token=flops_per_token, tp_plan=tp_plan,
    parts=Parts(layers="blocks", first=("embed",), last=("norm", "head", "criterion"), selective=("attn.core",)),
    vocab_params=VOCAB_PARAMS, tied=(("head.weight", "embed.tok.weight"),))
