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
added to the reported loss: each adds its gradient where the router made it, scaled as the trainer
scales the loss (megalm.ops.routing.add_aux_grad), so pipeline stages need no path for them to the
last stage. Each training forward reports, to the step's record the trainer opens
(megalm.ops.routing), its aux and z losses, the assignments dropped, the busiest expert's load over the
mean and each expert's assignments.

The layer holds no parallel state: the parallel styles a family's expert plan puts around its parts
(megalm.parallel.experts) split the experts over expert-parallel ranks (their `experts(rows, counts)`
call then sends the rows to the ranks holding them) or over tp, make the expert load the token group's
when tp / cp ranks each route their own tokens (`load`), and cut a replicated sequence into tp shards
around the layer.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalm.models.layers import activate
from megalm.ops.routing import add_aux_grad, current_record


class GroupedLinear(nn.Module):
    """E linears without bias as one (E, in, out) weight, applied to rows sorted by expert."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x (M, in), rows of expert e at offsets[e-1]:offsets[e]; offsets (E,) int32, cumulative."""
        return F.grouped_mm(x, self.weight.to(x.dtype), offs=offsets)


class Experts(nn.Module):
    """The experts' MLPs: fc1 (E, h, ffn or [gate | up] 2 x ffn), fc2 (E, ffn, h), called on rows sorted by
    expert with each expert's count of them (the form expert parallelism's styles keep)."""

    def __init__(self, cfg):
        super().__init__()
        self.activation = cfg.activation
        width = cfg.ffn_size * (2 if cfg.activation == "swiglu" else 1)
        self.fc1 = GroupedLinear(cfg.num_experts, cfg.hidden_size, width)
        self.fc2 = GroupedLinear(cfg.num_experts, cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, h): rows sorted by expert, counts[e] of expert e -> (M, h)."""
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return self.fc2(activate(self.fc1(x, offsets), self.activation), offsets)


class ExpertLoad(nn.Module):
    """The assignments each expert got (E,) and the tokens they came from, as this rank routed them: the
    load-balancing loss's f_i and the tokens N it averages over. Identity here; where tp / cp ranks each
    route a part of a micro-batch, a parallel style makes them the whole micro-batch's."""

    def forward(self, counts: torch.Tensor, tokens: int) -> Tuple[torch.Tensor, int]:
        return counts, tokens


class MoE(nn.Module):
    """A layer's mixture of experts in place of its MLP: (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.score_function = cfg.moe_router_score_function
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.load = ExpertLoad()
        self.dropout = nn.Dropout(cfg.dropout)

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
        rows = order // k  # the token of each kept assignment, in expert order
        y = self.experts(tokens[rows], kept_counts)
        y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
        out = torch.zeros(N, h, dtype=y.dtype, device=y.device).index_add_(0, rows, y)
        # Recorded once per training forward: not a recomputation inside backward, nor a pipeline's
        # shape-probing forward (under no_grad, on placeholder inputs).
        record = current_record()
        if record is not None and self.training and torch.is_grad_enabled() and \
                torch._C._current_graph_task_id() == -1:
            record.add(self.layer_idx, aux if aux is not None else 0.0, z if z is not None else 0.0,
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
        # Where tp / cp ranks split the micro-batch's tokens (equal shares), the losses are over all of them: each
        # rank's part adds up to them, its tokens' probabilities against every rank's counts (`load`).
        counts, N = self.load(counts.float(), N)
        aux = self.aux_coeff * E * (probs.sum(0) / N * (counts / (N * k))).sum() if self.aux_coeff else None
        z = self.z_coeff * torch.logsumexp(logits, dim=-1).square().sum() / N if self.z_coeff else None
        terms = [t for t in (aux, z) if t is not None]
        if terms and torch.is_grad_enabled():
            tokens = add_aux_grad(tokens, sum(terms))
        return tokens, aux.detach() if aux is not None else None, z.detach() if z is not None else None
