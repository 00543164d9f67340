"""The language-model head fused with its cross-entropy, chunked over tokens (`model.fused_loss`).

Unfused, the head makes the (N, V) logits, LMLoss an fp32 copy of them and F.cross_entropy keeps
its fp32 log-softmax for backward; at a vocabulary of 32k-128k these are the largest tensors of a
step. Here the loss is computed from the head's input and weight, `chunk_tokens` tokens at a time:
a chunk's logits are made, reduced to four numbers a token (their max, the sum of exponentials,
the target's logit and, for label smoothing, the sum of the logits) and freed. Backward recomputes
each chunk's logits from the saved head input and accumulates the input and weight gradients
chunk by chunk, so no more than one chunk's logits ever exist. (Liger-Kernel's fused linear
cross-entropy and "Cut Your Losses in Large-Vocabulary Language Models", arXiv:2411.09009, do the
same in kernels; this is plain torch ops.) What it keeps for backward: the head input (N, h) in
the compute dtype (the unfused head's matmul keeps that too), the labels and one fp32 log-sum-exp
a token.

With a tensor-parallel group the weight is this rank's vocabulary shard (columns
[vocab_start, vocab_start + V/tp) of the logits) and the per-token numbers are combined over the
group as `vocab_parallel_cross_entropy` combines them, in the same two collectives (a max, then one
sum of the stacked numbers), once for all the tokens rather than once per chunk: the values are a
few floats a token, so per chunk would add only latency. The input gradient is this shard's part;
the head's input collective (Megatron's f, or the sequence all-gather) sums it in backward.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalm.distributed.comm import all_reduce_max, all_reduce_sum, group_size
from megalm.models.losses import IGNORE


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (as F.linear would), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits x W^T over the real columns, chunked over tokens.

    With z the fp32 logits, lse = log sum_j e^{z_j} over the real columns (global id < vocab_size) and
    t the label: loss = (1 - eps)(lse - z_t) + eps (lse - mean_j z_j), F.cross_entropy's label smoothing
    over the real vocabulary; d loss / d z_j = softmax_j - (1 - eps) [j = t] - eps / vocab_size.
    """

    @staticmethod
    def forward(ctx, x, weight, labels, group, vocab_start, vocab_size, eps, chunk):
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # explicit casts: the same math in backward
            xc, wc = x.to(dtype), weight.to(dtype)  # (N, h), (V/tp, h)
            real = max(0, min(wc.shape[0], vocab_size - vocab_start))  # this shard's real columns
            wc = wc[:real]  # padding columns take no part: not even computed
            n = x.shape[0]
            local = labels - vocab_start
            owned = (local >= 0) & (local < real)  # the label's column is in this shard
            local = local.masked_fill(~owned, 0)
            # Per token: max, sum of e^(z - max), target logit, sum of logits (smoothing only).
            stats = torch.zeros(4, n, dtype=torch.float32, device=x.device)
            stats[0].fill_(float("-inf"))
            for lo in range(0, n if real else 0, chunk):
                hi = min(lo + chunk, n)
                z = (xc[lo:hi] @ wc.t()).float()  # (c, real): the only logits alive
                stats[2, lo:hi] = z.gather(1, local[lo:hi, None]).squeeze(1)
                if eps > 0.0:
                    stats[3, lo:hi] = z.sum(1)
                m = z.max(1).values
                stats[0, lo:hi] = m
                stats[1, lo:hi] = z.sub_(m[:, None]).exp_().sum(1)
                del z
            stats[2].masked_fill_(~owned, 0.0)  # the label's owner alone adds its logit
            top = all_reduce_max(stats[0].clone(), group)  # (N,), the max over every shard
            stats[1].mul_((stats[0] - top).exp_())  # each shard's sum rescaled to the common max
            sums = all_reduce_sum(stats[1:4] if eps > 0.0 else stats[1:3], group)  # one call, as the unfused loss
            lse = top + sums[0].log()
            loss = lse - sums[1]
            if eps > 0.0:
                loss = (1.0 - eps) * loss + eps * (lse - sums[2] / vocab_size)
            loss = loss.masked_fill(labels == IGNORE, 0.0)
        ctx.save_for_backward(xc, weight, labels, lse)
        ctx.conf = (vocab_start, vocab_size, eps, chunk, dtype, x.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        xc, weight, labels, lse = ctx.saved_tensors
        vocab_start, vocab_size, eps, chunk, dtype, x_dtype = ctx.conf
        with torch.autocast(xc.device.type, enabled=False):
            wc = weight.to(dtype)
            real = max(0, min(wc.shape[0], vocab_size - vocab_start))
            wc = wc[:real]
            n = xc.shape[0]
            local = labels - vocab_start
            owned = (local >= 0) & (local < real)
            local = local.masked_fill(~owned, 0)
            g_token = grad.float().masked_fill(labels == IGNORE, 0.0)  # (N,)
            hit = owned.float() * (1.0 - eps)
            grad_x = torch.zeros(xc.shape, dtype=x_dtype, device=xc.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # padding rows stay 0
            for lo in range(0, n if real else 0, chunk):
                hi = min(lo + chunk, n)
                g = (xc[lo:hi] @ wc.t()).float()  # (c, real), recomputed
                g.sub_(lse[lo:hi, None]).exp_()  # softmax
                if eps > 0.0:
                    g.sub_(eps / vocab_size)
                g.scatter_add_(1, local[lo:hi, None], -hit[lo:hi, None])
                g.mul_(g_token[lo:hi, None])  # d loss / d z for the chunk
                g = g.to(dtype)
                grad_x[lo:hi] = g @ wc
                if dtype == torch.float32:
                    grad_w[:real].addmm_(g.t(), xc[lo:hi])
                else:  # accumulate the low-precision products in fp32
                    grad_w[:real] += g.t() @ xc[lo:hi]
                del g
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None, None


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, *, vocab_size: int, chunk_tokens: int,
                         vocab_start: int = 0, group=None, label_smoothing: float = 0.0) -> Tensor:
    """Per-token cross-entropy (labels' shape) of the logits x @ weight.T, without making them whole.

    x (..., h): the head's input; weight (V, h), or with `group` this rank's shard (V/tp, h) whose
    rows are the vocabulary ids [vocab_start, vocab_start + V/tp); labels (...). Columns whose id is
    >= vocab_size are padding and take no part; labels equal to IGNORE (-100) give 0 and no gradient.
    The same values and gradients as LMLoss.per_token on the logits (vocab_parallel_cross_entropy
    under tp), to fp32 rounding; the logits are made `chunk_tokens` tokens at a time.
    """
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
    loss = _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, labels.reshape(-1), group, vocab_start,
                                     vocab_size, float(label_smoothing), int(chunk_tokens))
    return loss.view(labels.shape)


class LMHead(nn.Linear):
    """The output head: an nn.Linear whose call can hand its input and weight to a consumer that fuses
    the matmul into itself (`fuse(x, weight)`, the chunked loss). Going through the module's call keeps
    hooks on it working (ZeRO-3 gathers the weight in one); ColumnParallelLinear takes `fuse` too."""

    def forward(self, x: Tensor, fuse: Optional[Callable[[Tensor, Tensor], Tensor]] = None) -> Tensor:
        if fuse is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            raise ValueError("a fused head + loss takes a head without a bias")
        return fuse(x, self.weight)
