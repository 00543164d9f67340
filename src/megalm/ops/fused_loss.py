"""The language-model head fused with its cross-entropy, chunked over tokens (`model.fused_loss`).

Unfused, the head makes the (N, V) logits, LMLoss an fp32 copy of them and F.cross_entropy keeps
its fp32 log-softmax for backward; at a vocabulary of 32k-128k these are the largest tensors of a
step. Here the loss is computed from the head's input and weight, `chunk_tokens` tokens at a time,
so no more than one chunk's logits ever exist. Two ways to get the gradients
(`model.fused_loss_backward`):

- `in_forward` (`linear_cross_entropy_mean`, the default): the loss is the masked mean, so the
  gradient of every logit is known as soon as its chunk's log-sum-exp is: forward turns each
  chunk's logits into their gradient in place and multiplies it into the input and weight
  gradients at once. Backward only scales them by the incoming gradient. Three matmuls, as
  unfused, and the logits are read and written while they are one chunk; what is kept for
  backward is the input gradient (N, h) and the fp32 weight gradient (V/tp, h).
- `recompute` (`linear_cross_entropy`, per-token losses): forward reduces each chunk's logits to
  a few numbers a token (max, sum of exponentials, the target's logit, the sum of the logits for
  label smoothing); backward recomputes each chunk's logits from the saved head input. Four
  matmuls; it keeps only the head input, the labels and one fp32 log-sum-exp a token, which is
  the smaller store when many micro-batches wait for their backward at once (GPipe's last stage)
  at a large vocabulary.

(Liger-Kernel's fused linear cross-entropy computes the gradients in forward; "Cut Your Losses in
Large-Vocabulary Language Models", arXiv:2411.09009, recomputes. Both are kernels; this is plain
torch ops.)

With a tensor-parallel group the weight is this rank's vocabulary shard (columns
[vocab_start, vocab_start + V/tp) of the logits) and the per-token numbers are combined over the
group as `vocab_parallel_cross_entropy` combines them, in the same two collectives (a max, then one
sum of the stacked numbers): `recompute` once for all the tokens, `in_forward` once per chunk,
since a chunk's gradient needs its global log-sum-exp before the chunk is freed. The input gradient
is this shard's part; the head's input collective (Megatron's f, or the sequence all-gather) sums it
in backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megalm.distributed.comm import all_reduce_max, all_reduce_sum, group_size
from megalm.ops.losses import IGNORE, masked_mean


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (as F.linear would), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _shard(weight: Tensor, labels: Tensor, dtype: torch.dtype, vocab_start: int, vocab_size: int):
    """This shard's real rows of the weight in the compute dtype, the labels as local column ids (0 where
    another shard owns the label) and whether this shard owns each token's label."""
    wc = weight.to(dtype)
    real = max(0, min(wc.shape[0], vocab_size - vocab_start))  # padding columns take no part: not even computed
    local = labels - vocab_start
    owned = (local >= 0) & (local < real)  # the label's column is in this shard
    return wc[:real], local.masked_fill(~owned, 0), owned


def _logit_grad_(p: Tensor, local: Tensor, hit: Tensor, scale: Tensor, eps: float, vocab_size: int) -> Tensor:
    """The chunk's softmax times each token's `scale`, p (c, real), turned in place into scale x d loss / d z.
    (The scale is folded into the softmax's own pass by the caller: one pass over the chunk fewer.)"""
    if eps > 0.0:
        p.sub_((scale * (eps / vocab_size))[:, None])
    return p.scatter_add_(1, local[:, None], -(hit * scale)[:, None])


def _accumulate(g: Tensor, xc: Tensor, wc: Tensor, grad_x: Optional[Tensor], grad_w: Optional[Tensor]) -> None:
    """A chunk's logit gradient g (c, real) in the compute dtype into its rows of the input gradient and the
    weight's (None: not wanted). (The caller casts and drops its fp32 copy first: in bf16 that is the chunk's
    largest tensor.)"""
    if grad_x is not None:
        grad_x.copy_(g @ wc)
    if grad_w is not None and wc.dtype == torch.float32:
        grad_w[:wc.shape[0]].addmm_(g.t(), xc)
    elif grad_w is not None:  # accumulate the low-precision products in fp32
        grad_w[:wc.shape[0]] += g.t() @ xc


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits x W^T over the real columns, chunked over tokens; backward
    recomputes each chunk's logits.

    With z the fp32 logits, lse = log sum_j e^{z_j} over the real columns (global id < vocab_size) and
    t the label: loss = (1 - eps)(lse - z_t) + eps (lse - mean_j z_j), F.cross_entropy's label smoothing
    over the real vocabulary; d loss / d z_j = softmax_j - (1 - eps) [j = t] - eps / vocab_size.
    """

    @staticmethod
    def forward(ctx, x, weight, labels, group, vocab_start, vocab_size, eps, chunk):
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # explicit casts: the same math in backward
            xc = x.to(dtype)  # (N, h)
            wc, local, owned = _shard(weight, labels, dtype, vocab_start, vocab_size)  # (real, h), (N,), (N,)
            n, real = x.shape[0], wc.shape[0]
            # Per token: max, sum of e^(z - max), target logit, sum of logits (smoothing only).
            stats = torch.zeros(4, n, dtype=torch.float32, device=x.device)
            stats[0].fill_(float("-inf"))
            for lo in range(0, n if real else 0, chunk):
                hi = min(lo + chunk, n)
                z = (xc[lo:hi] @ wc.t()).float()  # (c, real): the only logits alive
                stats[2, lo:hi] = z.gather(1, local[lo:hi, None]).squeeze(1)
                if eps > 0.0:
                    stats[3, lo:hi] = z.sum(1)
                m = z.amax(1)  # (max(1) makes indices too: slower)
                stats[0, lo:hi] = m
                stats[1, lo:hi] = z.sub_(m[:, None]).exp_().sum(1)
                del z
            lse, loss = _combine(stats, owned, labels, group, eps, vocab_size)
        ctx.save_for_backward(xc, weight, labels, lse)
        ctx.conf = (vocab_start, vocab_size, eps, chunk, dtype, x.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        xc, weight, labels, lse = ctx.saved_tensors
        vocab_start, vocab_size, eps, chunk, dtype, x_dtype = ctx.conf
        with torch.autocast(xc.device.type, enabled=False):
            wc, local, owned = _shard(weight, labels, dtype, vocab_start, vocab_size)
            n, real = xc.shape[0], wc.shape[0]
            g_token = grad.float().masked_fill(labels == IGNORE, 0.0)  # (N,)
            hit = owned.float() * (1.0 - eps)
            grad_x = torch.zeros(xc.shape, dtype=x_dtype, device=xc.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # padding rows stay 0
            for lo in range(0, n if real else 0, chunk):
                hi = min(lo + chunk, n)
                p = (xc[lo:hi] @ wc.t()).float()  # (c, real), recomputed
                p.sub_(lse[lo:hi, None]).exp_().mul_(g_token[lo:hi, None])  # the softmax, scaled
                p = _logit_grad_(p, local[lo:hi], hit[lo:hi], g_token[lo:hi], eps, vocab_size).to(dtype)
                _accumulate(p, xc[lo:hi], wc, grad_x[lo:hi], grad_w)
                del p
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None, None


def _combine(stats: Tensor, owned: Tensor, labels: Tensor, group, eps: float, vocab_size: int):
    """Per-token (max, sum of e^(z - max), target logit, sum of logits) of this shard, (4, n) fp32, combined
    over the group (a max, then one sum, as the unfused vocabulary-parallel loss): the log-sum-exp over the
    whole vocabulary and the loss, 0 at IGNORE labels. Modifies stats."""
    stats[2].masked_fill_(~owned, 0.0)  # the label's owner alone adds its logit
    top = all_reduce_max(stats[0].clone(), group)  # (n,), the max over every shard
    stats[1].mul_((stats[0] - top).exp_())  # each shard's sum rescaled to the common max
    sums = all_reduce_sum(stats[1:4] if eps > 0.0 else stats[1:3], group)  # one call, as the unfused loss
    lse = top + sums[0].log()
    loss = lse - sums[1]
    if eps > 0.0:
        loss = (1.0 - eps) * loss + eps * (lse - sums[2] / vocab_size)
    return lse, loss.masked_fill(labels == IGNORE, 0.0)


class _LinearCrossEntropyMean(torch.autograd.Function):
    """sum_t weights_t loss_t of the same per-token cross-entropy, with the input and weight gradients made
    in forward chunk by chunk (d loss / d z_t is weights_t times _LinearCrossEntropy's) and only scaled by
    the incoming gradient in backward. `wanted`: whether x's and weight's gradients are (under no_grad, or
    with a frozen head, forward skips their matmuls)."""

    @staticmethod
    def forward(ctx, x, weight, labels, weights, group, vocab_start, vocab_size, eps, chunk, wanted):
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dtype)
            wc, local, owned = _shard(weight, labels, dtype, vocab_start, vocab_size)
            n, real = x.shape[0], wc.shape[0]
            scale = weights.float().masked_fill(labels == IGNORE, 0.0)  # (N,): d total / d loss_t
            hit = owned.float() * (1.0 - eps)
            grad_x = torch.zeros(xc.shape, dtype=x.dtype, device=x.device) if wanted[0] else None
            grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # padding rows stay 0
                      if wanted[1] else None)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for lo in range(0, n, chunk):  # every rank of the group takes every chunk: collectives per chunk
                hi = min(lo + chunk, n)
                stats = torch.zeros(4, hi - lo, dtype=torch.float32, device=x.device)
                stats[0].fill_(float("-inf"))
                p = None
                if real:  # a shard of padding alone still joins the collectives
                    p = (xc[lo:hi] @ wc.t()).float()  # (c, real): the only logits alive
                    stats[2] = p.gather(1, local[lo:hi, None]).squeeze(1)
                    if eps > 0.0:
                        stats[3] = p.sum(1)
                    stats[0] = p.amax(1)
                    stats[1] = p.sub_(stats[0, :, None]).exp_().sum(1)  # p = e^(z - local max)
                m = stats[0]  # _combine leaves the local max as it is
                lse, loss = _combine(stats, owned[lo:hi], labels[lo:hi], group, eps, vocab_size)
                total += (loss * scale[lo:hi]).sum()
                if p is not None and any(wanted):
                    p.mul_(((m - lse).exp_() * scale[lo:hi])[:, None])  # the softmax over the whole vocabulary
                    p = _logit_grad_(p, local[lo:hi], hit[lo:hi], scale[lo:hi], eps, vocab_size).to(dtype)
                    _accumulate(p, xc[lo:hi], wc, None if grad_x is None else grad_x[lo:hi], grad_w)
                del p
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        return (None if grad_x is None else grad_x * grad.to(grad_x.dtype),
                None if grad_w is None else (grad_w * grad.float()).to(ctx.weight_dtype),
                None, None, None, None, None, None, None, None)


def _check(x: Tensor, weight: Tensor, labels: Tensor, vocab_size: int, chunk_tokens: int, group,
           label_smoothing: float) -> None:
    if x.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(x.shape)} and labels {tuple(labels.shape)} disagree on the leading dims")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {x.shape[-1]} does not match the head weight {tuple(weight.shape)}")
    padded = weight.shape[0] * group_size(group)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {padded}] (= {weight.shape[0]} rows x tp "
                         f"{group_size(group)})")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, *, vocab_size: int, chunk_tokens: int,
                         vocab_start: int = 0, group=None, label_smoothing: float = 0.0) -> Tensor:
    """Per-token cross-entropy (labels' shape) of the logits x @ weight.T, without making them whole;
    backward recomputes the logits chunk by chunk (`model.fused_loss_backward=recompute`).

    x (..., h): the head's input; weight (V, h), or with `group` this rank's shard (V/tp, h) whose
    rows are the vocabulary ids [vocab_start, vocab_start + V/tp). Columns whose id is
    >= vocab_size are padding and take no part; labels equal to IGNORE (-100) give 0 and no gradient.
    The same values and gradients as LMLoss.per_token on the logits (vocab_parallel_cross_entropy
    under tp), to fp32 rounding; the logits are made `chunk_tokens` tokens at a time.
    """
    _check(x, weight, labels, vocab_size, chunk_tokens, group, label_smoothing)
    loss = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, labels.reshape(-1), group, vocab_start,
                                     vocab_size, float(label_smoothing), int(chunk_tokens))
    return loss.view(labels.shape)


def linear_cross_entropy_mean(x: Tensor, weight: Tensor, labels: Tensor, loss_mask: Optional[Tensor] = None, *,
                              vocab_size: int, chunk_tokens: int, vocab_start: int = 0, group=None,
                              label_smoothing: float = 0.0) -> Tensor:
    """LMLoss's masked mean of `linear_cross_entropy` (the mask defaults to labels != IGNORE), with the
    gradients made in forward (`model.fused_loss_backward=in_forward`): one matmul fewer than recomputing,
    and the chunk's logits become their gradient while they are one chunk. Arguments as
    `linear_cross_entropy`'s; loss_mask has the labels' shape."""
    _check(x, weight, labels, vocab_size, chunk_tokens, group, label_smoothing)
    mask = (loss_mask if loss_mask is not None else labels != IGNORE).float()
    weights = mask / mask.sum().clamp(min=1.0)  # masked_mean's weights
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropyMean.apply(x.reshape(-1, x.shape[-1]), weight, labels.reshape(-1),
                                         weights.reshape(-1), group, vocab_start, vocab_size,
                                         float(label_smoothing), int(chunk_tokens),
                                         (grad and x.requires_grad, grad and weight.requires_grad))


BACKWARDS = ("in_forward", "recompute")
"""model.fused_loss_backward's choices."""


def fused_masked_mean(x: Tensor, weight: Tensor, labels: Tensor, loss_mask: Optional[Tensor], *, backward: str,
                      **kwargs) -> Tensor:
    """LMLoss.from_hidden's loss: the masked mean of the fused per-token losses, by `backward`'s way."""
    if backward == "in_forward":
        return linear_cross_entropy_mean(x, weight, labels, loss_mask, **kwargs)
    if backward == "recompute":
        return masked_mean(linear_cross_entropy(x, weight, labels, **kwargs),
                           loss_mask if loss_mask is not None else labels != IGNORE)
    raise ValueError(f"backward={backward!r} must be one of {', '.join(BACKWARDS)}")
