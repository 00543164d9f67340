"""Tensor-parallel layers holding only this rank's shard (Megatron-LM, arXiv:1909.08053).

Linear layers come in the paper's pair (sec. 3, fig. 3): a column-parallel linear splits the
output features, so Y_i = X A_i needs a replicated X and yields a shard of Y; a row-parallel
linear splits the input features, so Z = sum_i Y_i B_i is a sum of partial products that one
all-reduce completes. An MLP or attention block is then column → (local nonlinearity / heads)
→ row with one all-reduce forward and one backward. With sequence parallelism
(arXiv:2205.05198) the replicated activations outside the pair are split by sequence instead,
and the all-reduce becomes all-gather (entry) + reduce-scatter (exit).

Parameters are allocated, never initialised: megalm's `init_weights` draws each full tensor by
its global name and keeps `param.tp_shard.local(full)`. Replicated parameters have no tp_shard.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalm.distributed.async_comm import start_all_gather, start_reduce_scatter
from megalm.distributed.comm import (all_gather_dim, all_reduce_max, all_reduce_sum, copy_to_tp, gather_last_dim,
                                     gather_seq, group_rank, group_size, open_stats, reduce_from_tp,
                                     reduce_scatter_dim, reduce_scatter_seq)
from megalm.distributed.shards import TPShard
from megalm.ops.embedding import lookup


class _ShardedModule(nn.Module):
    """Keeps `tp_shard` (and other markers) on parameters across to_empty()/to()/cuda().

    nn.Module._apply replaces a Parameter object when the device type changes (meta → cpu), which
    drops attributes set on it; re-attach them after every conversion.
    """

    def _mark(self, name: str, **attrs) -> None:
        self.__dict__.setdefault("_param_marks", {}).setdefault(name, {}).update(attrs)
        for k, v in attrs.items():
            setattr(self._parameters[name], k, v)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for name, attrs in self.__dict__.get("_param_marks", {}).items():
            p = self._parameters.get(name)
            if p is not None:
                for k, v in attrs.items():
                    setattr(p, k, v)
        return out


class _GatheredLinear(torch.autograd.Function):
    """Sequence parallelism's entry to a column-parallel linear, keeping the shard (Korthikanti et al.,
    arXiv:2205.05198, sec. 4.2.2, as Megatron-LM's linear with sequence parallelism does): y = gather(x) W^T + b
    with x the (B, T/tp, in) sequence shard. Autograd would keep the gathered (B, T, in) input for the weight's
    gradient; this keeps the shard and gathers it again in backward, so a linear keeps in/tp a token, not in.

    Under autocast the shard is cast to the compute dtype before the gather, the cast autocast would make of the
    gathered input (the same values, half the bytes on the wire and kept), and the weight is cast again in backward
    rather than kept (its copy lives only in autocast's cache for the forward region). The gradients are computed
    as autograd computes linear's (addmm / mm on the flattened tokens, the input's gradient brought back to the
    input's dtype before it is reduce-scattered), so they are the same numbers, bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim, overlap=False):
        device = x.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.in_dtype, ctx.low = x.dtype, low
        if low is not None and x.dtype != low:
            x = x.to(low)
        if overlap:
            y = _gather_matmul(x, weight, bias, group)  # (B, T/tp, in) → (B, T, out/tp), by pieces
        else:
            full = all_gather_dim(x, group, dim)  # (B, T/tp, in) → (B, T, in)
            y = F.linear(full, weight, bias)  # (B, T, out/tp)
        ctx.save_for_backward(x, weight, bias)
        ctx.group, ctx.dim, ctx.stats, ctx.overlap = group, dim, open_stats(), overlap
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        w = weight.to(ctx.low) if ctx.low is not None else weight  # autocast's cast of the weight, made again
        g = grad.reshape(-1, grad.shape[-1])  # (B*T, out/tp)
        shape = list(x.shape)
        shape[ctx.dim] *= group_size(ctx.group)  # (B, T, in)
        grad_x = grad_w = grad_b = grad_full = None
        if ctx.overlap:  # the gather runs while the input's gradient is computed, the reduce-scatter during the
            # weight's: the same operations as below, each collective beside a matmul that does not need it
            gathering = start_all_gather(x, ctx.group, ctx.dim, stats=ctx.stats)
            if ctx.needs_input_grad[0]:
                grad_full = g.mm(w).view(shape).to(ctx.in_dtype)
            full = gathering.wait()
            scattering = start_reduce_scatter(grad_full, ctx.group, ctx.dim, stats=ctx.stats) \
                if grad_full is not None else None
        else:
            full = all_gather_dim(x, ctx.group, ctx.dim, stats=ctx.stats)  # the shard gathered again
            if ctx.needs_input_grad[0]:
                grad_full = g.mm(w).view(shape).to(ctx.in_dtype)  # (B, T, in)
                grad_x = reduce_scatter_dim(grad_full, ctx.group, ctx.dim, stats=ctx.stats)  # (B, T/tp, in)
        if ctx.needs_input_grad[1]:
            grad_w = g.t().mm(full.reshape(-1, full.shape[-1])).to(weight.dtype)  # (out/tp, in)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(bias.dtype)
        if ctx.overlap and grad_full is not None:
            grad_x = scattering.wait()  # (B, T/tp, in)
        return grad_x, grad_w, grad_b, None, None, None


def overlap_pieces(tokens: int, tp: int) -> int:
    """Pieces parallel.tp_comm_overlap cuts a rank's sequence shard of `tokens` tokens into: tp, as many as a ring
    over the group has steps, or the most below that which divide the shard evenly."""
    return max(k for k in range(1, tp + 1) if tokens % k == 0)


def _gather_matmul(x: Tensor, weight: Tensor, bias: Optional[Tensor], group) -> Tensor:
    """F.linear(all_gather(x, dim 1), weight, bias) with the gather decomposed (Wang et al., ASPLOS 2023): the
    (B, S, in) shard is cut into pieces along the sequence; piece i of every rank is multiplied while piece i + 1
    is gathered. Row for row the product of the whole; each piece's matmul rounds as a matmul of its rows."""
    world = group_size(group)
    B, S = x.shape[0], x.shape[1]
    n = overlap_pieces(S, world)
    pieces = x.chunk(n, dim=1)  # (B, S/n, in) each
    gathering = start_all_gather(pieces[0], group, 1)
    out = None
    for i in range(n):
        full = gathering.wait()  # (B, tp S/n, in): piece i of every rank's shard, in rank order
        if i + 1 < n:
            gathering = start_all_gather(pieces[i + 1], group, 1)
        y = F.linear(full, weight, bias)  # (B, tp S/n, out/tp)
        if out is None:
            out = y.new_empty(B, world, n, S // n, y.shape[-1])
        out[:, :, i] = y.view(B, world, S // n, y.shape[-1])
    return out.view(B, world * S, out.shape[-1])  # (B, T, out/tp): rank r's rows, then rank r + 1's


class _ScatteredLinear(torch.autograd.Function):
    """Sequence parallelism's exit from a row-parallel linear with parallel.tp_comm_overlap: reduce_scatter(x W^T)
    along the sequence with both decomposed into pieces (Wang et al., ASPLOS 2023). Forward: the partial product
    of piece i of every rank's region is reduce-scattered while piece i + 1's is computed. Backward: piece i of
    the output's gradient is all-gathered while the input's gradient of piece i - 1 is computed; the weight's
    gradient is then one matmul over the gathered whole, as autograd computes linear's. x is (B, T, in/tp) with
    T = tp S; the result (B, S, out) is this rank's sequence shard of the sum over ranks (no bias: the caller
    adds it after the sum). Under autocast x is cast to the compute dtype (autocast's cast) and kept so; the
    weight is cast again in backward rather than kept."""

    @staticmethod
    def forward(ctx, x, weight, group):
        device = x.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.in_dtype, ctx.low = x.dtype, low
        if low is not None and x.dtype != low:
            x = x.to(low)
        world = group_size(group)
        B, T = x.shape[0], x.shape[1]
        S = T // world
        n = overlap_pieces(S, world)
        regions = x.reshape(B, world, S, x.shape[-1])  # rank r's sequence region in [:, r]
        scattering = []
        for piece in regions.chunk(n, dim=2):  # (B, tp, S/n, in/tp)
            partial = F.linear(piece, weight)  # (B, tp, S/n, out)
            scattering.append(start_reduce_scatter(partial, group, 1))  # → (B, 1, S/n, out), summed
        z = torch.cat([pending.wait() for pending in scattering], dim=2)  # (B, 1, S, out)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.pieces, ctx.stats = group, n, open_stats()
        return z.view(B, S, z.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w = weight.to(ctx.low) if ctx.low is not None else weight
        world, n = group_size(ctx.group), ctx.pieces
        B, S, out = grad.shape
        g = grad.new_empty(B, world, n, S // n, out)  # the gathered gradient of the partial products
        grad_x = x.new_empty(B, world, n, S // n, x.shape[-1]) if ctx.needs_input_grad[0] else None
        pieces = grad.chunk(n, dim=1)  # (B, S/n, out) each
        gathering = start_all_gather(pieces[0], ctx.group, 1, stats=ctx.stats)
        for i in range(n):
            gi = gathering.wait().view(B, world, S // n, out)  # piece i of every rank's output gradient
            if i + 1 < n:
                gathering = start_all_gather(pieces[i + 1], ctx.group, 1, stats=ctx.stats)
            g[:, :, i] = gi
            if grad_x is not None:
                grad_x[:, :, i] = gi.matmul(w)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = g.reshape(-1, out).t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)  # (out, in/tp)
        if grad_x is not None:
            grad_x = grad_x.view(x.shape).to(ctx.in_dtype)
        return grad_x, grad_w, None


class ColumnParallelLinear(_ShardedModule):
    """y = x A^T + b with A split by rows (output features): this rank computes y[..., shard].

    Input (B, T, in) replicated → copy_to_tp (f: its gradient is the sum over ranks), or with
    sequence parallelism (B, T/tp, in) → gather_seq. Output (B, T, out/tp), or the full
    (B, T, out) with gather_output. `segments` describes a fused output ([q | k | v],
    [gate | up]); each segment is split across ranks (see TPShard). `comm_overlap` (sequence
    parallelism only: parallel.tp_comm_overlap) multiplies each piece of the gathered input while
    the next piece is gathered, and in backward overlaps the gather with the input's gradient and the
    reduce-scatter with the weight's.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group,
                 segments: Optional[Sequence[int]] = None, gather_output: bool = False,
                 sequence_parallel: bool = False, comm_overlap: bool = False, device=None, dtype=None):
        super().__init__()
        world, rank = group_size(group), group_rank(group)
        self.comm_overlap = comm_overlap and sequence_parallel and world > 1
        if segments is not None and sum(segments) != out_features:
            raise ValueError(f"segments {list(segments)} sum to {sum(segments)}, not out_features={out_features}")
        if out_features % world:
            raise ValueError(f"ColumnParallelLinear out_features={out_features} is not divisible by "
                             f"the tensor-parallel size {world}")
        self.group, self.world = group, world
        self.shard = TPShard(0, rank, world, tuple(segments) if segments is not None else None)
        self.in_features, self.global_out_features = in_features, out_features
        self.local_out_features = out_features // world
        # The width this module returns, so code written for nn.Linear splits its output right.
        self.out_features = out_features if gather_output else self.local_out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(self.local_out_features, in_features, **kw))  # (out/tp, in)
        self._mark("weight", tp_shard=self.shard)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.local_out_features, **kw))  # (out/tp,)
            self._mark("bias", tp_shard=self.shard)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor, fuse: Optional[Callable[[Tensor, Tensor], Tensor]] = None) -> Tensor:
        """`fuse(x, weight)`, when given, replaces the matmul (and any output gather): a consumer that
        fuses the product into itself (the chunked loss, megalm.ops.fused_loss) gets the input after
        this layer's collective and this rank's weight shard, through the module's call (hooks fire)."""
        if self.sequence_parallel and fuse is None and self.world > 1:
            overlap = self.comm_overlap and not torch.compiler.is_compiling()
            y = _GatheredLinear.apply(x, self.weight, self.bias, self.group, 1, overlap)  # → (B, T, out/tp)
            return self._gathered(y)
        if self.sequence_parallel:
            x = gather_seq(x, self.group, dim=1)  # (B, T/tp, in) → (B, T, in)
        else:
            x = copy_to_tp(x, self.group)  # (B, T, in), replicated
        if fuse is not None:
            if self.bias is not None:
                raise ValueError("a fused head + loss takes a head without a bias")
            return fuse(x, self.weight)
        return self._gathered(F.linear(x, self.weight, self.bias))  # (B, T, out/tp)

    def _gathered(self, y: Tensor) -> Tensor:
        """The output as this module returns it: this rank's (B, T, out/tp), or with gather_output the whole."""
        if not self.gather_output:
            return y
        y = gather_last_dim(y, self.group)  # (B, T, out) as [rank0 | rank1 | ...]
        if self.shard.segments is None:
            return y
        # Rank order interleaves the segments ([q0 k0 v0 | q1 k1 v1]); restore [q | k | v].
        local = [s // self.world for s in self.shard.segments]
        per_rank = [chunk.split(local, dim=-1) for chunk in y.chunk(self.world, dim=-1)]
        return torch.cat([per_rank[r][i] for i in range(len(local)) for r in range(self.world)], dim=-1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.global_out_features} "
                f"(local {self.local_out_features}), bias={self.bias is not None}, tp={self.world}, "
                f"segments={self.shard.segments}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ShardedModule):
    """z = x B^T + b with B split by columns (input features): z = sum_r x_r B_r^T.

    Input (B, T, in/tp), already split by the column-parallel layer before it. The partial
    products are summed by reduce_from_tp (g), or with sequence parallelism reduce-scattered to
    (B, T/tp, out). The bias is replicated and added once, after the sum. Under sequence
    parallelism each rank's bias gradient covers only its tokens, so the bias is marked
    `sequence_parallel = True`: its gradient must be all-reduced over the tp group. `comm_overlap`
    (sequence parallelism only: parallel.tp_comm_overlap) reduce-scatters each piece of the partial
    output while the next piece is multiplied (`_ScatteredLinear`).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group,
                 sequence_parallel: bool = False, comm_overlap: bool = False, device=None, dtype=None):
        super().__init__()
        world, rank = group_size(group), group_rank(group)
        self.comm_overlap = comm_overlap and sequence_parallel and world > 1
        if in_features % world:
            raise ValueError(f"RowParallelLinear in_features={in_features} is not divisible by "
                             f"the tensor-parallel size {world}")
        self.group, self.world = group, world
        self.shard = TPShard(1, rank, world)
        self.global_in_features, self.out_features = in_features, out_features
        self.in_features = in_features // world  # the width this module takes
        self.sequence_parallel = sequence_parallel
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features, **kw))  # (out, in/tp)
        self._mark("weight", tp_shard=self.shard)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))  # (out,), replicated
            if sequence_parallel and world > 1:
                self._mark("bias", sequence_parallel=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"RowParallelLinear expects the last dim {self.in_features} "
                             f"(= {self.global_in_features} / tp {self.world}); got shape {tuple(x.shape)}")
        if self.comm_overlap and not torch.compiler.is_compiling():
            y = _ScatteredLinear.apply(x, self.weight, self.group)  # (B, T/tp, out), summed over ranks
            return y if self.bias is None else y + self.bias
        y = F.linear(x, self.weight)  # (B, T, out), a partial sum over this rank's inputs
        if self.sequence_parallel:
            y = reduce_scatter_seq(y, self.group, dim=1)  # (B, T/tp, out)
        else:
            y = reduce_from_tp(y, self.group)  # (B, T, out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.global_in_features} (local {self.in_features}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.world}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_ShardedModule):
    """Embedding with the vocabulary split by rows (paper sec. 3, "input embedding").

    Rank r holds rows [r V/tp, (r+1) V/tp). Ids outside the shard look up row 0 and are zeroed,
    so summing over ranks (all-reduce, or reduce-scatter by sequence under sequence parallelism)
    yields the full lookup with each id contributed by exactly one rank.
    """

    REDUCTIONS = ("all_reduce", "reduce_scatter", "none")

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group, reduce: str = "all_reduce",
                 device=None, dtype=None):
        super().__init__()
        world, rank = group_size(group), group_rank(group)
        if num_embeddings % world:
            raise ValueError(f"VocabParallelEmbedding num_embeddings={num_embeddings} is not divisible "
                             f"by the tensor-parallel size {world}; pad the vocabulary to a multiple")
        if reduce not in self.REDUCTIONS:
            raise ValueError(f"reduce={reduce!r}; choose one of {self.REDUCTIONS}")
        self.group, self.world, self.reduce = group, world, reduce
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = num_embeddings // world
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.shard = TPShard(0, rank, world)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))  # (V/tp, h)
        self._mark("weight", tp_shard=self.shard)

    def forward(self, ids: Tensor) -> Tensor:
        if self.world > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            y = lookup(local, self.weight)  # (B, T, h)
            y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            y = lookup(ids, self.weight)
        if self.reduce == "all_reduce":
            return reduce_from_tp(y, self.group)  # (B, T, h)
        if self.reduce == "reduce_scatter":
            return reduce_scatter_seq(y, self.group, dim=1)  # (B, T/tp, h)
        return y  # (B, T, h), this rank's partial lookup

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.world}, reduce={self.reduce}")


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over a vocabulary split by columns, never materialising the full row.

    With s = z − max(z) (max over all ranks), log Z = log Σ_j e^{s_j} (sum over all ranks) and
    loss = (1−ε)(log Z − s_t) + ε(log Z − mean_{j<V} s_j). Its gradient on the local shard is
    softmax − (1−ε)·onehot(t) − ε/V on real columns, so backward needs only the local softmax.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size, eps, ignore_index):
        x = logits.float()  # (..., V/tp)
        n_local = x.shape[-1]
        cols = torch.arange(vocab_start, vocab_start + n_local, device=x.device)  # global ids
        real = cols < vocab_size  # (V/tp,), padding columns are False
        x = x.masked_fill(~real, float("-inf"))
        # Stability: subtract the global max (its gradient cancels exactly, so no autograd).
        m = all_reduce_max(x.max(dim=-1).values, group)  # (...)
        s = x - m.unsqueeze(-1)  # (..., V/tp), −inf on padding
        e = s.exp()
        owned = (labels >= vocab_start) & (labels < vocab_start + n_local)  # target in this shard
        t_local = (labels - vocab_start).masked_fill(~owned, 0)
        s_t = s.gather(-1, t_local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        # Σ e^s, the target logit (only its owner adds non-zero) and, for label smoothing only,
        # Σ_real s share one all-reduce.
        parts = [e.sum(-1), s_t] + ([s.masked_fill(~real, 0.0).sum(-1)] if eps > 0.0 else [])
        sums = all_reduce_sum(torch.stack(parts, dim=0), group)  # (2 or 3, ...)
        sum_e, s_t = sums[0], sums[1]
        log_z = sum_e.log()
        loss = log_z - s_t
        if eps > 0.0:
            loss = (1.0 - eps) * loss + eps * (log_z - sums[2] / vocab_size)
        ignored = labels == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = e.div_(sum_e.unsqueeze(-1))  # (..., V/tp), reuses e's memory
        ctx.save_for_backward(softmax, t_local, owned & ~ignored, ignored, real)
        ctx.eps, ctx.vocab_size, ctx.dtype = eps, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, t_local, owned, ignored, real = ctx.saved_tensors
        # Overwrite the saved softmax in place (no second vocab-shard buffer); a second backward
        # through a retained graph then fails autograd's version check instead of going wrong.
        g = softmax
        if ctx.eps > 0.0:
            g.sub_(real.to(g.dtype) * (ctx.eps / ctx.vocab_size))
        hit = owned.to(g.dtype) * (1.0 - ctx.eps)  # (...)
        g.scatter_add_(-1, t_local.unsqueeze(-1), -hit.unsqueeze(-1))
        g.mul_(grad.masked_fill(ignored, 0.0).unsqueeze(-1).to(g.dtype))
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group, *, vocab_start: int,
                                 vocab_size: Optional[int] = None, label_smoothing: float = 0.0,
                                 ignore_index: int = -100) -> Tensor:
    """Per-token loss (shape of labels) from this rank's logits (..., V/tp), columns
    [vocab_start, vocab_start + V/tp). Columns with global id >= vocab_size are padding and are
    excluded, which equals F.cross_entropy on the real columns (or on −inf-padded logits when
    label_smoothing is 0). Labels equal to ignore_index get loss 0 and no gradient, as in
    F.cross_entropy. Computed in fp32.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree "
                         "on the leading dims")
    padded = logits.shape[-1] * group_size(group)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {padded}] (= {logits.shape[-1]} local "
                         f"columns x tp {group_size(group)})")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    return _VocabParallelCE.apply(logits, labels, group, vocab_start, vocab_size,
                                  float(label_smoothing), ignore_index)
