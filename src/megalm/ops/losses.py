"""The ignore label and the masked mean that every language-model loss shares."""

from __future__ import annotations

from typing import Optional

import torch

from megalm.ops.labels import IGNORE

__all__ = ["IGNORE", "masked_mean"]


def masked_mean(losses: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
