"""Pipeline parallelism: split a model's layers into stages and run micro-batches through them
with the schedules of `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B, zero bubble).

Each rank keeps ONE model module holding just its layers (they keep their global keys; the
modules the family runs before the layers live on the first stage, those after them on the
last: megalm.family.Parts), so parameter names, the optimizer and checkpoints look the
same as at pp = 1. The pipeline stages handed to the schedule are thin views that run the
model's own forward over a layer range (`part=`); with virtual stages (interleaved schedules) a
rank holds v of them: rank r runs virtual stages r, r + pp, r + 2 pp, ... as in Megatron
(arXiv:2104.04473, sec. 2.2). What one stage's forward returns (a tensor or a tuple of them)
is what crosses to the next.

A tied weight split across the first and last stage (the embedding and the output head) is two
copies, initialised from the same global name; their gradients are summed over the pair of
ranks holding them (Megatron's embedding group), so both copies take the same update and stay
equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from megalm.config import ParallelConfig
from megalm.distributed.comm import record_p2p
from megalm.family import Family, Part, Parts
from megalm.parallel.context import weighted_loss
from megalm.parallel.stages import MULTI_STAGE, virtual_stages_of


def keep_stage_parts(model: nn.Module, parts: Parts, layers: Sequence[int], first: bool, last: bool) -> None:
    """Drop from the meta-device model what this rank's stages do not run."""
    held = getattr(model, parts.layers)
    for key in list(held.keys()):
        if int(key) not in layers:
            del held[key]
    for name in (() if first else parts.first) + (() if last else parts.last):
        setattr(model, name, None)


class StageView(nn.Module):
    """One pipeline stage: the model's forward over layers `layers` (and the first / last parts).

    It registers only its own parts as submodules: the schedule scales and zeroes gradients per
    stage, so a rank's two stages must not both claim every parameter of the rank's model.
    """

    def __init__(self, model: nn.Module, parts: Parts, layers: range, first: bool, last: bool):
        super().__init__()
        held = getattr(model, parts.layers)
        self.layers = nn.ModuleList([held[str(i)] for i in layers])  # shared, not copied
        for name in (parts.first if first else ()) + (parts.last if last else ()):
            setattr(self, name, getattr(model, name))
        self.part = Part(tuple(layers), first, last)
        self._forward = model.forward  # a bound method: no module registration

    def forward(self, *inputs: torch.Tensor):
        return self._forward(*inputs, part=self.part)


@dataclass
class Pipeline:
    """What the trainer needs to run a step through the pipeline on this rank."""
    schedule: Optional[object]  # set by build_pipeline right after construction
    stages: List[object]
    has_first: bool
    has_last: bool
    last_rank: int  # global rank holding the last stage, in this rank's pp group
    group: object   # the pp process group
    loss_fn: object  # the model's loss(output, batch)
    inputs: Tuple[str, ...]  # the batch keys the first stage takes (the family's inputs)
    n_microbatches: int
    num_stages: int
    owner: List[int]  # global rank running each stage
    rank: int
    metrics_fn: Optional[object] = None  # the model's loss_and_metrics(output, batch), when it reports any
    num_metrics: int = 0
    optional: Tuple[str, ...] = ()  # batch keys the first stage also takes when the batch has them

    def _keys(self, batch: Dict[str, torch.Tensor]) -> Tuple[str, ...]:
        return self.inputs + tuple(k for k in self.optional if k in batch)
    last_metrics: Optional[torch.Tensor] = None
    """The mean of the model's metrics over the last step's micro-batches, on every pp rank."""
    _batch: Optional[Dict[str, torch.Tensor]] = None  # the batch of the step in flight
    _loss_scale: float = 1.0  # and its fp16 loss scale (step's argument)
    _metrics: Optional[List[torch.Tensor]] = None

    def _micro_batch_loss(self, output, index: torch.Tensor) -> torch.Tensor:
        """The model's loss on the samples `index` of the batch in flight: the schedule splits a
        target tensor only, so it carries sample indices and the loss gathers the batch's fields."""
        batch = {k: v[index] for k, v in self._batch.items()}
        if self.metrics_fn is None:
            return weighted_loss(self.loss_fn(output, batch), batch)
        loss, values = self.metrics_fn(output, batch)
        self._metrics.append(values)
        return weighted_loss(loss, batch)

    def train_loss(self, output, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: scaled by 1/m here rather than by the schedule's gradient scaling,
        which runs once per stage and would scale a weight shared by two stages of one rank (ZBV's
        tied embedding and head) twice; the fp16 loss scale multiplies in here too."""
        return self._micro_batch_loss(output, index) * (self._loss_scale / self.n_microbatches)

    def step(self, batch: Dict[str, torch.Tensor], train: bool = True, loss_scale: float = 1.0) -> torch.Tensor:
        """Run a batch (dict of (B, ...) tensors) split into the schedule's micro-batches; the mean
        loss on every pp rank. `loss_scale`: fp16's current loss scale, which the losses carry in backward."""
        self._batch, self._metrics, self._loss_scale = batch, [], loss_scale
        try:
            if not train:
                return self._forward_only(batch)
            losses: List[torch.Tensor] = []
            index = torch.arange(len(batch[self.inputs[0]]), device=batch[self.inputs[0]].device)
            self.schedule.step(*(tuple(batch[k] for k in self._keys(batch)) if self.has_first else ()),
                               target=index if self.has_last else None,
                               losses=losses if self.has_last else None, return_outputs=False)
            # The schedule's loss is each micro-batch's mean x scale / n_microbatches: undo both.
            return self._share([l.detach().float() * (self.n_microbatches / loss_scale) for l in losses])
        finally:
            self._batch = self._metrics = None
            self._loss_scale = 1.0

    @torch.no_grad()
    def _forward_only(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Evaluation: each micro-batch walks the stages in order with plain sends and receives.

        The schedules' own eval mode does not run multi-stage (interleaved, zero bubble) schedules
        in this torch version, and evaluation needs no overlap, so this loop is kept simple.
        """
        views = {stage.stage_index: stage.submod for stage in self.stages}
        losses = []
        size = len(batch[self.inputs[0]])
        for index in torch.arange(size, device=batch[self.inputs[0]].device).chunk(self.n_microbatches):
            x = None
            for s in sorted(views):  # this rank's stages in pipeline order
                if s == 0:
                    x = tuple(batch[k][index] for k in self._keys(batch))
                elif self.owner[s - 1] != self.rank:
                    x = _recv(self.owner[s - 1], self.group)
                # else: x is the output of this rank's own stage s - 1 (ZBV's turn of the V)
                x = views[s](*x) if isinstance(x, tuple) else views[s](x)
                if s == self.num_stages - 1:
                    losses.append(self._micro_batch_loss(x, index).float())
                elif self.owner[s + 1] != self.rank:
                    _send(x, self.owner[s + 1], self.group)
        return self._share(losses)

    def _share(self, losses: List[torch.Tensor]) -> torch.Tensor:
        """The mean loss (and metrics) of the micro-batches, from the last stage to every pp rank."""
        if self.has_last:
            values = torch.stack(losses).mean().reshape(1)
            if self.num_metrics:
                # The schedule's last stage computes one loss per micro-batch, after (on a first step)
                # one more on placeholder tensors to infer the backward's shapes: the real ones are last.
                values = torch.cat([values, torch.stack(self._metrics[-self.n_microbatches:]).mean(0).float()])
        else:
            values = torch.zeros(1 + self.num_metrics, device=self.stages[0].device)
        dist.broadcast(values, src=self.last_rank, group=self.group)
        self.last_metrics = values[1:] if self.num_metrics else None
        return values[0]


# Tensors a stage boundary may carry (activations, masks, ids), by their code on the wire.
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)


def _send(x: Union[torch.Tensor, Tuple[torch.Tensor, ...]], dst: int, group) -> None:
    """Send a stage's output (a tensor or a tuple of tensors): a header of dtypes and shapes first."""
    tensors = (x,) if torch.is_tensor(x) else tuple(x)
    header = [len(tensors)]
    for t in tensors:
        header += [WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape]
    for t in (torch.tensor([len(header)], dtype=torch.long), torch.tensor(header, dtype=torch.long),
              *(t.contiguous() for t in tensors)):
        record_p2p("send", t)
        dist.send(t, dst, group=group)


def _recv(src: int, group) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    size = torch.empty(1, dtype=torch.long)
    record_p2p("recv", size)
    dist.recv(size, src, group=group)  # the header's length: a first, fixed-size message
    header_t = torch.empty(int(size), dtype=torch.long)
    record_p2p("recv", header_t)
    dist.recv(header_t, src, group=group)
    header = header_t.tolist()
    tensors, i = [], 1
    for _ in range(header[0]):
        dtype, ndim = WIRE_DTYPES[header[i]], header[i + 1]
        t = torch.empty(tuple(header[i + 2:i + 2 + ndim]), dtype=dtype)
        record_p2p("recv", t)
        dist.recv(t, src, group=group)
        tensors.append(t)
        i += 2 + ndim
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def count_stage_p2p(stage) -> None:
    """Make the point-to-point messages the schedule posts for `stage` visible to count_comm()
    (kinds "send" / "recv"). torch.distributed.pipelining's schedules issue them as isend / irecv
    ops, built by the stage's get_{fwd,bwd}_{send,recv}_ops once per message batch; each op is
    recorded as it is built, which is just before it is posted. Outside a count_comm() block the
    wrappers only pass the ops through. (Messages between two stages of one rank, ZBV's turn of
    the V, are handed over in memory and never built as ops.)"""
    for name, kind in (("get_fwd_send_ops", "send"), ("get_bwd_send_ops", "send"),
                       ("get_fwd_recv_ops", "recv"), ("get_bwd_recv_ops", "recv")):
        def counted(chunk_id, _build=getattr(stage, name), _kind=kind):
            ops = _build(chunk_id)
            for op in ops:
                record_p2p(_kind, op.tensor)
            return ops
        setattr(stage, name, counted)  # on the instance: the schedule calls it by name


def build_pipeline(model: nn.Module, family: Family, layout, group, cfg: ParallelConfig, n_microbatches: int,
                   device) -> Pipeline:
    """The schedule over this rank's stages of `layout` (megalm.parallel.Layout) of `model`, a model of
    `family`."""
    from torch.distributed import pipelining as pl
    parts = family.parts
    stage_ranges, stage_ids, num_stages = layout.stage_ranges, layout.stage_ids, layout.num_stages
    stages = [pl.PipelineStage(StageView(model, parts, stage_ranges[s], s == 0, s == num_stages - 1), s, num_stages,
                               device, group=group) for s in stage_ids]
    for stage in stages:
        count_stage_p2p(stage)
    pp_ranks = dist.get_process_group_ranks(group)  # global ranks by pp rank
    pp = len(pp_ranks)
    name = cfg.pipeline_schedule
    owner = [pp_ranks[next(r for r in range(pp) if s in virtual_stages_of(r, pp, len(stage_ids), name))]
             for s in range(num_stages)]
    pipeline = Pipeline(None, stages, has_first=0 in stage_ids, has_last=num_stages - 1 in stage_ids,
                        last_rank=owner[-1], group=group, loss_fn=model.loss, inputs=family.inputs,
                        optional=family.optional_inputs,
                        n_microbatches=n_microbatches, num_stages=num_stages, owner=owner, rank=dist.get_rank())
    names = getattr(model, "metric_names", ())
    if names:
        pipeline.metrics_fn, pipeline.num_metrics = model.loss_and_metrics, len(names)
    if name in MULTI_STAGE:
        cls = {"interleaved_1f1b": pl.ScheduleInterleaved1F1B, "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
               "zbv": pl.ScheduleZBVZeroBubble}[name]
        pipeline.schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=pipeline.train_loss, scale_grads=False)
    else:
        cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B}[name]
        pipeline.schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=pipeline.train_loss,
                                scale_grads=False)
    return pipeline


def after_weight_passes(pipeline: Pipeline, fn) -> None:
    """Call `fn(the stage's parameters)` after each weight-gradient pass of this rank's stages. Zero-bubble
    schedules split backward into input and weight passes, and the weight pass adds each micro-batch's
    gradients into `.grad` itself, where no accumulate hook sees them (main parameters move them into
    the fp32 main gradients here)."""
    for stage in pipeline.stages:
        params = list(stage.submod.parameters())

        def weight_pass(*args, _pass=stage.backward_weight_one_chunk, _params=params, **kwargs):
            out = _pass(*args, **kwargs)
            fn(_params)
            return out
        stage.backward_weight_one_chunk = weight_pass  # on the instance: the schedule calls it by name


def embedding_group(mesh, last_pp_rank: int):
    """The process group of the two ranks holding stage 0's embedding and the last stage's head
    for this rank's (dp, cp, tp) position; every rank creates every pair, in the same order.
    None when one rank holds both (ZBV's V puts the last stage back on pp rank 0)."""
    import itertools
    if last_pp_rank == 0:
        return None
    ranks = mesh.mesh  # (pp, dp, cp, tp) global ranks
    mine = None
    me = dist.get_rank()
    for idx in itertools.product(*[range(n) for n in ranks.shape[1:]]):
        pair = [int(ranks[(0, *idx)]), int(ranks[(last_pp_rank, *idx)])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine
