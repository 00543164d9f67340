"""Context parallelism: each sequence split over the cp ranks, attention around a ring.

Layout (Megatron-Core's, for causal load balancing): a sequence of T tokens is cut into 2·cp
chunks of c = T / (2·cp), and cp rank r holds chunks r and 2·cp - 1 - r, in that order. Under a
causal mask a late chunk attends to more keys than an early one, so pairing the r-th chunk from
the start with the r-th from the end gives every rank the same work.

Attention (`RingAttentionCore`, in place of each layer's `attn.core`): the rank's queries stay put
and the keys and values travel. At step i (0 .. cp-1) rank r holds the key / value block of rank
(r - i) mod cp; it posts the send of that block to rank r + 1 and the receive of the next from
r - 1, computes its queries' attention over the block meanwhile (the exchange overlaps the
compute), and merges the result into its running output by log-sum-exp, as blockwise (flash)
attention does; scores, softmax and merges in fp32, with autocast off. A query chunk sees a key chunk before it whole, its own chunk causally, and a
later one not at all. The exchange is an autograd function whose backward sends the gradient the
other way around the ring, so the gradient of every key / value block reaches the rank that made
it: per layer and micro-batch, cp - 1 sends of the (k, v) block forward and cp - 1 of its
gradient backward (`ring_bytes`). Autograd keeps the blocks a rank saw for its backward: the
whole sequence's keys and values, and the attention probabilities of its own queries (T² / cp
scores a head, where one process holds T²).

Positions follow the layout (`ContextParallel.positions`): RoPE and learned position embeddings
see each token's place in the whole sequence. The loss of a micro-batch is the mean over all its
tokens: each rank's mean over its own tokens is weighted by its share of them (`loss_weight`,
from the batch before it is split) times cp, and gradients are averaged over the dp x cp ranks,
which hold the same weights (megalm.parallel.data.DataParallel over `replica_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalm.distributed.comm import _record
from megalm.ops.losses import IGNORE


@dataclass
class ContextParallel:
    """This rank's place in its cp group."""
    group: object
    rank: int
    size: int

    def chunks(self) -> Tuple[int, int]:
        """The two chunks (of 2·cp) this rank holds, in order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def index(self, length: int, device=None) -> torch.Tensor:
        """Positions in the whole sequence of `length` tokens of this rank's length / cp tokens."""
        if length % (2 * self.size):
            raise ValueError(f"context parallelism cuts a sequence into 2 x cp = {2 * self.size} chunks; "
                             f"{length} tokens do not divide")  # validation checks first
        c = length // (2 * self.size)
        a, b = self.chunks()
        return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])

    def positions(self, local_length: int, device=None) -> torch.Tensor:
        """(1, local_length) positions of this rank's tokens when it holds local_length of them."""
        return self.index(local_length * self.size, device)[None]

    def split(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """This rank's part of a micro-batch: every per-token field (B, T, ...) cut to its two chunks,
        and `loss_weight` (B,): cp x its share of the micro-batch's learned tokens."""
        tokens = batch["tokens"]
        T = tokens.shape[1]
        index = self.index(T, tokens.device)
        learned = batch["loss_mask"].bool() if "loss_mask" in batch else batch["labels"] != IGNORE
        out = {k: (v.index_select(1, index) if v.dim() >= 2 and v.shape[1] == T else v) for k, v in batch.items()}
        mine = learned.index_select(1, index).sum()
        weight = self.size * mine.float() / learned.sum().clamp(min=1).float()
        out["loss_weight"] = weight.expand(tokens.shape[0]).clone()
        return out


def weighted_loss(loss: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """A micro-batch's loss on this rank's tokens, weighted to its share of the whole (a batch that
    ContextParallel.split made; any other passes unchanged)."""
    weight = batch.get("loss_weight")
    return loss if weight is None else loss * weight[0]


def ring_bytes(batch: int, local_length: int, kv_heads: int, head_dim: int, cp: int, element_size: int) -> int:
    """Bytes a rank sends around the ring for one layer's attention of one micro-batch, forward and
    backward: cp - 1 (k, v) blocks, then cp - 1 of their gradients."""
    block = 2 * batch * kv_heads * local_length * head_dim * element_size
    return 2 * (cp - 1) * block


class _Pending:
    """A block on its way around the ring: the send of ours, the receive of the next."""

    def __init__(self, block: torch.Tensor, group, forward: bool = True):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        to, frm = ((rank + 1) % size, (rank - 1) % size) if forward else ((rank - 1) % size, (rank + 1) % size)
        self.buffer = torch.empty_like(block)
        with _record("ring", block.numel() * block.element_size()):
            self.works = [dist.isend(block, dist.get_global_rank(group, to), group=group),
                          dist.irecv(self.buffer, dist.get_global_rank(group, frm), group=group)]

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.buffer


class _Arrive(torch.autograd.Function):
    """The block a _Pending receives, as a function of the block the rank sent: its gradient goes
    back around the ring, to the rank the block came from."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, group, pending: _Pending) -> torch.Tensor:
        ctx.group = group
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Pending(grad.contiguous(), ctx.group, forward=False).wait(), None, None


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, dropout: float,
             training: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of q over one key chunk, in fp32: output (B, H, c, hd), lse (B, H, c, 1)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        c = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse)
    if dropout > 0 and training:
        probs = nn.functional.dropout(probs, dropout)
    return torch.matmul(probs, v.float()), lse


def _merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], part: torch.Tensor, part_lse: torch.Tensor):
    if out is None:
        return part, part_lse
    new = torch.logaddexp(lse, part_lse)
    return out * torch.exp(lse - new) + part * torch.exp(part_lse - new), new


class RingAttentionCore(nn.Module):
    """Causal attention of this rank's two query chunks over every rank's keys and values, the blocks
    passed around the cp ring (module docstring). Takes and returns what a causal attention core does
    (megalm.models.layers.AttentionCore): q (B, H, 2c, hd), k / v (B, KVH, 2c, hd) of this rank's chunks,
    after RoPE."""

    def __init__(self, context: ContextParallel, attention_dropout: float):
        super().__init__()
        self.attention_dropout, self.causal = attention_dropout, True
        self.context = context

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if mask is not None or start:
            raise ValueError("context-parallel attention is causal over whole sequences: no mask, no KV cache")
        ctx, groups = self.context, q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        scale = q.shape[-1] ** -0.5
        mine = ctx.chunks()
        block = torch.cat([k, v], dim=1).contiguous()  # (B, 2 KVH, 2c, hd): one message a step
        outs: list = [None, None]
        lses: list = [None, None]
        with torch.autocast(q.device.type, enabled=False):  # the blocks' scores, softmax and merges in fp32
            for step in range(ctx.size):
                block = self._step(q, block, step, mine, c, groups, scale, outs, lses)
        return torch.cat(outs, dim=2).to(q.dtype)

    def _step(self, q, block, step, mine, c, groups, scale, outs, lses):
        """Post the exchange of `block`, attend to it meanwhile, merge; the block the next step holds."""
        ctx = self.context
        pending = _Pending(block.detach(), ctx.group) if step < ctx.size - 1 else None
        source = (ctx.rank - step) % ctx.size
        theirs = (source, 2 * ctx.size - 1 - source)
        kb, vb = block.chunk(2, dim=1)
        if groups > 1:
            kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
        for i, qc in enumerate(mine):
            for j, kc in enumerate(theirs):
                if kc > qc:
                    continue  # a later chunk: masked whole
                part, part_lse = _partial(q[:, :, i * c:(i + 1) * c], kb[:, :, j * c:(j + 1) * c],
                                          vb[:, :, j * c:(j + 1) * c], kc == qc, scale, self.attention_dropout,
                                          self.training)
                outs[i], lses[i] = _merge(outs[i], lses[i], part, part_lse)
        return _Arrive.apply(block, ctx.group, pending) if pending is not None else block


# -- styles: where a family's context-parallel plan puts the ring and the positions ---------------
@dataclass(frozen=True)
class CPContext:
    """What a context-parallel style needs on this rank: its place in the cp group, and how many
    sequence shards a layer's input is in beside it (tp under sequence parallelism, else 1)."""
    context: ContextParallel
    sequence_shards: int = 1


@dataclass(frozen=True)
class RingAttention:
    """An attention core (causal, parameter-free; its dropout probability `attention_dropout`) becomes
    the ring's, RingAttentionCore."""

    def apply(self, module: nn.Module, ctx: CPContext) -> nn.Module:
        return RingAttentionCore(ctx.context, module.attention_dropout)


@dataclass(frozen=True)
class ContextPositions:
    """A module whose forward takes its tokens' positions as argument number `arg` (or keyword
    `positions`) gets, where its caller passes none, the positions this rank's tokens hold in the whole
    sequence (ContextParallel.positions: RoPE and learned position embeddings then see them where they
    are). Its first argument's dim 1 is the rank's part of the sequence, or with `sequence_sharded` a
    sequence shard of it (a layer's input under sequence parallelism)."""
    arg: int
    sequence_sharded: bool = False

    def apply(self, module: nn.Module, ctx: CPContext) -> None:
        arg, shards = self.arg, ctx.sequence_shards if self.sequence_sharded else 1
        context = ctx.context

        def hook(mod, args, kwargs):
            given = args[arg] if len(args) > arg else kwargs.get("positions")
            if given is not None:
                return None
            x = args[0]
            positions = context.positions(x.shape[1] * shards, x.device)
            if len(args) > arg:
                return (*args[:arg], positions, *args[arg + 1:]), kwargs
            return args, {**kwargs, "positions": positions}

        module.register_forward_pre_hook(hook, with_kwargs=True)
