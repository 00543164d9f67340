"""Data parallelism: bucketed gradient reduction overlapped with backward, and ZeRO stages 1 and 2.

Parameters are grouped, in roughly the order backward produces their gradients (the reverse of
registration), into buckets of `parallel.bucket_size_mb`. A post-accumulate-grad hook counts how
many times each parameter's gradient was accumulated in the step; when it reaches the number a
whole step accumulates (every micro-batch, under any pipeline schedule), the gradient is copied
into its bucket's flat buffer and freed, and a bucket whose gradients are all in launches its
collective asynchronously while backward goes on. So gradient accumulation never communicates
on non-final micro-batches, and one collective moves a whole bucket. The count per step is
learned in the first step (which reduces every bucket after backward), since it depends on the
schedule (ZBV runs a tied embedding and head as two stages of one rank, so two accumulations a
micro-batch).

- zero_stage 0: all-reduce each bucket; gradients are averaged and replicated.
- zero_stage 1 (Megatron's distributed optimizer; ZeRO, arXiv:1910.02054): reduce-scatter each
  bucket in place, so rank r holds the averaged gradient of the r-th 1/dp of the bucket; the optimizer
  state exists only for that shard; after the update each bucket's parameters are all-gathered.
  Parameters are views into the buckets' flat parameter buffers, so the all-gather writes the
  model in place. A reduce-scatter plus an all-gather move what one all-reduce moves.
- zero_stage 2: as 1, and the full gradient buffer of a bucket is freed once it is scattered, so
  between steps a rank holds only its 1/dp of the gradients.
- overlap_param_gather (ZeRO 1/2): the all-gathers after the update are launched in forward order
  and left running; a forward pre-hook on each module holding a bucket's weights waits for that
  bucket, so the gathers of later layers move while earlier layers compute (Megatron's
  overlap-param-gather). Whatever reads the weights outside a forward (a checkpoint, evaluation,
  the next update) calls `wait_params` first.

Main parameters (`param_dtype` bf16 / fp16: trainer.mixed_precision=main_params, Megatron's mixed
precision, arXiv:1710.03740): the model's weights are held in that dtype (flat per-bucket buffers
the parameters view) and the optimizer updates fp32 main parameters beside them: this rank's 1/dp
of each bucket under ZeRO 1-3, the whole bucket under ZeRO-0 (and in a single process, which then
has buckets too). The buckets' fp32 gradient buffers are the main gradients: every accumulation of
a weight's gradient (each micro-batch, each schedule's weight pass) is added into its bucket at
once and the low-precision gradient freed, so accumulation runs in fp32 and no op casts a weight.
After the update the main parameters are cast into the weights, and ZeRO 1/2 all-gather them in
the weights' dtype.

Why not torch's DDP and ZeroRedundancyOptimizer: DDP must wrap the module a schedule calls, but a
pipeline stage here is a view over a shared model and zero-bubble schedules split backward into
input and weight passes, which DDP's reducer does not follow; ZeroRedundancyOptimizer assigns
whole parameters to ranks and broadcasts them, moving more than a reduce-scatter + all-gather and
leaving a state dict DCP cannot reshard. ZeRO-3 (`megalm.parallel.zero3`) extends this class;
`megalm.parallel.build_data_parallel` picks the one a run needs.

Replicated-across-tp gradients (sequence-parallel norms) are summed over tp and the tied
embedding's over the embedding group after the dp reduction, on whatever this rank holds (the
full gradient, or its shard: ranks of one tp or embedding group lay out their buckets alike, and
the tied embedding gets a bucket of its own so both stages shard it identically).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megalm.distributed.async_comm import bucket_all_gather, bucket_all_reduce, bucket_reduce_scatter
from megalm.distributed.mesh import replica_mesh
from megalm.parallel.grads import sum_replicas
from megalm.parallel.optim_state import create_state

# Tags of a model parameter that its ZeRO shard carries (for the norm and the replica sums).
SHARD_TAGS = ("tp_shard", "ep_shard", "sequence_parallel", "tied_copy_of")


@dataclass
class Shard:
    """The part of one parameter that this rank's optimizer owns: param.view(-1)[start:stop]."""
    param: nn.Parameter
    start: int
    stop: int
    tensor: torch.Tensor  # a 1-D leaf aliasing those elements of the parameter's storage
    local: slice          # where those elements sit in the bucket's gradient shard


@dataclass
class Bucket:
    params: List[nn.Parameter]
    offsets: List[int]
    size: int        # elements, padded to a multiple of dp
    shard_size: int  # size / dp
    grad: Optional[torch.Tensor] = None        # full flat gradient
    grad_shard: Optional[torch.Tensor] = None  # this rank's reduced chunk (zero >= 1)
    param_buf: Optional[torch.Tensor] = None   # flat parameters the model's params view (zero >= 1, main params)
    main: Optional[torch.Tensor] = None        # fp32 main parameters of this rank's chunk (main params)
    shards: List[Shard] = field(default_factory=list)
    ready: int = 0
    work: object = None
    # ZeRO-3 (megalm.parallel.zero3): this rank's chunk of the parameters, kept while param_buf's
    # storage is freed; whether param_buf holds them now; what still needs them.
    param_shard: Optional[torch.Tensor] = None
    gathered: bool = True
    gather_work: object = None
    pending: set = field(default_factory=set)  # parameters whose gradient this micro-batch is due
    in_use: bool = False                       # inside its unit's forward
    # The group its collectives run over (dp; the expert-data-parallel group for experts' weights
    # split by expert parallelism), its size, and this rank's place in it.
    group: object = None
    world: int = 1
    rank: int = 0


def bucket_elements(bucket_size_mb: Optional[float], replicas: int) -> int:
    """Parameters a gradient bucket holds at most: `bucket_size_mb` MiB of fp32 gradient, or by default (None)
    Megatron-Core's size by parameter count, max(40M, 1M x the data-parallel ranks) (its DDP's default bucket_size,
    the ranks counted with context parallelism: here the replicas, dp x cp), so each rank's share of a bucket's
    reduce-scatter stays at least 1M elements however wide dp grows."""
    if bucket_size_mb is not None:
        return int(bucket_size_mb * 2**20 / 4)
    return max(40_000_000, 1_000_000 * replicas)


def capped_groups(params: List[nn.Parameter], cap: int, alone: Optional[nn.Parameter] = None) -> List[List[nn.Parameter]]:
    """`params` in reverse order (backward produces the last layers' gradients first), cut into groups of
    at most `cap` elements (a larger parameter alone); `alone` gets a group of its own where it falls."""
    groups: List[List[nn.Parameter]] = []
    current: List[nn.Parameter] = []
    filled = 0
    for p in reversed(params):
        if p is alone:
            groups.append([p])
            continue
        if current and filled + p.numel() > cap:
            groups.append(current)
            current, filled = [], 0
        current.append(p)
        filled += p.numel()
    if current:
        groups.append(current)
    return groups


class DataParallel:
    """Gradient synchronisation of one rank's model over dp (and its tp / embedding replicas)."""

    def __init__(self, model: nn.Module, mesh, layout, zero_stage: int = 0, bucket_size_mb: Optional[float] = None,
                 param_dtype: Optional[torch.dtype] = None, overlap_param_gather: bool = False):
        """`mesh` None: a single process (main parameters only). `param_dtype`: hold the weights in this
        dtype, with fp32 main parameters and main gradients (the module docstring); None: as they are.
        `overlap_param_gather`: ZeRO 1/2's all-gathers waited on at first use (the module docstring)."""
        self.model, self.zero_stage, self.param_dtype = model, zero_stage, param_dtype
        self.overlap_param_gather = overlap_param_gather and zero_stage in (1, 2)
        if mesh is None:
            self.dp, self.dp_rank, self.dp_group, self.tp_group = 1, 0, None, None
        else:
            dp = replica_mesh(mesh)  # dp, or dp x cp under context parallelism: every rank with the same weights
            self.dp, self.dp_rank, self.dp_group = dp.size(), dp.get_local_rank(), dp.get_group()
            self.tp_group = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
        # Experts split by expert parallelism (tagged ep_shard) are reduced over the ranks holding the same
        # experts (expert data parallel: dp / ep of them) and, like every gradient, divided by dp.
        self.edp_group = getattr(layout, "edp_group", None)
        self.edp = dist.get_world_size(self.edp_group) if self.edp_group is not None else self.dp
        self.edp_rank = dist.get_rank(self.edp_group) if self.edp_group is not None else self.dp_rank
        self.embedding_group = layout.embedding_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tied = layout.tied_param(model)  # summed over the embedding group
        self.buckets: List[Bucket] = []
        self.where: Dict[nn.Parameter, tuple] = {}
        self.expected: Optional[Dict[nn.Parameter, int]] = None  # accumulations per step, from step 1
        self.counts: Dict[nn.Parameter, int] = {}
        self.done: set = set()  # parameters whose gradient is in its bucket this step
        if self.dp == 1 and zero_stage == 0 and not self.main_params:
            return  # nothing to reduce over dp: gradients stay where autograd puts them
        device = self.params[0].device
        self._build_buckets(bucket_elements(bucket_size_mb, self.dp), device)
        if self.has_shards:
            self._shard_parameters(device)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        if self.overlap_param_gather:
            self._hook_first_uses()

    # -- layout ----------------------------------------------------------------------------------
    def _param_groups(self, cap: int) -> List[List[nn.Parameter]]:
        """Parameters of each bucket, in the order backward produces their gradients; experts split by
        expert parallelism in buckets of their own (another group reduces them)."""
        groups: List[List[nn.Parameter]] = []
        for experts in (False, True):
            params = [p for p in self.params if (getattr(p, "ep_shard", None) is not None) == experts]
            # the tied weight in a bucket of its own: both stages of the embedding group shard it alike
            groups += capped_groups(params, cap, alone=self.tied)
        return groups

    def _build_buckets(self, cap: int, device) -> None:
        groups = self._param_groups(cap)
        for params in groups:
            offsets, n = [], 0
            for p in params:
                offsets.append(n)
                n += p.numel()
            if getattr(params[0], "ep_shard", None) is not None:
                group, world, rank = self.edp_group, self.edp, self.edp_rank
            else:
                group, world, rank = self.dp_group, self.dp, self.dp_rank
            size = math.ceil(n / world) * world
            bucket = Bucket(params, offsets, size, size // world, group=group, world=world, rank=rank)
            lo = rank * bucket.shard_size
            if self.zero_stage <= 1:  # persistent full gradient buffer; zero 2 allocates it per step
                bucket.grad = torch.zeros(size, dtype=torch.float32, device=device)
            if self.zero_stage == 1:  # reduce-scattered in place, as Megatron's distributed optimizer
                bucket.grad_shard = bucket.grad[lo:lo + bucket.shard_size]
            elif self.zero_stage == 0:  # main params: the optimizer's gradient is the whole bucket
                bucket.grad_shard = bucket.grad
            elif self.zero_stage >= 2:
                bucket.grad_shard = torch.zeros(bucket.shard_size, dtype=torch.float32, device=device)
            for i, p in enumerate(params):
                self.where[p] = (bucket, offsets[i])
            self.buckets.append(bucket)

    def _owned_range(self, b: Bucket) -> Tuple[int, int]:
        """The elements of bucket `b` whose optimizer state this rank holds: its 1/dp, or all of it."""
        if self.sharded:
            return b.rank * b.shard_size, (b.rank + 1) * b.shard_size
        return 0, b.size

    def _shard_parameters(self, device) -> None:
        """Move parameters into flat per-bucket buffers (in the weights' dtype) and cut out this rank's shard
        of each: a view of the buffer, or of the fp32 main parameters beside it."""
        for b in self.buckets:
            b.param_buf = torch.zeros(b.size, dtype=self.param_dtype or self.params[0].dtype, device=device)
            lo, hi = self._owned_range(b)
            if self.main_params:
                b.main = torch.zeros(hi - lo, dtype=torch.float32, device=device)
            for p, off in zip(b.params, b.offsets):
                view = b.param_buf[off:off + p.numel()]
                start, stop = max(lo, off) - off, min(hi, off + p.numel()) - off
                if self.main_params and start < stop:  # from the fp32 weights, before they are rounded
                    b.main[off + start - lo:off + stop - lo].copy_(p.detach().reshape(-1)[start:stop])
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                if start >= stop:
                    continue
                local = slice(off + start - lo, off + stop - lo)
                t = nn.Parameter(self._optimized(b)[local], requires_grad=True)  # an alias
                t.grad = b.grad_shard[local]
                for tag in SHARD_TAGS:
                    if hasattr(p, tag):
                        setattr(t, tag, getattr(p, tag))
                b.shards.append(Shard(p, start, stop, t, local))

    def _owned(self, b: Bucket) -> torch.Tensor:
        """This rank's chunk of bucket `b`'s weights, in their dtype (what the all-gather sends)."""
        lo, hi = self._owned_range(b)
        return b.param_buf[lo:hi]

    def _optimized(self, b: Bucket) -> torch.Tensor:
        """What the optimizer updates of bucket `b`: the fp32 main parameters, or the weights themselves."""
        return b.main if self.main_params else self._owned(b)

    @property
    def shards(self) -> List[Shard]:
        return [s for b in self.buckets for s in b.shards]

    @property
    def sharded(self) -> bool:
        """ZeRO 1-3: the optimizer state (and main parameters) split over dp."""
        return self.zero_stage >= 1

    @property
    def main_params(self) -> bool:
        return self.param_dtype is not None

    @property
    def has_shards(self) -> bool:
        """The optimizer runs on Shards (flat views of buckets) rather than on the model's parameters."""
        return self.sharded or self.main_params

    @property
    def grad_params(self) -> List[torch.Tensor]:
        """The tensors holding this rank's final gradients: the parameters, or their ZeRO shards."""
        return [s.tensor for s in self.shards] if self.has_shards else self.params

    # -- backward --------------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if self.main_params:
            self._add_to_main(p)
        if self.expected is None:  # first step: learn how many accumulations a step makes
            self.counts[p] = self.counts.get(p, 0) + 1
            return
        count = self.counts[p] = self.counts.get(p, 0) + 1
        if count > self.expected[p]:
            raise RuntimeError(f"a gradient was accumulated {count} times in one step, more than the "
                               f"{self.expected[p]} of the first step; its bucket was already reduced")
        if count == self.expected[p]:
            self._ready(p)

    def _main_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's slice of its bucket's fp32 gradient buffer (allocated, zero, when the step has none yet)."""
        bucket, off = self.where[p]
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.size, dtype=torch.float32, device=p.device)
        return bucket.grad[off:off + p.numel()]

    def _add_to_main(self, p: nn.Parameter) -> None:
        """Main params: add p's low-precision gradient into its fp32 main gradient and free it."""
        if p.grad is not None:
            self._main_grad(p).add_(p.grad.reshape(-1))
            p.grad = None

    def absorb(self, params) -> None:
        """Main params: move gradients that were assigned without an accumulate hook (a zero-bubble schedule's
        weight pass adds them in place) into the fp32 main gradients; call after each such pass."""
        if self.main_params:
            for p in params:
                if p in self.where:
                    self._add_to_main(p)

    def _ready(self, p: nn.Parameter) -> None:
        bucket = self.where[p][0]
        dst = self._main_grad(p)
        if self.main_params:
            self._add_to_main(p)  # accumulated in place already; a gradient no hook saw joins here
        elif p.grad is None:
            dst.zero_()
        else:
            dst.copy_(p.grad.reshape(-1))
        p.grad = None
        self.done.add(p)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, b: Bucket) -> None:
        if b.group is None or (b.world == 1 and not self.sharded):  # one rank: nothing to sum
            return
        if self.sharded:
            b.work = bucket_reduce_scatter(b.grad_shard, b.grad, b.group, async_op=True)
        else:
            b.work = bucket_all_reduce(b.grad, b.group, async_op=True)

    def finish(self) -> None:
        """After the step's backward: wait for every bucket, average, and sum the replicas."""
        self.wait_params()  # a weight no forward used: its gather is done before the update writes its source
        if self.buckets:
            for b in self.buckets:  # first step, or a parameter that got no gradient: launch now
                for p in b.params:
                    if p not in self.done:
                        self._ready(p)
            if self.expected is None:
                self.expected = {p: self.counts.get(p, 1) for p in self.params}
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                b.work, b.ready = None, 0
                if self.sharded:
                    b.grad_shard.div_(self.dp)
                    if self.zero_stage >= 2:
                        b.grad = None
                else:
                    if self.dp > 1:
                        b.grad.div_(self.dp)
                    if not self.main_params:  # (with main params the shards' gradients view the bucket)
                        for p, off in zip(b.params, b.offsets):
                            p.grad = b.grad[off:off + p.numel()].view_as(p)
            self.counts.clear()
            self.done.clear()
        self._sum_replicas()

    def _sum_replicas(self) -> None:
        grads = [(t, t.grad) for t in self.grad_params if t.grad is not None]
        sp = [g for t, g in grads if getattr(t, "sequence_parallel", False)]
        tied = []
        if self.tied is not None:
            if self.has_shards:
                tied = [s.tensor.grad for s in self.shards if s.param is self.tied]
            else:
                if self.tied.grad is None:
                    self.tied.grad = torch.zeros_like(self.tied)
                tied = [self.tied.grad]
        sum_replicas(sp, self.tp_group, tied, self.embedding_group)

    # -- after the update ------------------------------------------------------------------------
    @torch.no_grad()
    def cast_main_params(self) -> None:
        """Main params: round this rank's fp32 main parameters into its chunk of the weights."""
        if self.main_params:
            for b in self.buckets:
                self._owned(b).copy_(b.main)

    def gather_params(self) -> None:
        """After an update (or a load): the weights from the main parameters, and under ZeRO 1/2 every
        rank gets every bucket's updated parameters (in place in the model): waited on now, or, with
        overlap_param_gather, where the next forward first uses them."""
        self.cast_main_params()
        if not self.sharded:
            return
        for b in reversed(self.buckets):  # forward order: the first layers' buckets are needed first
            # in place: this rank's chunk is already where the output wants it
            b.gather_work = bucket_all_gather(b.param_buf, self._owned(b), b.group, async_op=True)
        if not self.overlap_param_gather:
            self.wait_params()

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still running (overlap_param_gather)."""
        for b in self.buckets:
            self._wait_gather(b)

    def _wait_gather(self, b: Bucket) -> None:
        if b.gather_work is not None:
            b.gather_work.wait()
            b.gather_work = None

    def _hook_first_uses(self) -> None:
        """A forward pre-hook on every module holding weights of a bucket: wait for those buckets' gathers."""
        for module in self.model.modules():
            buckets = []
            for p in module.parameters(recurse=False):
                b = self.where.get(p, (None,))[0]
                if b is not None and all(b is not x for x in buckets):  # identity: a dataclass's == compares tensors
                    buckets.append(b)
            if buckets:
                # torch.compile (trainer.compile) runs the wait eagerly between its graphs rather than tracing it
                module.register_forward_pre_hook(torch.compiler.disable(functools.partial(self._before_use, buckets)))

    def _before_use(self, buckets: List[Bucket], module: nn.Module, args) -> None:
        for b in buckets:
            self._wait_gather(b)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.main_params and self.zero_stage <= 1:  # the main gradients accumulate: clear them
            for b in self.buckets:
                b.grad.zero_()
        self.counts.clear()
        self.done.clear()

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds (a tied weight counted once), main parameters not included."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def main_param_bytes(self) -> int:
        """Bytes of fp32 main parameters this rank holds (0 without them)."""
        return sum(b.main.numel() * b.main.element_size() for b in self.buckets if b.main is not None)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now: its buckets (whose views the parameters'
        gradients are after `finish`), or the parameters' own gradients when there are none."""
        if not self.buckets:
            return sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        total = 0
        for b in self.buckets:
            if b.grad is not None:
                total += b.grad.numel() * b.grad.element_size()
            if self.zero_stage >= 2:  # its own buffer (under ZeRO-1 it is a view of b.grad)
                total += b.grad_shard.numel() * b.grad_shard.element_size()
        return total


class ZeroOptimizer:
    """A torch optimizer over this rank's ZeRO shards; each step ends with the parameter all-gather.

    Its state lives on the flat shards; a checkpoint writes it as blocks of the parameter-shaped
    tensors an unsharded optimizer has (megalm.training.sharded_state), so a checkpoint moves
    freely between zero stages and dp degrees.
    """

    def __init__(self, inner: torch.optim.Optimizer, dp: DataParallel):
        self.inner, self.dp = inner, dp

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self) -> None:
        self.inner.step()
        self.dp.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dp.zero_grad()  # the shards' gradients are views into the buckets and stay

    def _ensure_state(self) -> None:
        """Create the optimizer's lazy state (Adam's moments) without changing its first step (optim_state.py)."""
        create_state(self.inner, [s.tensor for s in self.dp.shards])
