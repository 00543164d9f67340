"""What one layer's attention keeps for backward, for one micro-batch on one rank: SDPA's fused kernels or its math
path (`_attention_core`), the unfused attention (`_unfused_core`), context parallelism's ring attention
(`ring_attention_bytes`) and BERT's key mask (`_key_mask`). megalm.plan.activations describes the method."""

from __future__ import annotations

from megalm.ops.attention import CAUSAL_SPLIT_MIN
from megalm.plan.shapes import FP32, _Shape


def _attention_core(d: _Shape, selective: bool) -> float:
    """The attention core's saves per token (this rank's heads, so / t), q, k, v from the fused qkv linear.

    Without RoPE q, k, v are views of the qkv output, so its storage (h + 2kv) is what they keep. RoPE
    makes new q and k (h and kv), while v stays a view of qkv. Grouped-query attention repeats k and v
    to the query heads (two new h tensors) before SDPA. Fused SDPA then keeps q, k, v, its output (h)
    and the fp32 log-sum-exp (a values); its output follows q's layout, so for RoPE's contiguous q the
    (B, T, h) input of the output projection is a copy (h), for a view of qkv it is the same storage.
    The math path (CPU, attention dropout) keeps scaled q and k and v (3h, fp32 even under autocast), the
    projection's input (h) and the softmax, dropout noise and dropped probabilities (a*s fp32 each:
    Korthikanti's 5as/h term, there 2 + 1 + 2 bytes).
    With selective recomputation the core keeps only its inputs; the projection's input stays (h)."""
    h, kv = d.h, d.kv
    qkv = h + 2 * kv
    inputs = qkv if not d.rope else h + kv + qkv
    if selective:
        return (inputs + h) * d.e / d.t
    if d.unfused:
        return _unfused_core(d)
    if not d.fused_attention:  # CPU's math path computes in fp32 under autocast too, then casts its output back
        return (3 * h * FP32 + h * d.e + d.a * d.s * 3 * FP32) / d.t
    if d.groups > 1:  # k, v repeated: q (a view of qkv, or RoPE's), k_rep, v_rep
        kept = (qkv if not d.rope else h) + 2 * h
    else:
        kept = inputs
    out = h + (h if d.rope else 0)  # SDPA's output, and the projection's copy of it after RoPE
    return (kept + out) * d.e / d.t + d.a * FP32 / d.t


def _unfused_core(d: _Shape) -> float:
    """The unfused attention's saves per token (megalm.models.layers.unfused_attention; model.attention_backend),
    Korthikanti's 5as/h term in megalm's dtypes. With H = a / t heads on the rank:
    - the first matmul's operands as torch.matmul folds them to 3-D: q is RoPE's contiguous output (h), or a
      view of the qkv output, folded by a copy (h) or in place (the qkv storage) per `_reshape_copies`; k^T
      folds in place when k is contiguous (RoPE's output: kv; the grouped-query repeat: h), else like q;
    - the softmax's fp32 output (H s values); under autocast also its cast to the compute dtype, the second
      matmul's input; with attention dropout its noise (CPU: the compute dtype) and the dropped probabilities;
    - the second matmul's v: the grouped-query repeat (h), or a view of qkv, folded as q is;
    - the masked_fill's bool mask: causal, an s x s one a layer (s / b bytes a token); BERT's key mask, one a token;
    - the output projection's input, a copy of the heads' output merged back (h).
    Causal self-attention of CAUSAL_SPLIT_MIN tokens or more without dropout runs as two query halves, the first
    against the first half of the keys: scores and masks are 3/4 of the whole, and k and v, where the fold copies
    them, are copied once more for the first half (kv / 2 each)."""
    h, kv, e, t = d.h, d.kv, d.e, d.t
    grouped = d.groups > 1
    split = not d.bert and d.attention_dropout == 0 and d.s >= CAUSAL_SPLIT_MIN and d.s % 2 == 0
    own = (h if d.rope else None, h if grouped else kv if d.rope else None, h if grouped else None)  # q, k, v
    kept = sum(w for w in own if w is not None)
    views = [width for width, w in zip((h, kv, kv), own) if w is None]  # views of the qkv output
    if views:
        copies = _reshape_copies(d.b, d.a // t, False)
        kept += sum(views) if copies else h + 2 * kv
        if copies and split:  # k's and v's first-half copies, where they are views
            kept += sum(kv for w in own[1:] if w is None) / 2
    probs = d.a * d.s / t * (0.75 if split else 1.0)
    if d.attention_dropout > 0:
        scores = probs * (FP32 + d.mask(d.e) + d.e)
    else:
        scores = probs * (FP32 + (d.e if d.autocast else 0))
    masks = (0.75 if split else 1.0) * d.s / d.b if not d.bert else 1.0
    return (kept + h) * e / t + scores + masks


def _reshape_copies(batch: int, heads: int, merged: bool) -> bool:
    """Whether torch.matmul's fold of a (batch, heads, rows, cols) operand into (batch * heads, rows, cols)
    for its bmm copies it: only when neither dimension is 1 and their strides do not merge."""
    return batch > 1 and heads > 1 and not merged


def ring_attention_bytes(d: _Shape, selective: bool = False) -> float:
    """What one layer's attention keeps for one micro-batch on one rank under context parallelism, in bytes
    (megalm.parallel.context.RingAttentionCore, in place of the layer's SDPA core; not per token: the scores
    grow with the square of the chunk). With s = seq_length / cp tokens on the rank, its two query chunks of
    c = s / 2, Hq = a / t query heads and Hk = kv_heads / t key / value heads:

    The ring runs `_partial` for every (query chunk, key chunk) pair the causal mask does not hide: query chunk
    qc sees key chunks kc < qc whole and kc == qc causally, so cp rank r's chunks r and 2cp - 1 - r see r + 1
    and 2cp - r key chunks, P = 2cp + 1 pairs on every rank (two of them diagonal). Each pair keeps full
    c x c blocks: its scores (logsumexp's input) and probabilities (exp's output), with attention dropout also
    the dropout's noise (CPU: a tensor of the scores' dtype) or mask (CUDA: a bool) and the dropped
    probabilities (the second matmul's input); a diagonal pair also its c x c bool mask (masked_fill). Each
    pair keeps its log-sum-exp (b, Hq, c, 1), and both matmuls their operands (see below). `_merge` folds a
    chunk's n pairs in with n - 1 merges, each keeping the running output and the new part (b, Hq, c, hd),
    the two exp factors (b, Hq, c, 1) and, after its first, the running log-sum-exp: over a rank's two chunks
    2(2cp - 1) outputs and 8cp - 3 log-sum-exp sized tensors on cp rank 0 (chunk 0 sees one key chunk, no
    merge); any other cp rank keeps one log-sum-exp sized tensor fewer (rank 0's is reported: the largest).

    The matmuls' operands, by precision:
    - fp32: q's slice of each pair is folded in place when q is RoPE's contiguous output (then q's storage,
      (b, s, Hq hd), is kept) or when batch or heads is 1 (then the qkv output's, (b, s, (Hq + 2 Hk) hd),
      which q views), else copied a pair (b, Hq, c, hd). Grouped-query attention repeats every block's k and
      v to Hq heads, which fold in place: the whole sequence's repeated k and v, 2 (b, Hq, cp s, hd). Without
      it k and v are halves of the (b, 2 Hk, s, hd) block that travels, copied a pair (b, Hk, c, hd) each,
      or, with batch or heads 1, folded in place: every block the rank saw, the whole sequence's k and v.
    - autocast (bf16, fp16): the ring runs with autocast off, so `_partial`'s casts of the compute-dtype
      slices to fp32 are copies: each pair keeps fp32 copies of its q (b, Hq, c, hd) and of its k and v
      ((b, Hq, c, hd) each with grouped-query attention, whose repeat comes first; else (b, Hk, c, hd)),
      and no block. Everything else is as in fp32.
    Then, outside the core: the output (the chunks' concatenation, (b, Hq, s, hd)) reaches the output
    projection as a (b, s, h / t) copy in the compute dtype, which it keeps; RoPE indexes its tables at the
    rank's positions, so each layer keeps its own cos and sin (s, hd / 2) fp32 (without cp they are views of
    the cached tables). RoPE's k, the block and v are not kept (concatenation saves nothing).

    With selective recomputation the core keeps only its inputs q, k and v (as `_attention_core`); the
    projection's input and the RoPE tables stay."""
    B, s, hd, cp, e = d.b, d.s, d.hd, d.cp, d.e
    hq, hk = d.a // d.t, d.a // d.groups // d.t
    c = s // 2
    tables = s * hd * FP32 if d.rope else 0
    proj_in = B * s * d.h * e / d.t
    if selective:
        qkv = d.h + 2 * d.kv
        inputs = qkv if not d.rope else d.h + d.kv + qkv
        return B * s * inputs * e / d.t + proj_in + tables
    pairs, merges, stats = 2 * cp + 1, 2 * cp - 1, 8 * cp - 3
    chunk = B * hq * c * hd          # one query chunk's q, or its output
    block = B * hq * c * c           # one pair's scores
    row = B * hq * c                 # one pair's log-sum-exp
    dropout = d.attention_dropout > 0
    masks = 2 * c * c
    if d.autocast:
        operands = pairs * (chunk + 2 * B * (hq if d.groups > 1 else hk) * c * hd) * FP32
    else:
        if not _reshape_copies(B, hq, d.rope):
            operands = B * s * (hq * hd if d.rope else (hq + 2 * hk) * hd) * FP32
        else:
            operands = pairs * chunk * FP32
        if d.groups > 1:
            operands += 2 * B * hq * cp * s * hd * FP32
        elif not _reshape_copies(B, hk, False):
            operands += cp * B * 2 * hk * s * hd * FP32
        else:
            operands += 2 * pairs * B * hk * c * hd * FP32
    scores = pairs * block * FP32 * 2
    if dropout:
        scores += pairs * block * (FP32 + FP32 if d.cpu else 1 + FP32)
    kept = stats * row * FP32 + 2 * merges * chunk * FP32
    return operands + scores + masks + kept + proj_in + tables


def _key_mask(d: _Shape) -> float:
    """BERT's padding mask in each layer's attention, per token: fused SDPA turns the (B, 1, 1, T) bool key
    mask into an additive mask of q's dtype and keeps it (one element a token, e bytes); the math path
    (CPU, attention dropout) adds it to the scores and keeps none. Not divided by tp or sp: every rank masks
    the same keys. Korthikanti et al.'s layer (GPT's causal mask) has no such term."""
    return d.e if d.bert and d.fused_attention else 0.0
