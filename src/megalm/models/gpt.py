"""Decoder-only GPT / Llama-style language model, single-device code.

Blocks live in a ModuleDict keyed by their *global* layer index, and the embedding, final
norm and head may be absent (a pipeline stage holds only some of them), so parameter names
are the same at every parallel layout: `blocks.7.attn.qkv.weight` is layer 7 everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.errors import ConfigError
from megalm.models.family import Family, Part, Parts
from megalm.models.flops import flops_per_token
from megalm.models.losses import LMLoss
from megalm.models.init import init_by_name
from megalm.models.layers import Block, Embedding, KVCache, build_norm, rope_tables


VOCAB_PARAMS = ("embed.tok.weight", "head.weight")  # rows = padded vocabulary


@dataclass
class GPTConfig(ModelConfig):
    """GPT's model schema: the shared transformer fields and its own."""
    arch: str = "gpt"
    """gpt (decoder-only; GPT-2/3 and Llama-style presets)."""
    position_embedding: str = "learned"
    """learned | rope."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""


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

    def forward(self, tokens: torch.Tensor, *packed: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                start: int = 0, part: Optional[Part] = None):
        """tokens (B, T) ids → logits (B, T, V); with labels (B, T) → mean cross-entropy loss.

        `packed` = (position_ids, segment_ids), each (B, T), for sequences of several packed
        examples: positions restart and attention stays inside each example (segment), as
        Megatron's --reset-position-ids and --reset-attention-mask do.
        With `part` (a pipeline stage) only its layers run: a stage after the first takes the
        hidden states (B, T, h) in place of tokens (and `packed` after them), and one before the
        last returns them (with `packed`).
        """
        if packed and len(packed) != 2:
            raise TypeError(f"GPT.forward got {len(packed) + 1} positional inputs: after tokens it takes "
                            "(position_ids, segment_ids) of packed examples; pass labels and loss_mask by keyword")
        first, last = part is None or part.first, part is None or part.last
        positions, segments = packed if packed else (None, None)
        x = self.embed(tokens, start, positions) if first else tokens  # (B, T, h), or a sequence shard under SP
        rope = self.rope(max(self.cfg.seq_length, start + (tokens.shape[1] if first else 0)), x.device)
        mask = packed_attention_mask(segments) if segments is not None else None
        blocks = self.blocks.values() if part is None else [self.blocks[str(i)] for i in part.layers]
        for block in blocks:
            x = block(x, rope, cache, start, mask, positions) if packed else block(x, rope, cache, start)
        if not last:
            return (x, *packed) if packed else x
        logits = self.head(self.norm(x))  # (B, T, V), or this rank's vocabulary shard under TP
        if labels is None:
            return logits
        return self.criterion(logits, labels, loss_mask)

    def loss(self, logits: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of the last stage's output on a batch (megalm.data.gpt_batch's keys)."""
        return self.criterion(logits, batch["labels"], batch.get("loss_mask"))


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) example ids → (B, 1, T, T) bool: query t sees keys s <= t of its own example."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, :, None] == segments[:, None, :])[:, None] & causal


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every parameter from (seed, global name) (megalm.models.init): N(0, init_std), residual
    output projections (attn.proj, mlp.fc2) init_std / sqrt(2 * num_layers), norms 1, biases 0."""
    init_by_name(model, cfg, seed, VOCAB_PARAMS)


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


def validate(cfg, world_size: int) -> None:
    m = cfg.model
    if cfg.data.source == "classification":
        raise ConfigError("data.source=classification fine-tunes BERT's classifier (model=bert_*); GPT has no "
                          "classification head yet: fine-tune it with data=sft, or score it with megalm.evaluate choice")
    if m.head_dim % 2 and m.position_embedding == "rope":
        raise ConfigError(f"rope needs an even head dim; hidden_size / heads = {m.head_dim}")


FAMILY = Family(
    name="gpt", config=GPTConfig, build=GPT, init_weights=init_weights, validate=validate, flops_per_token=flops_per_token, tp_plan=tp_plan,
    parts=Parts(layers="blocks", first=("embed",), last=("norm", "head", "criterion"), selective=("attn.core",)),
    hf="megalm.models.gpt_hf", vocab_params=VOCAB_PARAMS, tied=(("head.weight", "embed.tok.weight"),),
    optional_inputs=("position_ids", "segment_ids"))
