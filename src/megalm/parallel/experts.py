"""Expert parallelism (parallel.ep): each mixture-of-experts layer's experts split over ep ranks;
how a mixture runs under tensor and context parallelism (`split_tokens`); and expert tensor
parallelism (parallel.expert_tp: each expert split over the tp ranks, `split_experts`, `run_experts`).

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

from typing import Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalm.distributed.comm import _record
from megalm.parallel.tensor import TPShard


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


def apply_expert_parallel(model: nn.Module, group) -> None:
    """Keep this rank's E / ep experts of every MoE layer (on the meta device, before materialize)."""
    from megalm.models.moe import MoE, GroupedLinear
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        local = module.num_experts // world
        for name in ("fc1", "fc2"):
            old = getattr(module.experts, name).weight
            with torch.device(old.device):  # meta: no memory yet
                new = GroupedLinear(local, old.shape[1], old.shape[2])
            new.weight.ep_shard = TPShard(dim=0, rank=rank, world=world)
            setattr(module.experts, name, new)
        module.ep_group = group


def split_tokens(model: nn.Module, mesh, sequence_parallel: bool, expert_tp: bool = False) -> None:
    """Tensor and context parallelism of the MoE layers: each rank routes and computes its own tokens
    (tp: its sequence shard, cut here from the replicated sequence unless SP already did; cp: its
    chunks), with the router replicated over tp (whose ranks then hold partial gradients of it, summed
    over tp like SP's norms) and cp. The experts are replicated alike, or with `expert_tp` split over the
    tp ranks (`split_experts`). The aux losses are over every token of the group."""
    from megalm.models.moe import MoE
    tp, cp = mesh["tp"], mesh["cp"]
    if tp.size() == 1 and cp.size() == 1:
        return
    if tp.size() > 1 and cp.size() > 1:
        token_group = mesh["cp", "tp"]._flatten("cp_tp").get_group()
    else:
        token_group = (tp if tp.size() > 1 else cp).get_group()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        module.token_group = token_group
        if tp.size() > 1:
            module.split_group = None if sequence_parallel else tp.get_group()
            if expert_tp:
                split_experts(module, tp.get_group())
            for p in module.parameters():
                if getattr(p, "tp_shard", None) is None:
                    p.sequence_parallel = True


def split_experts(module: nn.Module, group) -> None:
    """Expert tensor parallelism: each of a MoE layer's experts split over the tp ranks as Megatron splits the
    dense MLP, fc1's columns (SwiGLU: gate's and up's alike) and fc2's rows, tagged `tp_shard` (the experts an
    ep rank holds keep their `ep_shard`). On the meta device, before materialize."""
    from megalm.models.moe import GroupedLinear
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    experts = module.experts
    fc1, fc2 = experts.fc1.weight, experts.fc2.weight
    local, hidden, ffn = fc1.shape[0], fc1.shape[1], fc2.shape[1]
    segments = (ffn, ffn) if experts.activation == "swiglu" else None
    with torch.device(fc1.device):  # meta: no memory yet
        experts.fc1 = GroupedLinear(local, hidden, fc1.shape[2] // world)
        experts.fc2 = GroupedLinear(local, ffn // world, hidden)
    experts.fc1.weight.tp_shard = TPShard(dim=2, rank=rank, world=world, segments=segments)
    experts.fc2.weight.tp_shard = TPShard(dim=1, rank=rank, world=world)
    for new, old in ((experts.fc1.weight, fc1), (experts.fc2.weight, fc2)):
        if getattr(old, "ep_shard", None) is not None:
            new.ep_shard = old.ep_shard
    module.expert_tp_group = group


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


def run_experts(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The outputs of this rank's experts for `rows`, sorted by expert (counts[e] rows of expert e), as one
    grouped computation. Under expert tensor parallelism (`tp_group`) each tp rank holds a slice of every
    expert: the ranks gather one another's rows (all-to-all, each rank's rows to every rank), each runs
    them all through its slices, giving partial sums of every row's output, and a second all-to-all returns
    each rank's rows, whose partial sums it adds (Megatron's column- then row-parallel MLP, over the tokens
    of the whole group)."""
    if tp_group is None:
        return experts(rows, torch.cumsum(counts, 0).to(torch.int32))
    from megalm.distributed.comm import _all_gather_single
    world, local = dist.get_world_size(tp_group), counts.numel()
    received = torch.empty(world * local, dtype=counts.dtype, device=counts.device)
    _all_gather_single(received, counts.contiguous(), group=tp_group)  # [tp rank, expert] counts
    received = received.view(world, local)
    n, arrive = rows.shape[0], received.sum(1).tolist()
    x = _all_to_all(rows.expand(world, *rows.shape).reshape(world * n, *rows.shape[1:]), arrive, [n] * world,
                    tp_group)
    y = _grouped(experts, x, received)
    return _all_to_all(y, [n] * world, arrive, tp_group).view(world, n, *y.shape[1:]).sum(0)


def _grouped(experts: nn.Module, x: torch.Tensor, received: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Experts' outputs for rows x that came from each source (received[source, expert] rows each, sorted by
    expert within a source), in arrival order: grouped by expert for one grouped computation, and back."""
    world, local = received.shape
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=received.device).repeat(world),
                                            received.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    y = run_experts(experts, x[by_expert], received.sum(0), tp_group)
    return y[torch.argsort(by_expert)]


def dispatch(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor, group, tp_group=None) -> torch.Tensor:
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
