"""Tensor-parallel styles, and applying a plan of styles to a model.

A family declares its plans in its own parallelize.py (as torchtitan keeps its plans): lists of
(module pattern, style) pairs, where a pattern names a module path and `*` matches any one
segment (`blocks.*.attn.qkv`). `apply_plan` swaps each matching module for its parallel form,
or tags or hooks it, in the order of the plan; modules this rank does not hold (another
pipeline stage's) simply match nothing. The styles name no model class: what they need of a
module is its kind (nn.Linear, nn.Embedding) or what the plan tells them.

The styles follow Megatron's layout (arXiv:1909.08053, sec. 3): column-parallel linears hold a
slice of the outputs (whole heads, a slice of the ffn), row-parallel ones a slice of the inputs,
so a column → row pair needs one all-reduce forward and one backward; vocabulary-sized layers
are split by rows, and the loss is computed from vocabulary shards without gathering the
logits. With sequence parallelism (arXiv:2205.05198) the activations between sub-layers are
split along the sequence: the all-reduce becomes a reduce-scatter after the row-parallel linear
and an all-gather before the column-parallel one, and norms and dropout run on 1/tp of the
tokens. Their weights then see partial gradients: tagged `sequence_parallel` so the gradient
code sums them over the tp group.

The plan owns vocabulary padding: a family builds its model with one process's padding, and
its plan gives vocabulary-sized layers the rows of the tp degree (`ModelConfig.padded_vocab`).
Applied on the meta device, before any weight exists; init_weights then fills each shard from
the full tensor of the same global name, so weights do not depend on tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalm.distributed.comm import gather_seq_replicated, scatter_seq
from megalm.ops.attention import dropout_with
from megalm.ops.fused_loss import fused_masked_mean
from megalm.ops.losses import IGNORE, masked_mean
from megalm.family import Plan
from megalm.parallel.params import retie, shared_names
from megalm.parallel.random import TPRNG
from megalm.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                    vocab_parallel_cross_entropy)


@dataclass
class TPContext:
    """What a style needs to shard a module on this rank."""
    group: object
    sequence_parallel: bool
    rng: TPRNG
    device: object  # where the modules are built (meta)
    comm_overlap: bool = False  # parallel.tp_comm_overlap: the sp linears overlap their collectives with matmuls

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()


class ForkRNG(nn.Module):
    """Run a parameter-free module (dropout, attention core) under one of the tp RNG streams.

    Inside a compiled graph the stream cannot be forked: dynamo does not trace the generator's state
    being read and set, and would break the graph at each fork. There dropout (nn.Dropout, or an
    attention core's dropout) draws from the default generator instead, `size` times the numbers it needs,
    and keeps this rank's share (`rank`): every tp rank makes the same draw, so the default generator stays
    in step across the group as replicated dropout needs, and each rank's mask is its own. Another inner
    module is forked as eagerly, around a graph break, unless it takes its random numbers as a `uniform`
    argument (`takes_uniform`: an attention core; megalm.ops.attention.dropout_with), which it then gets."""

    def __init__(self, inner: nn.Module, rng: TPRNG, stream: str, rank: int = 0, size: int = 1,
                 takes_uniform: bool = False):
        super().__init__()
        self.inner, self.stream = inner, stream
        self._rng = rng  # not a submodule: it holds no parameters or buffers
        self.rank, self.size = rank, size
        self.takes_uniform = takes_uniform

    def forward(self, *args, **kwargs):
        if not self._draws():  # the stream would come back unchanged; skipping also keeps a compiled graph whole
            return self.inner(*args, **kwargs)
        if torch.compiler.is_compiling():
            if isinstance(self.inner, nn.Dropout):
                return dropout_with(args[0], self.inner.p, self._uniform)
            if self.takes_uniform:
                return self.inner(*args, uniform=self._uniform, **kwargs)
        with self._rng.fork(self.stream):
            return self.inner(*args, **kwargs)

    def _uniform(self, shape: torch.Size, device) -> torch.Tensor:
        """This rank's share of one draw of `size` x `shape` uniform numbers from the default generator."""
        return torch.rand((self.size, *shape), device=device)[self.rank]

    def _draws(self) -> bool:
        """Whether the inner module may draw random numbers now: not dropout (nn.Dropout's `p`, an
        attention core's `attention_dropout`) that is 0 or in eval mode; any other module may."""
        p = getattr(self.inner, "p", getattr(self.inner, "attention_dropout", None))
        return p is None or (p > 0 and self.inner.training)


class VocabParallelLMLoss(nn.Module):
    """LMLoss from vocabulary shards of the logits: the same value, no full-vocab tensor."""

    def __init__(self, group, vocab_start: int, vocab_size: int, label_smoothing: float = 0.0):
        super().__init__()
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.label_smoothing = label_smoothing

    def forward(self, logits, labels, loss_mask=None):
        losses = vocab_parallel_cross_entropy(logits, labels, self.group, vocab_start=self.vocab_start,
                                              vocab_size=self.vocab_size, label_smoothing=self.label_smoothing,
                                              ignore_index=IGNORE)
        return masked_mean(losses, loss_mask if loss_mask is not None else labels != IGNORE)

    def from_hidden(self, hidden, weight, labels, loss_mask=None, *, chunk_tokens: int, backward: str = "in_forward"):
        """LMLoss.from_hidden from this rank's vocabulary shard of the head weight (V/tp, h); `hidden` is
        the head's input after its collective (replicated over tp), whose gradient that collective sums."""
        return fused_masked_mean(hidden, weight, labels, loss_mask, backward=backward, vocab_size=self.vocab_size,
                                 chunk_tokens=chunk_tokens, vocab_start=self.vocab_start, group=self.group,
                                 label_smoothing=self.label_smoothing)

    @torch.no_grad()
    def correct(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """LMLoss.correct from vocabulary shards: the largest real logit is agreed with a max over
        the ranks, the label's logit comes from the rank holding its column."""
        logits = logits.float()
        ids = self.vocab_start + torch.arange(logits.shape[-1], device=logits.device)
        largest = logits.masked_fill(ids >= self.vocab_size, float("-inf")).max(-1).values
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        local = labels - self.vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        target = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target, group=self.group)
        return ((target >= largest) & (labels != IGNORE)).float()


def _mark_sequence_parallel(module: nn.Module) -> None:
    """Replicated parameters applied on sequence shards: their gradients are partial over tp."""
    for p in module.parameters(recurse=False):
        if getattr(p, "tp_shard", None) is None:
            p.sequence_parallel = True


# -- styles: each turns one module into its tensor-parallel form (a replacement, or None) -------
@dataclass(frozen=True)
class ColumnParallel:
    """nn.Linear → ColumnParallelLinear. `segments`: the widths of a fused output ([q | k | v]),
    each split across ranks; `rows`: the output width to build (a vocabulary padded for tp)."""
    segments: Optional[Tuple[int, ...]] = None
    rows: Optional[int] = None

    def apply(self, module: nn.Linear, ctx: TPContext) -> nn.Module:
        return ColumnParallelLinear(module.in_features, self.rows or module.out_features, bias=module.bias is not None,
                                    segments=self.segments, group=ctx.group, sequence_parallel=ctx.sequence_parallel,
                                    comm_overlap=ctx.comm_overlap, device=ctx.device)


@dataclass(frozen=True)
class RowParallel:
    """nn.Linear → RowParallelLinear (its bias, added on sequence shards, is tagged under sp)."""

    def apply(self, module: nn.Linear, ctx: TPContext) -> nn.Module:
        return RowParallelLinear(module.in_features, module.out_features, bias=module.bias is not None,
                                 group=ctx.group, sequence_parallel=ctx.sequence_parallel,
                                 comm_overlap=ctx.comm_overlap, device=ctx.device)


@dataclass(frozen=True)
class VocabParallel:
    """nn.Embedding → VocabParallelEmbedding of `rows` rows; `reduce` as that class takes it
    ("reduce_scatter" puts the lookup straight into sequence shards)."""
    rows: int
    reduce: str = "all_reduce"

    def apply(self, module: nn.Embedding, ctx: TPContext) -> nn.Module:
        return VocabParallelEmbedding(self.rows, module.embedding_dim, group=ctx.group, reduce=self.reduce,
                                      device=ctx.device)


@dataclass(frozen=True)
class VocabParallelLoss:
    """LMLoss → VocabParallelLMLoss over logits whose `rows` columns are split across ranks."""
    rows: int

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        return VocabParallelLMLoss(ctx.group, self.rows // ctx.size * ctx.rank, module.vocab_size,
                                   getattr(module, "label_smoothing", 0.0))


@dataclass(frozen=True)
class TPRandom:
    """A parameter-free module drawing different random numbers on each tp rank (dropout on
    sharded activations): run under the "tp" stream. `uniform`: the module takes its random numbers
    as a `uniform=` argument (an attention core's dropout), which a compiled graph hands it (ForkRNG)."""
    uniform: bool = False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        return ForkRNG(module, ctx.rng, "tp", ctx.rank, ctx.size, takes_uniform=self.uniform)


@dataclass(frozen=True)
class SequenceParallelParams:
    """A module applied to sequence shards (a norm): its replicated parameters get partial gradients."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        _mark_sequence_parallel(module)


@dataclass(frozen=True)
class ScatterSequence:
    """The module's output (B, T, h), replicated, is cut to this rank's sequence shard."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        group = ctx.group
        module.register_forward_hook(lambda mod, args, out: scatter_seq(out, group))


@dataclass(frozen=True)
class GatherSequence:
    """The module (replicated, reading the whole sequence: a pooler) takes sequence shards: gather
    its input first (backward keeps this rank's chunk of the gradient)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        group = ctx.group
        module.register_forward_pre_hook(lambda mod, args: (gather_seq_replicated(args[0], group), *args[1:]))


# -- applying a plan ----------------------------------------------------------------------------
def matches(pattern: str, path: str) -> bool:
    """`path` is the module `pattern` names; `*` matches one dotted segment."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatchcase(h, w) for w, h in zip(want, have))


def apply_plan(model: nn.Module, plan: Plan, ctx) -> None:
    """Apply each (pattern, style) of `plan` to the modules of `model` it matches, in place."""
    for pattern, style in plan:
        paths = [name for name, _ in model.named_modules() if name and matches(pattern, name)]
        for path in paths:
            new = style.apply(model.get_submodule(path), ctx)
            if new is not None:
                parent, _, leaf = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, new)


def apply_tensor_parallel(model: nn.Module, plan: Plan, group, *, sequence_parallel: bool, seed: int,
                          rng_device, comm_overlap: bool = False) -> TPRNG:
    """Shard `model` over `group` by `plan` (its family's tensor-parallel plan), in place; return the tp
    random streams its layers draw from (recomputation replays them, checkpoints save them)."""
    tied = shared_names(model)
    rng = TPRNG(seed, group.rank(), rng_device)  # the device training will run on; the model is on meta
    apply_plan(model, plan, TPContext(group, sequence_parallel, rng, next(model.parameters()).device, comm_overlap))
    retie(model, tied)  # a tied weight swapped on both sides is shared again
    return rng
