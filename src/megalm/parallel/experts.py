"""Expert parallelism (parallel.ep): each mixture-of-experts layer's experts split over ep ranks;
how a mixture runs under tensor and context parallelism (each rank routing its own tokens); and expert
tensor parallelism (parallel.expert_tp: each expert split over the tp ranks, `run_experts`). All of it as
styles a family's expert plan puts around the parts of its mixture (`ExpertParallel` on the experts,
`TokenGroupLoad` on the expert load, `OwnSequenceShard` and `PartialOverTP` on the layer): the layer
itself holds no group and always just calls its experts.

The ep ranks are data-parallel ranks (ep divides dp, ep varying fastest within dp, as Megatron-Core
carves its expert-parallel groups out of data parallelism): each runs its own micro-batches through
the dense parts, and holds E / ep of every layer's experts (rank r: experts r E/ep .. (r+1) E/ep - 1,
tagged `ep_shard`, a dim-0 TPShard, so init and checkpoints place them in the full stack).

In a layer, each rank routes its own tokens exactly as one process would (so capacity, dropping and
the auxiliary losses are the single process's, per micro-batch), sorts the kept (token, expert)
assignments by expert, and `dispatch` sends each expert's rows to the rank holding it: an
all-to-all of the per-expert counts, then one all-to-all of the rows (`_AllToAll`, whose backward
is the reverse all-to-all). The receiver groups what came by local expert, runs its experts as one
grouped computation, puts the rows back in arrival order, and a second all-to-all returns them to
their tokens' ranks, which weight and sum them as without expert parallelism.

Gradients: a rank's expert weights gather the gradients of every ep rank's tokens; the ranks that
hold the same experts (the expert-data-parallel group: dp / ep of them, times cp under context
parallelism) sum them and, like every gradient, divide by dp (times cp): megalm.parallel.data's
DataParallel reduces the experts' buckets over that group, and ZeRO (1-3) shards them there. In the
gradient norm experts count once: summed over ep and, split by expert tp, over tp (or, as ZeRO shards,
over dp and tp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalm.distributed import comm
from megalm.distributed.comm import _record, gather_seq_replicated, scatter_seq
from megalm.distributed.shards import TPShard


def expert_groups(mesh, ep: int) -> Tuple[object, object]:
    """(this rank's ep group, its expert-data-parallel group): dp split into dp / ep blocks of ep
    consecutive dp ranks; the ep group is this rank's block, the edp group its position in every block
    and, under context parallelism, every cp rank (they hold the same experts and see other tokens):
    (dp / ep) x cp ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    pp, dp, cp, tp = (mesh[d].size() for d in ("pp", "dp", "cp", "tp"))
    ranks = mesh.mesh.reshape(pp, dp // ep, ep, cp, tp)
    experts = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
    edp = experts["edp", "cp"]._flatten("edp_cp") if cp > 1 else experts["edp"]
    return experts["ep"].get_group(), edp.get_group()


@dataclass(frozen=True)
class ExpertContext:
    """The groups a mixture's styles need on this rank (None: that parallelism is off)."""
    ep_group: Optional[object] = None
    """The ranks splitting each layer's experts (parallel.ep)."""
    tp_group: Optional[object] = None
    """Expert tensor parallelism (parallel.expert_tp): the tp group each expert is split over."""
    token_group: Optional[object] = None
    """The ranks a micro-batch's tokens are split over in a layer (tp, cp, or both): its load is theirs."""
    split_group: Optional[object] = None
    """tp without sequence parallelism: the layer cuts its replicated input into tp shards itself."""
    partial: bool = False
    """tp > 1: each tp rank routes its own tokens, so replicated parameters get partial gradients."""


def expert_context(mesh, ep: int, expert_tp: bool, sequence_parallel: bool, ep_group=None) -> ExpertContext:
    """This rank's ExpertContext of `mesh` (`ep_group`: its ep group from `expert_groups`, when ep > 1)."""
    tp, cp = mesh["tp"], mesh["cp"]
    token_group = None
    if tp.size() > 1 and cp.size() > 1:
        token_group = mesh["cp", "tp"]._flatten("cp_tp").get_group()
    elif tp.size() > 1 or cp.size() > 1:
        token_group = (tp if tp.size() > 1 else cp).get_group()
    split = tp.size() > 1
    return ExpertContext(ep_group=ep_group if ep > 1 else None,
                         tp_group=tp.get_group() if split and expert_tp else None, token_group=token_group,
                         split_group=tp.get_group() if split and not sequence_parallel else None, partial=split)


# -- styles: each applies to one module of a mixture, by the family's expert plan -----------------
@dataclass(frozen=True)
class ExpertParallel:
    """The experts module (fc1 and fc2 holding stacked weights (E, in, out); called as `experts(rows,
    counts)` on rows sorted by expert): under expert parallelism this rank keeps E / ep of them (rank r:
    experts r E/ep .. (r+1) E/ep - 1, tagged `ep_shard`), and its call sends the rows to the ranks holding
    their experts and brings the outputs back (`dispatch`); under expert tensor parallelism each expert is
    split over tp as Megatron splits the dense MLP, fc1's columns and fc2's rows (tagged `tp_shard`;
    `fc1_segments`: the column segments split alike, SwiGLU's [gate | up]), and its call runs every tp
    rank's rows through this rank's slices (`run_experts`). On the meta device, before materialize."""
    fc1_segments: Optional[Tuple[int, ...]] = None

    def apply(self, module: nn.Module, ctx: ExpertContext) -> None:
        if ctx.ep_group is None and ctx.tp_group is None:
            return
        if ctx.ep_group is not None:
            rank, world = dist.get_rank(ctx.ep_group), dist.get_world_size(ctx.ep_group)
            for linear in (module.fc1, module.fc2):
                old = linear.weight
                linear.weight = nn.Parameter(old.new_empty((old.shape[0] // world, *old.shape[1:])))
                linear.weight.ep_shard = TPShard(dim=0, rank=rank, world=world)
        if ctx.tp_group is not None:
            rank, world = dist.get_rank(ctx.tp_group), dist.get_world_size(ctx.tp_group)
            for linear, dim, segments in ((module.fc1, 2, self.fc1_segments), (module.fc2, 1, None)):
                old = linear.weight
                shape = list(old.shape)
                shape[dim] //= world
                linear.weight = nn.Parameter(old.new_empty(shape))
                linear.weight.tp_shard = TPShard(dim=dim, rank=rank, world=world, segments=segments)
                if getattr(old, "ep_shard", None) is not None:
                    linear.weight.ep_shard = old.ep_shard
        local = module.forward  # the experts this rank holds, on rows sorted by (local) expert
        if ctx.ep_group is not None:
            module.forward = functools.partial(dispatch, local, group=ctx.ep_group, tp_group=ctx.tp_group)
        else:
            module.forward = functools.partial(run_experts, local, tp_group=ctx.tp_group)


@dataclass(frozen=True)
class TokenGroupLoad:
    """The expert load (counts (E,), tokens N) of this rank's tokens becomes its token group's, the whole
    micro-batch's, over which the auxiliary losses are defined: the counts summed, N times the group."""

    def apply(self, module: nn.Module, ctx: ExpertContext) -> None:
        group = ctx.token_group
        if group is None:
            return

        def hook(mod, args, out):
            counts, tokens = out
            counts = counts.clone()
            dist.all_reduce(counts, group=group)
            return counts, tokens * dist.get_world_size(group)

        module.register_forward_hook(hook)


@dataclass(frozen=True)
class OwnSequenceShard:
    """Under tp without sequence parallelism a layer's input is the whole (replicated) sequence: the layer
    routes this rank's shard of it and gathers the outputs. Training's sequences divide evenly (validated);
    a prompt, or one decoded token, is made up to a multiple of tp with zero rows, cut off after."""

    def apply(self, module: nn.Module, ctx: ExpertContext) -> None:
        if ctx.split_group is None:
            return
        module.forward = functools.partial(_on_own_shard, module.forward, ctx.split_group)


def _on_own_shard(forward: Callable, group, x: torch.Tensor) -> torch.Tensor:
    T = x.shape[1]
    pad = -T % dist.get_world_size(group)
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    out = gather_seq_replicated(forward(scatter_seq(x, group)), group)
    return out[:, :T] if pad else out


@dataclass(frozen=True)
class PartialOverTP:
    """Each tp rank routes its own tokens, so the layer's parameters replicated over tp (the router; the
    experts unless expert tp splits them) get partial gradients, summed over tp like SP's norms'
    (tagged `sequence_parallel`)."""

    def apply(self, module: nn.Module, ctx: ExpertContext) -> None:
        if not ctx.partial:
            return
        for p in module.parameters():
            if getattr(p, "tp_shard", None) is None:
                p.sequence_parallel = True


class _AllToAll(torch.autograd.Function):
    """Rows to and from the ranks of `group`; backward sends the rows' gradients back the way they came.
    (Written here: torch.distributed.nn's autograd all-to-all is deprecated, and the functional collectives'
    replacement bypasses torch.distributed.all_to_all_single, where tests count the collectives a step makes.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        with _record("all_to_all", x.numel() * x.element_size()):
            dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        with _record("all_to_all", grad.numel() * grad.element_size()):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """Rows of x to the ranks (in_splits of them to each), rows from them (out_splits), with autograd."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def run_experts(experts: Callable, rows: torch.Tensor, counts: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The outputs of this rank's experts (`experts(rows, counts)`, one grouped computation) for `rows`,
    sorted by expert (counts[e] rows of expert e). Under expert tensor parallelism (`tp_group`) each tp rank holds a slice of every
    expert: the ranks gather one another's rows (all-to-all, each rank's rows to every rank), each runs
    them all through its slices, giving partial sums of every row's output, and a second all-to-all returns
    each rank's rows, whose partial sums it adds (Megatron's column- then row-parallel MLP, over the tokens
    of the whole group)."""
    if tp_group is None:
        return experts(rows, counts)
    world, local = dist.get_world_size(tp_group), counts.numel()
    received = torch.empty(world * local, dtype=counts.dtype, device=counts.device)
    comm._all_gather_single(received, counts.contiguous(), group=tp_group)  # [tp rank, expert] counts
    received = received.view(world, local)
    n, arrive = rows.shape[0], received.sum(1).tolist()
    x = _all_to_all(rows.expand(world, *rows.shape).reshape(world * n, *rows.shape[1:]), arrive, [n] * world,
                    tp_group)
    y = _grouped(experts, x, received)
    return _all_to_all(y, [n] * world, arrive, tp_group).view(world, n, *y.shape[1:]).sum(0)


def _grouped(experts: Callable, x: torch.Tensor, received: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Experts' outputs for rows x that came from each source (received[source, expert] rows each, sorted by
    expert within a source), in arrival order: grouped by expert for one grouped computation, and back."""
    world, local = received.shape
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=received.device).repeat(world),
                                            received.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    y = run_experts(experts, x[by_expert], received.sum(0), tp_group)
    return y[torch.argsort(by_expert)]


def dispatch(experts: Callable, rows: torch.Tensor, counts: torch.Tensor, group, tp_group=None) -> torch.Tensor:
    """The experts' outputs for `rows` (sorted by global expert, counts[e] of expert e), computed on the
    ranks holding the experts: rows out, grouped computation there (over tp too under expert tensor
    parallelism: `run_experts`), rows back."""
    world = dist.get_world_size(group)
    local = counts.numel() // world
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)  # [source, my expert] counts
    received = received.view(world, local)
    send = counts.view(world, local).sum(1).tolist()
    arrive = received.sum(1).tolist()
    x = _all_to_all(rows, arrive, send, group)
    y = _grouped(experts, x, received, tp_group)
    return _all_to_all(y, send, arrive, group)
