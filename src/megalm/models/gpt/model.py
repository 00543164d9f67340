"""Decoder-only GPT / Llama-style language model, single-device code.

Blocks live in a ModuleDict keyed by their *global* layer index, and the embedding, final
norm and head may be absent (a pipeline stage holds only some of them), so parameter names
are the same at every parallel layout: `blocks.7.attn.qkv.weight` is layer 7 everywhere.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.data.samples.gpt import GPTSamples
from megalm.family import Part
from megalm.models.flops import flops_per_token as transformer_flops
from megalm.models.init import init_by_name
from megalm.models.layers import Block, Embedding, KVCache, LMHead, build_norm, rope_tables
from megalm.models.losses import LMLoss, classification_loss, fold_choices
from megalm.models.moe import MoE

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
        if getattr(cfg, "num_experts", 0):  # a mixture of experts in place of each MLP
            for i, block in self.blocks.items():
                block.mlp = MoE(cfg, int(i))
        self.norm: Optional[nn.Module] = build_norm(cfg)
        self.head: Optional[nn.Linear] = LMHead(h, V, bias=False)
        self.criterion: Optional[nn.Module] = LMLoss(cfg.vocab_size)
        self.score: Optional[nn.Linear] = None
        self.metric_names: Tuple[str, ...] = ()
        """What `loss_and_metrics` reports beside the loss (the trainer logs them)."""
        self.new_heads: Tuple[str, ...] = ()
        """Modules a fine-tuning start initialises afresh: a pretrained checkpoint does not hold them."""
        if getattr(cfg, "fine_tuning_head", False):  # the score head at the last real token replaces the LM head
            self.head = self.criterion = None
            self.score = nn.Linear(h, cfg.num_labels or 1, bias=False)
            self.metric_names, self.new_heads = (() if cfg.num_labels == 1 else ("acc",)), ("score",)
        self.fused_loss = bool(getattr(cfg, "fused_loss", False)) and self.head is not None
        """model.fused_loss: in training the last stage returns the final-normed hidden states and `loss`
        runs the head fused with the cross-entropy; in eval mode the forward still returns logits."""
        self.tie_weights()
        self._rope: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def tie_weights(self) -> None:
        """Share embedding and head weights (megalm.parallel.materialize keeps shared weights shared)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.tok.weight

    def rope(self, length: int, device: torch.device):
        if self.cfg.position_embedding != "rope":
            return None
        if torch.compiler.is_compiling():
            # Traced into the graph: a cache filled on the first call would fail the compiled graph's guards on
            # the second and compile the whole forward again.
            return rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device)
        key = (device, length)
        if key not in self._rope:
            # Tables are recomputed rather than stored as buffers so meta-device init needs no fix-up.
            self._rope = {key: rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device)}
        return self._rope[key]

    def forward(self, tokens: torch.Tensor, *packed: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                start: int = 0, part: Optional[Part] = None, positions: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        """tokens (B, T) ids → logits (B, T, V); with labels (B, T) → mean cross-entropy loss. With a
        fine-tuning head, the score head's (B, T, num_labels or 1) at every position (`predictions`
        reads the last real token's); multiple choice takes tokens (B, C, T).

        `packed` = (position_ids, segment_ids), each (B, T), for sequences of several packed
        examples: positions restart and attention stays inside each example (segment), as
        Megatron's --reset-position-ids and --reset-attention-mask do.
        `positions` (B, T) and `attention_mask` (B, 1, T, S) bool: each row's own positions and the keys
        its queries see, for a batch whose rows stand at different points of their sequences (the
        serving engine's cache slots: megalm.serve.engine).
        With `part` (a pipeline stage) only its layers run: a stage after the first takes the
        hidden states (B, T, h) in place of tokens (and `packed` after them), and one before the
        last returns them (with `packed`).
        With model.fused_loss, in training mode and without labels the last stage returns the
        final-normed hidden states (B, T, h) (a sequence shard under SP), which `loss` turns into
        the loss without making the logits whole; in eval mode (generation, evaluation) logits.
        """
        if packed and len(packed) != 2:
            raise TypeError(f"GPT.forward got {len(packed) + 1} positional inputs: after tokens it takes "
                            "(position_ids, segment_ids) of packed examples; pass labels and loss_mask by keyword")
        first, last = part is None or part.first, part is None or part.last
        if first and self.cfg.num_choices:
            tokens, = fold_choices((tokens,), self.cfg.num_choices)
        positions, segments = packed if packed else (positions, None)
        if first:
            # Under context parallelism (megalm.parallel.context) the embedding and the attention layers are
            # given the positions of this rank's two chunks of the sequence where `positions` is None.
            x = self.embed(tokens, start, positions)  # (B, T, h), or a sequence shard under SP
        else:
            x = tokens
        rope = self.rope(max(self.cfg.seq_length, start + (tokens.shape[1] if first else 0)), x.device)
        mask = packed_attention_mask(segments) if segments is not None else attention_mask
        blocks = self.blocks.values() if part is None else [self.blocks[str(i)] for i in part.layers]
        for block in blocks:
            x = block(x, rope, cache, start, mask, positions) if positions is not None else block(x, rope, cache, start)
        if not last:
            return (x, *packed) if packed else x
        if self.score is not None:
            return self.score(self.norm(x))
        x = self.norm(x)
        if labels is not None:
            return self._lm_loss(x if self.fused_loss else self.head(x), labels, loss_mask, hidden=self.fused_loss)
        if self.fused_loss and self.training:
            return x  # `loss` applies the head
        return self.head(x)  # (B, T, V), or this rank's vocabulary shard under TP

    def loss(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of the last stage's output (logits; with model.fused_loss in training, the
        final-normed hidden states) on a batch (megalm.data.gpt_batch's keys)."""
        if self.score is not None:
            return self.loss_and_metrics(output, batch)[0]
        return self._lm_loss(output, batch["labels"], batch.get("loss_mask"), hidden=self.fused_loss and self.training)

    def _lm_loss(self, output: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                 hidden: bool) -> torch.Tensor:
        """The criterion on logits, or (hidden) on the head's input through the head's own call, so that
        hooks on the head (ZeRO-3's gather) fire around the fused matmuls."""
        if not hidden:
            return self.criterion(output, labels, loss_mask)
        fuse = functools.partial(self.criterion.from_hidden, labels=labels, loss_mask=loss_mask,
                                 chunk_tokens=self.cfg.loss_chunk_tokens,
                                 backward=self.cfg.fused_loss_backward)
        return self.head(output, fuse=fuse)

    def loss_and_metrics(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]):
        """A fine-tuning head's loss (cross-entropy, or MSE for a regression) and accuracy."""
        return classification_loss(self.predictions(output, batch), batch["label"], regression=self.cfg.num_labels == 1)

    def predictions(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The score head's output at each sequence's last real token (batch["last"]): (B, num_labels),
        or (B, C) scores of multiple choice."""
        last = batch["last"].reshape(-1)
        scores = output[torch.arange(len(last), device=output.device), last]
        return scores.view(-1, self.cfg.num_choices) if self.cfg.num_choices else scores


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) example ids → (B, 1, T, T) bool: query t sees keys s <= t of its own example."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, :, None] == segments[:, None, :])[:, None] & causal


def flops_per_token(cfg: ModelConfig, seq_length: Optional[int] = None) -> float:
    """megalm.models.flops's definition; a fine-tuning head's h x (num_labels or 1) score in place of the LM head."""
    if getattr(cfg, "fine_tuning_head", False):
        return transformer_flops(cfg, seq_length) - 6.0 * cfg.hidden_size * (cfg.padded_vocab_size - (cfg.num_labels or 1))
    return transformer_flops(cfg, seq_length)


def samples(cfg: ModelConfig):
    """GPT's samples: packed token sequences, or classification examples (megalm.data.samples.gpt.GPTSamples)."""
    return GPTSamples(cfg)


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every parameter from (seed, global name) (megalm.models.init): N(0, init_std), residual
    output projections (attn.proj, mlp.fc2) init_std / sqrt(2 * num_layers), norms 1, biases 0."""
    init_by_name(model, cfg, seed, VOCAB_PARAMS)


