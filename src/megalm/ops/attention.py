"""Attention's kernel as separate ops, and dropout drawn from a given source of random numbers.

`unfused_attention` is softmax(q k^T / sqrt(hd)) v written out (Megatron's unfused core attention with
the softmax in fp32), which a compiled graph fuses on CPU where SDPA cannot (`attention_backend` says
when it runs); `dropout_with` takes its random numbers from a caller's source, which the tensor-parallel
code hands in for a rank's own stream inside a compiled graph.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def attention_backend(choice: str, device_type: str, dtype: torch.dtype, compiling: bool) -> str:
    """The attention kernel `model.attention_backend` = `choice` runs: sdpa or unfused as named; auto picks
    unfused where it was measured faster, inside a compiled graph on CPU in bf16 / fp16 (docs/PERFORMANCE.md:
    inductor fuses its mask and softmax, and its matmuls run in the low precision, where CPU's flash
    kernel gained nothing over fp32), and sdpa everywhere else."""
    if choice != "auto":
        return choice
    low = dtype in (torch.bfloat16, torch.float16)
    return "unfused" if compiling and device_type == "cpu" and low else "sdpa"


Uniform = Callable[[torch.Size, torch.device], torch.Tensor]
"""A source of dropout's random numbers: uniform(shape, device) gives numbers in [0, 1) of that shape."""


def dropout_with(x: torch.Tensor, p: float, uniform: Uniform) -> torch.Tensor:
    """Dropout of `x` with probability `p` (kept elements scaled by 1 / (1 - p), as F.dropout), its mask
    drawn from `uniform`: an element is kept where its number is at least p."""
    if p >= 1:
        return x * 0
    keep = uniform(x.shape, x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


CAUSAL_SPLIT_MIN = 256
"""Causal self-attention of at least this many tokens runs unfused as two query halves (each half >= 128
tokens: quarters measured slower than halves at 256, the matmuls too small)."""


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      causal: bool = False, dropout_p: float = 0.0, uniform: Optional[Uniform] = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + mask) v as separate ops, SDPA's arguments and result: the scores in q's
    dtype, the softmax in fp32, its probabilities cast back to q's dtype for the second matmul (Megatron's
    unfused core attention with the softmax in fp32). `mask`: bool (True: attend) or additive; `causal`:
    query t of T sees keys up to S - T + t of S. Dropout on the probabilities draws from the default
    generator, or from `uniform` when given (`dropout_with`). Causal self-attention of CAUSAL_SPLIT_MIN
    tokens or more, without dropout, is computed as two query halves, the first against the first half of
    the keys: the same result with a quarter fewer scores."""
    T, S = q.shape[-2], k.shape[-2]
    if causal and mask is None and dropout_p == 0 and T == S >= CAUSAL_SPLIT_MIN and T % 2 == 0:
        # The first half of the queries sees only the first half of the keys: the two halves apart skip the
        # quarter of the scores the mask would discard (docs/PERFORMANCE.md: 1.04-1.06x a compiled bf16 step).
        h = T // 2
        return torch.cat([unfused_attention(q[..., :h, :], k[..., :h, :], v[..., :h, :], causal=True),
                          unfused_attention(q[..., h:, :], k, v, causal=True)], dim=-2)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p) if uniform is None else dropout_with(probs, dropout_p, uniform)
    return torch.matmul(probs, v)
