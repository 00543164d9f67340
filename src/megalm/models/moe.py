"""Mixture of experts: the MLP of a decoder layer as E experts and a top-k router (Mixtral-style,
as Megatron-Core builds it; model.num_experts > 0).

Each token's router logits (h -> E, in fp32) are scored by softmax or sigmoid; the token goes to
its k best experts, weighted by their scores renormalised over the k (softmax: the softmax of the
top-k logits). The experts are one grouped computation: the (token, expert) assignments sorted by
expert, then `grouped_mm` over the experts' stacked weights (E, h, ffn) and (E, ffn, h), SwiGLU or
GELU between, and the weighted outputs summed back per token.

Capacity (model.moe_capacity_factor): None routes every assignment (dropless); a factor f gives
each expert room for ceil(f x tokens x k / E) assignments and drops the rest, keeping the
highest-scored (Megatron's "probs" policy). A dropped assignment adds nothing (the residual
carries the token).

Auxiliary losses, per layer and micro-batch, with Megatron-Core's definitions: the load-balancing
loss coeff x E x sum_i f_i P_i (f_i: the share of the k x tokens assignments expert i got; P_i:
its mean softmax probability over the tokens; Switch Transformer, arXiv:2101.03961) and the router
z-loss coeff x mean over tokens of logsumexp(logits)^2 (ST-MoE, arXiv:2202.08906). They are not
added to the reported loss: each adds its gradient where the router made it (`_AddAuxGrad`),
scaled as the trainer scales the loss (1 / micro-batches, the fp16 loss scale: `MoEStats.grad_scale`),
so pipeline stages need no path for them to the last stage. `MoEStats` gathers, for the log, each
step's aux and z losses (summed over layers, averaged over micro-batches), the share of assignments
dropped, the busiest expert's load over the mean and each expert's assignments.

Under expert parallelism (megalm.parallel.experts) a rank holds E / ep experts and `dispatch` sends
the rows to them; under tp and cp each rank routes its own tokens (`token_group`, `split_group`).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class MoEStats:
    """Shared by a model's MoE layers: the aux-loss gradient scale, and what each layer's training
    forwards reported since the last `reset` (kept as tensors, read once a step)."""

    def __init__(self):
        self.grad_scale = 1.0
        self.reset()

    def reset(self) -> None:
        self.records: Dict[int, List[Tuple]] = {}

    def add(self, layer: int, aux, z, dropped: int, assigned: int, load_max, counts: torch.Tensor) -> None:
        self.records.setdefault(layer, []).append((aux, z, dropped, assigned, load_max, counts))

    def values(self, micro_batches: int, num_experts: int) -> torch.Tensor:
        """(aux, z, dropped, assigned summed over this rank's layers and the step's micro-batches; the largest
        load; then the assignments kept by each expert, summed alike). Each layer's last `micro_batches`
        forwards count: a pipeline's first step also runs a probing forward, before the real ones, to learn
        its stages' shapes."""
        rows = [r for layer in self.records.values() for r in layer[-micro_batches:]]
        if not rows:
            return torch.zeros(5 + num_experts, dtype=torch.float64)
        sums = [sum(float(r[i]) for r in rows) for i in range(4)]
        counts = torch.stack([r[5].detach().double().cpu() for r in rows]).sum(0)
        return torch.cat([torch.tensor([*sums, max(float(r[4]) for r in rows)], dtype=torch.float64), counts])


class _AddAuxGrad(torch.autograd.Function):
    """Identity on `x`; in backward, also the gradient of `aux` x scale (the loss it stands for)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


class GroupedLinear(nn.Module):
    """E linears without bias as one (E, in, out) weight, applied to rows sorted by expert."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x (M, in), rows of expert e at offsets[e-1]:offsets[e]; offsets (E,) int32, cumulative."""
        return F.grouped_mm(x, self.weight.to(x.dtype), offs=offsets)


class Experts(nn.Module):
    """The experts' MLPs: fc1 (E, h, ffn or [gate | up] 2 x ffn), fc2 (E, ffn, h)."""

    def __init__(self, cfg):
        super().__init__()
        self.activation = cfg.activation
        width = cfg.ffn_size * (2 if cfg.activation == "swiglu" else 1)
        self.fc1 = GroupedLinear(cfg.num_experts, cfg.hidden_size, width)
        self.fc2 = GroupedLinear(cfg.num_experts, cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from megalm.models.layers import activate
        return self.fc2(activate(self.fc1(x, offsets), self.activation), offsets)


class MoE(nn.Module):
    """A layer's mixture of experts in place of its MLP: (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg, stats: Optional[MoEStats] = None, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.score_function = cfg.moe_router_score_function
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.stats = stats if stats is not None else MoEStats()
        self.ep_group = None  # expert parallelism (megalm.parallel.experts): this rank holds E / ep experts
        # Tensor / context parallelism (megalm.parallel.experts.split_tokens): the ranks a micro-batch's tokens
        # are split over in this layer (the aux losses are over all of them), and the tp group when the layer
        # itself cuts a replicated sequence into tp shards and gathers the outputs (tp without SP).
        self.token_group = None
        self.split_group = None
        self.expert_tp_group = None  # expert tensor parallelism: the tp group each expert is split over

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (N, k), experts (N, k), softmax probabilities (N, E), logits (N, E)) of N tokens (N, h),
        all in fp32 (autocast off: the choice of experts must not hang on bf16 rounding)."""
        with torch.autocast(x.device.type, enabled=False):
            return self._route(x)

    def _route(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.router.weight.float())
        probs = torch.softmax(logits, dim=-1)
        if self.score_function == "softmax":
            top, experts = logits.topk(self.topk, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:  # sigmoid: each expert's own score, the k chosen renormalised to sum to 1
            scores = torch.sigmoid(logits)
            top, experts = scores.topk(self.topk, dim=-1)
            weights = top / top.sum(-1, keepdim=True) if self.topk > 1 else top
        return weights, experts, probs, logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_group is None:
            return self._forward(x)
        # Each tp rank routes its shard of the (replicated) sequence. Training's sequences divide evenly
        # (validated); a prompt, or one decoded token, is made up to a multiple of tp with zero rows, cut off after.
        from megalm.distributed.comm import gather_seq_replicated, scatter_seq
        T = x.shape[1]
        pad = -T % torch.distributed.get_world_size(self.split_group)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        out = gather_seq_replicated(self._forward(scatter_seq(x, self.split_group)), self.split_group)
        return out[:, :T] if pad else out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        tokens = x.reshape(-1, h)
        N, E, k = tokens.shape[0], self.num_experts, self.topk
        weights, experts, probs, logits = self.route(tokens)
        flat = experts.reshape(-1)  # (N k): the expert of each assignment, token by token
        counts = torch.bincount(flat, minlength=E)
        aux = z = None
        if self.training:
            tokens, aux, z = self._aux_losses(tokens, probs, logits, counts)
        if self.capacity_factor is None:
            order, kept_counts = torch.argsort(flat, stable=True), counts
        else:
            keep = self._within_capacity(flat, weights.reshape(-1).detach(),
                                         math.ceil(self.capacity_factor * N * k / E))
            order = torch.argsort(torch.where(keep, flat, E), stable=True)[:int(keep.sum())]  # dropped ones last, cut
            kept_counts = torch.bincount(flat[keep], minlength=E)
        offsets = torch.cumsum(kept_counts, 0).to(torch.int32)
        rows = order // k  # the token of each kept assignment, in expert order
        if self.ep_group is None and self.expert_tp_group is None:
            y = self.experts(tokens[rows], offsets)
        elif self.ep_group is None:  # every tp rank runs every rank's rows through its slice of the experts
            from megalm.parallel.experts import run_experts
            y = run_experts(self.experts, tokens[rows], kept_counts, self.expert_tp_group)
        else:  # the rows go to the ranks holding their experts, and come back
            from megalm.parallel.experts import dispatch
            y = dispatch(self.experts, tokens[rows], kept_counts, self.ep_group, self.expert_tp_group)
        y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
        out = torch.zeros(N, h, dtype=y.dtype, device=y.device).index_add_(0, rows, y)
        # Recorded once per training forward: not a recomputation inside backward, nor a pipeline's
        # shape-probing forward (under no_grad, on placeholder inputs).
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.stats.add(self.layer_idx, aux if aux is not None else 0.0, z if z is not None else 0.0,
                           N * k - len(order), N * k, kept_counts.max().float() * E / max(N * k, 1), kept_counts)
        return self.dropout(out.view(B, T, h).to(x.dtype))

    @staticmethod
    def _within_capacity(flat: torch.Tensor, scores: torch.Tensor, capacity: int) -> torch.Tensor:
        """Which assignments an expert with room for `capacity` keeps: its highest-scored (ties: the earlier)."""
        by_score = torch.argsort(scores, descending=True, stable=True)
        by_expert = by_score[torch.argsort(flat[by_score], stable=True)]  # by expert, then by score
        sorted_experts = flat[by_expert]
        rank = torch.arange(len(flat), device=flat.device) - torch.searchsorted(sorted_experts, sorted_experts)
        keep = torch.zeros(len(flat), dtype=torch.bool, device=flat.device)
        keep[by_expert] = rank < capacity
        return keep

    def _aux_losses(self, tokens: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor, counts: torch.Tensor):
        """(tokens that carry the auxiliary losses' gradient back to the router, aux value, z value)."""
        N, E, k = probs.shape[0], self.num_experts, self.topk
        counts = counts.float()
        if self.token_group is not None:
            # The micro-batch's tokens are split over the group (equal shares): the losses are over all of them.
            # Each rank's part adds up to them: its tokens' probabilities against every rank's counts.
            import torch.distributed as dist
            counts = counts.clone()
            dist.all_reduce(counts, group=self.token_group)
            N = N * dist.get_world_size(self.token_group)
        aux = self.aux_coeff * E * (probs.sum(0) / N * (counts / (N * k))).sum() if self.aux_coeff else None
        z = self.z_coeff * torch.logsumexp(logits, dim=-1).square().sum() / N if self.z_coeff else None
        terms = [t for t in (aux, z) if t is not None]
        if terms and torch.is_grad_enabled():
            tokens = _AddAuxGrad.apply(tokens, sum(terms), self.stats.grad_scale)
        return tokens, aux.detach() if aux is not None else None, z.detach() if z is not None else None
