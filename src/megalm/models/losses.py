"""Losses shared by the model families: masked means of per-token cross-entropy, in fp32."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalm.ops.fused_loss import fused_masked_mean
from megalm.ops.losses import IGNORE, masked_mean


class LMLoss(nn.Module):
    """Mean next-token cross-entropy over the tokens the mask keeps, in fp32.

    Logit columns past the real vocabulary are padding and excluded from the softmax, so the
    loss does not depend on how far the embedding was padded. Tensor parallelism swaps this
    module for the vocab-parallel version, which computes the same number from vocab shards.
    """

    def __init__(self, vocab_size: int, label_smoothing: float = 0.0):
        super().__init__()
        self.vocab_size, self.label_smoothing = vocab_size, label_smoothing

    def per_token(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if logits.shape[-1] > self.vocab_size:
            logits = logits.masked_fill(
                torch.arange(logits.shape[-1], device=logits.device) >= self.vocab_size, float("-inf"))
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none", ignore_index=IGNORE,
                               label_smoothing=self.label_smoothing).view(labels.shape)

    def forward(self, logits, labels, loss_mask=None) -> torch.Tensor:
        return masked_mean(self.per_token(logits, labels), loss_mask if loss_mask is not None else labels != IGNORE)

    def from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    loss_mask: Optional[torch.Tensor] = None, *, chunk_tokens: int,
                    backward: str = "in_forward") -> torch.Tensor:
        """The same loss from the head's input (B, T, h) and weight (V, h), the logits made `chunk_tokens`
        tokens at a time and never whole, the gradients made in forward or recomputed in backward
        (`backward`; megalm.ops.fused_loss)."""
        return fused_masked_mean(hidden, weight, labels, loss_mask, backward=backward, vocab_size=self.vocab_size,
                                 chunk_tokens=chunk_tokens, label_smoothing=self.label_smoothing)

    @torch.no_grad()
    def correct(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Whether each label's logit is the largest of the real vocabulary's (a tie counts), as a
        float tensor of the labels' shape; IGNORE labels give 0."""
        logits = logits.float()[..., :self.vocab_size]
        target = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return ((target >= logits.max(-1).values) & (labels != IGNORE)).float()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
            vocab_size: Optional[int] = None) -> torch.Tensor:
    """Functional form of LMLoss (vocab_size None = no padding)."""
    return LMLoss(vocab_size or logits.shape[-1])(logits, labels, loss_mask)


def classification_loss(logits: torch.Tensor, label: torch.Tensor, regression: bool
                        ) -> "tuple[torch.Tensor, torch.Tensor]":
    """A fine-tuning head's loss and metrics (detached): cross-entropy over the classes (or the
    choices) with the accuracy, or for a regression (logits (B, 1), labels float) the mean squared
    error and no metric."""
    if regression:
        loss = F.mse_loss(logits.float()[:, 0], label.float())
        return loss, torch.zeros(0, device=loss.device)
    loss = F.cross_entropy(logits.float(), label.long())
    return loss, (logits.argmax(-1) == label).float().mean().detach()[None]


def fold_choices(tensors, num_choices: int):
    """Multiple choice: (B, C, ...) inputs -> (B * C, ...), each choice scored as one sequence; others unchanged."""
    return tuple(t.flatten(0, 1) if num_choices and t.dim() >= 3 else t for t in tensors)


def span_loss(logits: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """Extractive QA: logits (B, T, 2) of each token starting / ending the answer; the mean of the
    start and end cross-entropies over the sequence, and the fractions of starts and ends predicted right."""
    start_logits, end_logits = logits.float().unbind(-1)
    loss = (F.cross_entropy(start_logits, start.long()) + F.cross_entropy(end_logits, end.long())) / 2
    with torch.no_grad():
        metrics = torch.stack([(start_logits.argmax(-1) == start).float().mean(),
                               (end_logits.argmax(-1) == end).float().mean()])
    return loss, metrics
