"""Pipeline parallelism: split GPT's layers into stages and run micro-batches through them with
the schedules of `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B, zero bubble).

Each rank keeps ONE GPT module holding just its layers (blocks keep their global keys, the
embedding lives on the first stage, final norm, head and loss on the last), so parameter names,
the optimizer and checkpoints look the same as at pp = 1. The pipeline stages handed to the
schedule are thin views over layer ranges of that module; with virtual stages (interleaved
schedules) a rank holds v of them: rank r runs virtual stages r, r + pp, r + 2 pp, ... as in
Megatron (arXiv:2104.04473, sec. 2.2).

A tied embedding (first stage) and head (last stage) are two copies, initialised from the same
global name; their gradients are summed over the pair of ranks holding them (Megatron's
embedding group), so both copies take the same update and stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megalm.config import ParallelConfig
from megalm.models.gpt import GPT
from megalm.parallel.stages import MULTI_STAGE, virtual_stages_of

def keep_stage_parts(model: GPT, layers: List[int], first: bool, last: bool) -> None:
    """Drop from the meta-device model what this rank's stages do not run."""
    for key in list(model.blocks.keys()):
        if int(key) not in layers:
            del model.blocks[key]
    if not first:
        model.embed = None
    if not last:
        model.norm, model.head, model.loss = None, None, None


class StageView(nn.Module):
    """One pipeline stage: the layers `layers` of the rank's GPT (plus embedding / head at the ends).

    It registers only its own parts as submodules: the schedule scales and zeroes gradients per
    stage, so a rank's two stages must not both claim every parameter of the rank's model.
    """

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList([model.blocks[str(i)] for i in layers])  # shared, not copied
        self.embed = model.embed if first else None
        self.norm, self.head = (model.norm, model.head) if last else (None, None)
        self._rope = model.rope  # a bound method: no module registration
        self._seq_length = model.cfg.seq_length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)  # tokens (B, T) → (B, T, h)
        rope = self._rope(self._seq_length, x.device)
        for block in self.blocks:
            x = block(x, rope)
        if self.last:
            x = self.head(self.norm(x))  # (B, T, V) logits, or this rank's vocabulary shard
        return x


@dataclass
class Pipeline:
    """What the trainer needs to run a step through the pipeline on this rank."""
    schedule: Optional[object]  # set by build_pipeline right after construction
    stages: List[object]
    has_first: bool
    has_last: bool
    last_rank: int  # global rank holding the last stage, in this rank's pp group
    group: object   # the pp process group
    loss_fn: object
    n_microbatches: int
    num_stages: int
    owner: List[int]  # global rank running each stage
    rank: int
    loss_scale: float = 1.0  # fp16: the trainer's current loss scale

    def train_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: scaled by 1/m here rather than by the schedule's gradient scaling,
        which runs once per stage and would scale a weight shared by two stages of one rank (ZBV's
        tied embedding and head) twice; the fp16 loss scale multiplies in here too."""
        return self.loss_fn(logits, labels) * (self.loss_scale / self.n_microbatches)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, train: bool = True) -> torch.Tensor:
        """Run a batch split into the schedule's micro-batches; the mean loss on every pp rank."""
        if not train:
            return self._forward_only(tokens, labels)
        losses: List[torch.Tensor] = []
        self.schedule.step(*((tokens,) if self.has_first else ()), target=labels if self.has_last else None,
                           losses=losses if self.has_last else None, return_outputs=False)
        # The schedule's loss is each micro-batch's mean x scale / n_microbatches: undo both.
        return self._share([l.detach().float() * (self.n_microbatches / self.loss_scale) for l in losses])

    @torch.no_grad()
    def _forward_only(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Evaluation: each micro-batch walks the stages in order with plain sends and receives.

        The schedules' own eval mode does not run multi-stage (interleaved, zero bubble) schedules
        in this torch version, and evaluation needs no overlap, so this loop is kept simple.
        """
        views = {stage.stage_index: stage.submod for stage in self.stages}
        losses = []
        for x_tokens, y in zip(tokens.chunk(self.n_microbatches), labels.chunk(self.n_microbatches)):
            x = None
            for s in sorted(views):  # this rank's stages in pipeline order
                if s == 0:
                    x = x_tokens
                elif self.owner[s - 1] != self.rank:
                    x = _recv(self.owner[s - 1], self.group)
                # else: x is the output of this rank's own stage s - 1 (ZBV's turn of the V)
                x = views[s](x)
                if s == self.num_stages - 1:
                    losses.append(self.loss_fn(x, y).float())
                elif self.owner[s + 1] != self.rank:
                    _send(x, self.owner[s + 1], self.group)
        return self._share(losses)

    def _share(self, losses: List[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack(losses).mean() if self.has_last else torch.zeros(())
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss


def _send(x: torch.Tensor, dst: int, group) -> None:
    dist.send(torch.tensor(x.shape, dtype=torch.long), dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def _recv(src: int, group) -> torch.Tensor:
    # Stage boundaries carry float activations (B, T or T/tp, h); the shape travels first.
    shape = torch.empty(3, dtype=torch.long)
    dist.recv(shape, src, group=group)
    x = torch.empty(tuple(shape.tolist()), dtype=torch.float32)
    dist.recv(x, src, group=group)
    return x


def build_pipeline(model: GPT, stage_ranges: List[range], stage_ids: List[int], num_stages: int,
                   group, cfg: ParallelConfig, n_microbatches: int, device) -> Pipeline:
    from torch.distributed import pipelining as pl
    stages = [pl.PipelineStage(StageView(model, stage_ranges[s], s == 0, s == num_stages - 1), s, num_stages,
                               device, group=group) for s in stage_ids]
    pp_ranks = dist.get_process_group_ranks(group)  # global ranks by pp rank
    pp = len(pp_ranks)
    name = cfg.pipeline_schedule
    owner = [pp_ranks[next(r for r in range(pp) if s in virtual_stages_of(r, pp, len(stage_ids), name))]
             for s in range(num_stages)]
    pipeline = Pipeline(None, stages, has_first=0 in stage_ids, has_last=num_stages - 1 in stage_ids,
                        last_rank=owner[-1], group=group, loss_fn=model.loss, n_microbatches=n_microbatches,
                        num_stages=num_stages, owner=owner, rank=dist.get_rank())
    if name in MULTI_STAGE:
        cls = {"interleaved_1f1b": pl.ScheduleInterleaved1F1B, "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
               "zbv": pl.ScheduleZBVZeroBubble}[name]
        pipeline.schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=pipeline.train_loss, scale_grads=False)
    else:
        cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B}[name]
        pipeline.schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=pipeline.train_loss,
                                scale_grads=False)
    return pipeline


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
