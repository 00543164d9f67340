"""Every formula megalm.plan estimates with, each with its source: one module, in sections.

- FLOPs of a pipeline stage's forward and backward, from the family's one FLOPs definition;
- activation memory: what autograd keeps for backward per layer, per stage and at a rank's peak
  under its schedule (Korthikanti et al. 2022, with megalm's own coefficients);
- the collectives of one optimizer step and the exact model state of a rank (read off the
  meta-device layout, counted as megalm.distributed.comm counts them);
- the time of one collective (the alpha-beta model with the ring's bus-bandwidth factors);
- pipeline schedules: the order each rank runs its actions in, and an event simulation of that
  order with per-action times, which gives the bubble;
- step time, tokens/s and MFU on a cluster profile.

Context parallelism (parallel.cp) runs through all of them: a rank's seq_length / cp tokens, the ring
attention's saved tensors, the ring's sends and their overlap with the attention, gradients and ZeRO
shards over dp x cp. So does a mixture of experts (model.num_experts > 0, megalm.models.moe): the FLOPs of k
experts a token and the router; what its router and experts keep (`moe_kept_bytes`), planned for balanced
routing (`moe_rows`: dropless, tokens x k rows; under expert parallelism every rank receiving as many rows
as it sends); each tp rank routing its own tokens; expert parallelism's all-to-alls (`expert_parallel`),
waited on in the step time; the experts' buckets over the (dp / ep) x cp ranks holding them (`expert_data_parallel`),
ZeRO-3's gathers of them there too. Under expert tensor parallelism (parallel.expert_tp) each expert is split
over tp and every tp rank runs all tp ranks' rows through its slices: tp x the rows' fc1 inputs and grouping
indices kept (`moe_kept_bytes`), the rows' all-to-alls over tp, forward and backward (`expert_tensor_parallel`),
and the counts' gather (`untracked_collectives`), both under "tp" and waited on like tp's collectives, the
experts' tp slices in the gradient norm (`other`).

Each estimate is checked against a measured run: tests/test_plan_activations.py (saved tensors),
tests/test_plan_collectives.py (count_comm and the held model state), tests/test_plan.py
(schedules, step time, search) and scripts/bench_pp.py (the bubble).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megalm.errors import ConfigError
from megalm.parallel.stages import MULTI_STAGE, stage_layer_ranges, virtual_stages_of

FP32 = 4


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def layer_and_head_flops_per_token(model_cfg) -> Tuple[float, float]:
    """Training FLOPs per token of one transformer layer, and of everything outside the layers.

    Both come from the family's own `flops_per_token` (megalm.models.flops: 6 x matmul weights +
    12 L s h_attn, model FLOPs, recomputation not counted), evaluated at the model's depth and at
    depth 0: the difference is the layers' share, which is the same for every layer; what is left at
    depth 0 is the head (and, for BERT, its MLM transform and pooler), all of it on the last stage.
    """
    from megalm.models import flops_per_token
    total = flops_per_token(model_cfg)
    outside = flops_per_token(dataclasses.replace(model_cfg, num_layers=0))
    return (total - outside) / model_cfg.num_layers, outside


def attention_core_flops_per_token(model_cfg) -> float:
    """Forward FLOPs per token per layer of QK^T and AV (2 x 2 s h_attn: megalm.models.flops's 12 L s h_attn
    is these times 3 for forward + backward), the part selective recomputation runs twice."""
    return 4.0 * model_cfg.seq_length * model_cfg.num_attention_heads * model_cfg.head_dim


@dataclasses.dataclass
class StageWork:
    """FLOPs one rank spends on one micro-batch in one (virtual) stage, split as the zero-bubble schedules
    split backward (Qi et al. 2023, arXiv:2401.10241): F forward, I the gradient of the stage's input
    (activations; the attention core's whole backward is here, it has no weights), W the weights'
    gradient (as many FLOPs as the forward's matmuls). B = I + W, twice F. Recomputation adds its
    forward to I: the whole forward of the recomputed layers (full), or the attention core (selective)."""
    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def stage_work(cfg, layers: int, last: bool, tp: int) -> StageWork:
    """Per-rank FLOPs of one micro-batch through a stage of `layers` layers (with the head when `last`).

    Under context parallelism a rank runs seq_length / cp of each sequence's tokens, and its queries' share
    of the attention: 1/cp of the micro-batch's model FLOPs (the layout of 2 x cp chunks gives every rank
    the same share of the causal work). Attention is counted as model FLOPs count it, as for cp = 1 (every
    query over every key); the ring computes (2cp + 1) / (4cp) of that (it skips the chunk pairs the causal
    mask hides entirely), a causal kernel about half."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.trainer.micro_batch_size * local_tokens(cfg)
    layer, outside = layer_and_head_flops_per_token(m)
    attn = attention_core_flops_per_token(m)  # forward, per layer
    layer_fwd = layer / 3
    matmul_fwd = layer_fwd - attn
    fwd = layers * layer_fwd + (outside / 3 if last else 0.0)
    head_mm = outside / 3 if last else 0.0
    weight = layers * matmul_fwd + head_mm
    inputs = layers * (matmul_fwd + 2 * attn) + head_mm
    if p.recompute == "full":
        n = layers if p.recompute_num_layers is None else min(layers, p.recompute_num_layers)
        inputs += n * layer_fwd
    elif p.recompute == "selective":
        inputs += layers * attn
    scale = tokens / tp
    return StageWork(fwd * scale, inputs * scale, weight * scale)


def loss_traffic_bytes(cfg, tp: int) -> Tuple[float, float]:
    """Device-memory bytes the language-model loss streams for one micro-batch on one rank, forward and
    backward: the passes its elementwise kernels make over the (B, T, V / tp) logits, beyond the head's
    matmul. The softmax over the vocabulary is memory-bound work its FLOPs do not show (a few operations
    an element against hundreds for the matmul that made it); on a small hidden size it is a visible part
    of the last stage.

    Passes, each one read or write of the logits' elements in fp32 (4 bytes), counted from megalm's code:
    - LMLoss (no tp): log_softmax reads the logits and writes its output (its per-row max and sum stay in
      cache); backward, nll_loss writes a zero gradient, and log_softmax's backward reads it and the saved
      output and writes the logits' gradient: 2 + 4. A padded vocabulary adds masked_fill's read and write,
      forward and backward (+ 2 + 2); autocast adds the cast to fp32 and back (a 2-byte read and a 4-byte
      write forward, the reverse backward).
    - the vocabulary-parallel loss (tp > 1, megalm.parallel.tensor): masked_fill (2), the max (1), the
      shift (2), exp (2), the sum (1) and the in-place division to the softmax (2) forward; the in-place
      scaling of the saved softmax backward (2), plus its cast for a half-precision model.
    - BERT's MLM loss is this loss over every position (its head computes logits for all tokens, as
      Megatron's does; the loss mask keeps the masked ones), and its logged accuracy reads the logits
      once more, forward, without autograd (loss_and_metrics): LMLoss.correct's max over the real
      columns (1), or under tp VocabParallelLMLoss.correct's masked_fill (2) and max (1); under autocast
      with a cast of its own to fp32 (a 2-byte read and a 4-byte write).
    A fine-tuning head has no vocabulary: 0. Under context parallelism the rank's seq_length / cp tokens."""
    m = cfg.model
    if getattr(m, "fine_tuning_head", False):
        return 0.0, 0.0
    elements = cfg.trainer.micro_batch_size * max(1, getattr(m, "num_choices", 0)) * local_tokens(cfg) \
        * m.padded_vocab(tp) / tp
    if tp > 1:
        fwd, bwd = 10, 2
    else:
        padded = 2 if m.padded_vocab(tp) > m.vocab_size else 0
        fwd, bwd = 2 + padded, 4 + padded
    fwd_bytes, bwd_bytes = fwd * FP32 * elements, bwd * FP32 * elements
    if cfg.trainer.precision != "fp32":  # the logits' cast to fp32 and the gradient's back: 2 + 4 bytes each way
        fwd_bytes += 6 * elements
        bwd_bytes += 6 * elements
    if m.arch == "bert":  # the MLM accuracy
        fwd_bytes += FP32 * elements * (3 if tp > 1 else m.vocab_size / m.padded_vocab(tp))
        fwd_bytes += 6 * elements if cfg.trainer.precision != "fp32" else 0
    return fwd_bytes, bwd_bytes


# ---------------------------------------------------------------------------------------------
# Memory traffic outside the matmuls
# ---------------------------------------------------------------------------------------------
#
# A stage's FLOPs time its matmuls and attention; the rest of a step (norms, residual adds, the
# activation function, RoPE, dropout, the copies reshapes make, casts under autocast, reductions for
# bias and norm gradients, gradient accumulation) does a few operations per element it reads and
# writes, so its time is bytes over memory bandwidth (the roofline's memory-bound side: Williams et
# al. 2009, "Roofline", CACM 52(4)). On a small hidden size this is a visible share of a layer
# (bench_pp measures the head's stage against the others). Rather than a hand formula per option
# (norm, activation, positions, dropout, precision, GQA...), the bytes are counted: one layer of the
# family's own model, built under FakeTensorMode (tensors with shapes and dtypes, and no storage), runs
# forward and backward at the micro-batch's shape while a TorchDispatchMode adds up, op by op below
# autograd, the bytes each op reads and writes. tests/test_plan.py checks the count against the same
# layer run on real tensors and against a hand count of a plain layer.

FLOP_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "_grouped_mm",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward"})
"""Ops whose time stage_work's FLOPs account for: the matmuls and the fused attention kernels."""


class TrafficCounter:
    """Bytes each aten op reads and writes in tensors of more than one element a token (per-token
    statistics, ids and parameter vectors are left out: a fraction of 1/h of the rest), counted below
    autograd (a TorchDispatchMode) and split into `hidden` (every such tensor is a hidden-state tensor,
    tokens x h: norms, residual adds, hidden dropout, which sequence parallelism shards over tp)
    and `width` (the rest: attention heads, the MLP's inner width, the vocabulary, which tensor
    parallelism shards; a model whose MLP width equals h would count it as hidden). Views move
    nothing; FLOP_OPS are timed by their FLOPs; an embedding lookup reads the rows it writes, not its
    whole table. With `skip_at`, ops touching a tensor of at least that many elements are left out
    (the logits' passes, which `loss_traffic_bytes` counts)."""

    def __init__(self, tokens: int, hidden: int, skip_at: Optional[int] = None, fake: bool = False):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self
        self.tokens, self.h, self.skip_at = tokens, hidden, skip_at
        self.hidden = self.width = 0.0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if fake and func is torch.ops.aten.bincount.default:
                    # A router's counts of its E experts (megalm.models.moe): fake tensors have no values to size
                    # bincount's output by; the experts' ids are below minlength, so it is (minlength,).
                    minlength = (kwargs or {}).get("minlength", args[2] if len(args) > 2 else 0)
                    out = torch.zeros(minlength, dtype=torch.long, device=args[0].device)
                    counter.record(func, args, kwargs or {}, out)
                    return out
                if fake and func is torch.ops.aten._grouped_mm.default:
                    # The experts' grouped matmul: its meta kernel takes bf16 alone; only the shape matters here.
                    a, b = args[0], args[1]
                    if a.dim() == 2 and b.dim() == 3:
                        shape = (a.shape[0], b.shape[2])
                    elif a.dim() == 2 and b.dim() == 2:  # the weights' gradient: one (in, out) a group
                        offs = args[2] if len(args) > 2 else (kwargs or {})["offs"]
                        shape = (offs.shape[0], a.shape[0], b.shape[1])
                    else:
                        shape = (a.shape[0], a.shape[1], b.shape[-1])
                    return torch.empty(shape, dtype=a.dtype, device=a.device)
                out = func(*args, **(kwargs or {}))
                counter.record(func, args, kwargs or {}, out)
                return out
        self.mode = Mode()

    def record(self, func, args, kwargs, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves
        name = func.overloadpacket.__name__
        if name in FLOP_OPS or func.namespace != "aten" or name == "_unsafe_view" \
                or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return
        tensors = lambda xs: [x for x in tree_leaves(xs) if isinstance(x, torch.Tensor)]  # noqa: E731
        outs = tensors(out)
        if name == "embedding":  # reads the looked-up rows (and the ids), writes them
            ins = [outs[0], args[1]]
        else:
            ins = tensors((args, kwargs))
        big = [x for x in ins + outs if x.numel() > self.tokens]
        if not big or (self.skip_at is not None and any(x.numel() >= self.skip_at for x in big)):
            return
        nbytes = sum(x.numel() * x.element_size() for x in big)
        if all(x.numel() == self.tokens * self.h and x.shape[-1] == self.h for x in big):
            self.hidden += nbytes
        else:
            self.width += nbytes

    def take(self) -> Tuple[float, float]:
        out, self.hidden, self.width = (self.hidden, self.width), 0.0, 0.0
        return out


@dataclass(frozen=True)
class Traffic:
    """Device-memory bytes outside the matmuls of one micro-batch through a stage on one rank, by pipeline
    action: the forward, the input gradient (with recomputation's forward) and the weight gradient
    (gradient accumulation); backward (B) is input_grad + weight_grad."""
    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.forward + other.forward, self.input_grad + other.input_grad,
                       self.weight_grad + other.weight_grad)

    def scaled(self, k: float) -> "Traffic":
        return Traffic(self.forward * k, self.input_grad * k, self.weight_grad * k)

    def of(self, kind: str) -> float:
        return {"F": self.forward, "B": self.input_grad + self.weight_grad, "I": self.input_grad,
                "W": self.weight_grad}[kind]


@dataclass(frozen=True)
class CountedTraffic:
    """What `count_traffic` counted for one micro-batch of a single-process model, each part as
    (hidden, width) bytes forward and backward (TrafficCounter), and the parameters of each part."""
    layer_forward: Tuple[float, float]
    layer_backward: Tuple[float, float]
    first_forward: Tuple[float, float]
    first_backward: Tuple[float, float]
    last_forward: Tuple[float, float]
    last_backward: Tuple[float, float]
    layer_params: int
    first_params: int
    last_params: int


_COUNTED: Dict[str, CountedTraffic] = {}


def count_traffic(cfg, fake: bool = True) -> CountedTraffic:
    """Count, op by op, the bytes one micro-batch moves outside the matmuls through one layer, through the
    first stage's part before the layers (embedding) and through the last stage's part after them (final
    norm, heads; the ops over the logits are left to `loss_traffic_bytes`), forward then backward, under
    trainer.precision's autocast. `fake`: on FakeTensorMode tensors (nothing allocated: any model size);
    False runs the same on real CPU tensors (the tests' reference). Cached per model, micro-batch and
    precision."""
    import torch
    from megalm.models import build_model
    from megalm.family import Part
    from megalm.models.registry import family_of
    from megalm.training.precision import autocast
    m, t = cfg.model, cfg.trainer
    key = repr((m, t.micro_batch_size, t.precision, fake))
    if key in _COUNTED:
        return _COUNTED[key]
    family = family_of(m.arch)
    B, T, h = t.micro_batch_size, m.seq_length, m.hidden_size
    one = dataclasses.replace(m, num_layers=1)
    if getattr(m, "num_experts", 0) and m.moe_capacity_factor is not None:
        # Counted dropless: a capacity's kept rows are known only from values (the balanced case keeps
        # min(1, f) of them, `moe_rows`); the layer's other passes are the same.
        one = dataclasses.replace(one, moe_capacity_factor=None)
    logits = B * max(1, getattr(m, "num_choices", 0)) * T * m.padded_vocab_size
    counter = TrafficCounter(B * T, h, fake=fake)
    last_counter = TrafficCounter(B * T, h, skip_at=logits, fake=fake)
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        context = FakeTensorMode()
    else:
        import contextlib
        context = contextlib.nullcontext()

    def floats(xs):
        return [x for x in (xs if isinstance(xs, tuple) else (xs,)) if x.is_floating_point() and x.requires_grad]

    def backward(part_counter, outs):
        """Backward from ones over the part's float outputs, each parameter's gradient new (gradient
        accumulation is `stage_traffic`'s own term)."""
        outs = floats(outs)
        grads = [torch.ones_like(x) for x in outs]
        model.zero_grad(set_to_none=True)
        with part_counter.mode:
            torch.autograd.backward(outs, grads)
        return part_counter.take()

    with context:
        gen = torch.Generator().manual_seed(0)
        model = build_model(one)
        model.train()
        inputs = [torch.randint(0, m.vocab_size, (B, T), generator=gen)] + \
            [torch.ones(B, T, dtype=torch.long) for _ in family.inputs[1:]]
        with autocast(t.precision, "cpu"):
            with counter.mode:
                acts = model(*inputs, part=Part([], True, False))
            first_forward = counter.take()
        first_backward = backward(counter, acts)
        with autocast(t.precision, "cpu"):
            acts = tuple(a.detach().requires_grad_(a.is_floating_point())
                         for a in (acts if isinstance(acts, tuple) else (acts,)))
            with counter.mode:
                out = model(*acts, part=Part([0], False, False))
            layer_forward = counter.take()
        layer_backward = backward(counter, out)
        with autocast(t.precision, "cpu"):
            with last_counter.mode:
                out = model(*acts, part=Part([], False, True))
            last_forward = last_counter.take()
        last_backward = backward(last_counter, out)
        parts = family.parts

        def params(names):
            seen = {}
            for name in names:
                module = getattr(model, name, None)
                if module is not None:
                    seen.update({id(p): p.numel() for p in module.parameters()})
            return sum(seen.values())
        counted = CountedTraffic(layer_forward, layer_backward, first_forward, first_backward, last_forward,
                                 last_backward, params([parts.layers]), params(parts.first), params(parts.last))
    _COUNTED[key] = counted
    return counted


GRAD_ACCUMULATION_BYTES = 3 * FP32
"""Adding a micro-batch's weight gradient into the accumulated one: two fp32 reads and a write a parameter."""


def stage_traffic(cfg, layers: int, first: bool, last: bool, tp: int, m: int) -> Traffic:
    """Bytes outside the matmuls of one micro-batch through a stage of `layers` layers on one tp rank
    (`count_traffic`, with the first stage's embedding and the last stage's heads and loss,
    `loss_traffic_bytes`).

    - tensor parallelism shards the width part (heads, the MLP's inner width, the vocabulary) over tp;
      the hidden part (norms, residual adds, hidden dropout) runs whole on every tp rank, or on the
      rank's sequence shard (1/tp) under sequence parallelism;
    - full recomputation runs the recomputed layers' forward again in the input gradient (selective
      recomputes only the attention core, whose kernels FLOPs time);
    - context parallelism: the rank's seq_length / cp tokens, 1/cp of every counted byte (counted at the
      whole sequence on SDPA's core; the ring's elementwise passes over its c x c scores, which a fused
      attention kernel would keep on chip, are not counted, as SDPA's internals are not);
    - gradient accumulation: each micro-batch after a step's first adds its weight gradients into the
      accumulated ones (GRAD_ACCUMULATION_BYTES a parameter), spread here over the m micro-batches.
    A mixture's experts count as they run without expert tensor parallelism: with it a rank runs tp x the rows
    through 1/tp of the width (the same FLOPs, and bytes for the width part); the copies its exchange makes of
    the gathered rows (tp x the rows, h fp32) are not counted.
    """
    c, p = count_traffic(cfg), cfg.parallel
    sp = p.sequence_parallel and tp > 1

    def share(part: Tuple[float, float]) -> float:
        hidden, width = part
        return (hidden / (tp if sp else 1) + width / tp) / p.cp

    layer = Traffic(share(c.layer_forward), share(c.layer_backward))
    total = layer.scaled(layers)
    if p.recompute == "full":
        n = layers if p.recompute_num_layers is None else min(layers, p.recompute_num_layers)
        total += Traffic(0.0, n * layer.forward)
    params = layers * c.layer_params
    if first:
        total += Traffic(share(c.first_forward), share(c.first_backward))
        params += c.first_params
    if last:
        total += Traffic(share(c.last_forward), share(c.last_backward))
        total += Traffic(*loss_traffic_bytes(cfg, tp))
        params += c.last_params
    accumulate = GRAD_ACCUMULATION_BYTES * params / tp * (m - 1) / m
    return total + Traffic(0.0, 0.0, accumulate)


# ---------------------------------------------------------------------------------------------
# Activation memory
# ---------------------------------------------------------------------------------------------
#
# Activation memory of a GPT or BERT layout: the bytes autograd keeps for backward, per layer, per
# pipeline stage and at a rank's peak under its schedule. Arithmetic only: nothing is built or run.
#
# The frame is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
# (arXiv:2205.05198): one layer keeps s*b*h*(34 + 5*a*s/h) bytes in fp16 without parallelism (sec. 4.1,
# Table 2); tensor parallelism divides the parts inside the column -> row pairs by t, sequence parallelism
# the rest too (sec. 4.2); selective recomputation drops the 5as/h attention term, full recomputation keeps
# only the layer input (sec. 5). The micro-batches alive at once follow the pipeline schedule
# (Narayanan et al. 2021, arXiv:2104.04473, sec. 2.2: 1F1B holds pp - rank, the interleaved schedule
# more). The coefficients here are not the paper's but megalm's own (megalm.models.layers, parallel/):
# each term names the tensor its ops save, checked against autograd's saved tensors on CPU by
# tests/test_plan_activations.py. Where megalm differs from the paper:
#
# - attention runs on SDPA's fused kernels, which keep q, k, v, the output and a log-sum-exp (a fp32 values
#   a token) instead of the a*s score matrices; only on CPU with attention dropout does SDPA fall back to
#   its math path, which keeps them (softmax, dropout noise, dropped probabilities: 3 a*s values a token);
#   model.attention_backend=unfused (or auto, compiled on CPU in bf16 / fp16) keeps the scores' softmax in
#   fp32 and its probabilities in the compute dtype (`_unfused_core`; what eager autograd saves: inside a
#   compiled graph AOT autograd's partitioner chooses what to keep, which is not modelled);
# - sequence parallelism keeps the all-gathered (full-sequence) input of each column-parallel linear,
#   where Megatron keeps the shard and gathers again in backward: 2h a token stay unsharded;
# - training runs fp32 by default; with bf16 / fp16 autocast the residual stream, norms, the log-softmax
#   and the statistics stay fp32, and each linear keeps a half-precision copy of its input and its weight;
# - selective recomputation wraps the attention core (Parts.selective): with fused attention that saves
#   only the log-sum-exp, the GQA-repeated keys and values and, after RoPE, SDPA's own output; not 5as/h.
# - packed sequences (data.packing: a mask per example, position ids) are not modeled;
# - a mixture of experts (`moe_kept_bytes`) keeps per routed (token, expert) row what a dense MLP keeps per
#   token, in fp32 (its grouped matmuls have no autocast rule), plus its routing's indices; the rows a rank
#   runs depend on the router, and are planned for the balanced case (`moe_rows`); under expert tensor
#   parallelism a rank runs the rows of all tp ranks through its 1/tp slices of the experts.
#
# Context parallelism (parallel.cp, megalm.parallel.context) gives each rank s = seq_length / cp tokens of
# every sequence, so every per-token term counts those; the attention core is the ring's
# (`ring_attention_bytes`): blockwise attention in fp32 (or autocast's dtype) over chunk pairs, which keeps
# the c x c scores of each pair a rank's queries attend to (2cp + 1 pairs of c = s / 2, Korthikanti's 5as/h
# term back, over the rank's share of the sequence) and, in fp32, the k and v of the whole sequence.
#
# BERT (megalm.models.bert) shares GPT's Attention and MLP; where its layer and heads differ from the paper's
# GPT layer (and from megalm's GPT):
# - its attention is bidirectional over the keys a padding mask keeps, which SDPA takes as attn_mask: on CPU
#   that stays on the fused (flash) kernel, which turns the bool mask into an additive one of q's dtype and
#   keeps it, b*s elements a layer, on every tp rank (`_key_mask`; on CUDA the memory-efficient kernel, the
#   fused one that takes a mask, keeps it too); with attention dropout on CPU the math path keeps the same
#   as GPT's. A recomputed region keeps the bool mask among its inputs: one (b, s) a stage;
# - post-norm (norm_position=post) moves the norms after the residual sums; each still keeps an fp32 sum
#   and its statistics, and the qkv input becomes the layer's input: the same bytes as pre-norm. It adds
#   a norm after the embedding (full sequence: sp splits after the embedding's norm and dropout);
# - the embedding also reads token-type ids; the heads (`_bert_head`) are the MLM transform (dense,
#   GELU, norm: on sequence shards under sp) before the tied output, and the pooler (token 0) with the
#   sentence-order head; the MLM loss runs over every position, as GPT's.
#
# Not counted: the tensors a pipeline schedule itself holds (received inputs, a stage's output until its
# backward, the gradients of intermediates that zero-bubble schedules keep until the weight pass),
# transient buffers, and the working set of a recomputed layer during its backward (`recompute_transient`
# gives it). CUDA assumptions not measured here: dropout keeps a 1-byte mask (native_dropout) where CPU
# keeps a noise tensor of the activation's dtype; SDPA stays fused with dropout; RMSNorm runs torch's fused
# kernel (input and rstd), where CPU's composite also keeps the normalized input.

INT64 = 8
_BERT_FINE_TUNING = ("BERT's fine-tuning heads (model.num_labels, num_choices, span_head) are not modelled by "
                     "megalm.plan's activation and collective formulas, only its pretraining heads (MLM and "
                     "sentence order): a classifier reads one pooled token a sequence and a span head every token, "
                     "whose saved tensors, sequence-parallel gathers and loss scalars were not measured")


@dataclass(frozen=True)
class _Shape:
    """What the formulas read, resolved once from the config: sizes of one micro-batch on one rank."""
    s: int        # tokens a sequence on this rank: model.seq_length / cp
    b: int        # sequences a micro-batch (times num_choices)
    h: int
    a: int        # query heads
    kv: int       # key / value width, kv_heads * head_dim
    groups: int   # query heads per kv head
    f: int        # ffn width
    vocab: int    # padded vocabulary rows at this tp
    t: int
    sp: bool
    e: int        # bytes of a compute element: 4 (fp32), 2 (bf16 / fp16 autocast)
    autocast: bool
    cpu: bool
    rope: bool
    swiglu: bool
    rmsnorm: bool
    bias: bool
    dropout: float
    attention_dropout: float
    lm_head: bool
    bert: bool = False        # BERT's layers and heads (megalm.models.bert); the rest are GPT's
    post_norm: bool = False   # BERT's norm_position=post: a norm after the embedding and after each residual
    token_types: bool = False  # BERT's token-type embedding
    binary_head: bool = False  # BERT's pooler and sentence-order head
    cp: int = 1               # context-parallel ranks a sequence is split over (megalm.parallel.context)
    hd: int = 0               # head_dim
    # A mixture of experts in place of each layer's MLP (megalm.models.moe; model.num_experts > 0):
    experts: int = 0          # E, every expert of a layer (0: a dense MLP)
    topk: int = 0             # k experts a token
    sigmoid: bool = False     # sigmoid scores (else softmax)
    aux: bool = False         # the load-balancing loss is on (its softmax probabilities are kept)
    z: bool = False           # the router z-loss is on (its log-sum-exp is kept)
    capacity: Optional[float] = None  # moe_capacity_factor (None: dropless)
    ep: int = 1               # expert-parallel ranks: a rank holds experts / ep of a layer
    relu: bool = False
    expert_tp: int = 1        # expert tensor parallelism (parallel.expert_tp): each expert split over tp
    unfused: bool = False     # model.attention_backend resolves to unfused (megalm.models.layers.attention_backend)

    @property
    def seq(self) -> int:
        """Divisor of the sequence-parallel region (norms, residual, hidden dropout)."""
        return self.t if self.sp else 1

    @property
    def fused_attention(self) -> bool:
        return not self.unfused and not (self.cpu and self.attention_dropout > 0)

    def mask(self, element: int) -> int:
        """Bytes a dropout keeps an element: CUDA's native_dropout a bool, CPU's a noise tensor of the input's dtype."""
        return element if self.cpu else 1


def _shape(cfg, world: int, device: Optional[str] = None) -> _Shape:
    from megalm.distributed.mesh import ParallelDims
    m, p, tr = cfg.model, cfg.parallel, cfg.trainer
    if m.arch not in ("gpt", "bert"):
        raise ConfigError(f"activation memory is derived for the gpt and bert families' layers; model.arch={m.arch}")
    bert = m.arch == "bert"
    if bert and m.fine_tuning_head:
        raise ConfigError(_BERT_FINE_TUNING)
    if m.transformer_impl != "local" or tr.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"activation memory is derived for transformer_impl=local in fp32 / bf16 / fp16; got "
                          f"model.transformer_impl={m.transformer_impl}, trainer.precision={tr.precision}")
    device = device or ("cpu" if tr.device == "cpu" else "cuda")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; choose cpu or cuda")
    dims = ParallelDims.from_config(p, world)
    if p.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"parallel.recompute={p.recompute} is not one of none, selective, full")
    return _Shape(s=m.seq_length // dims.cp, b=tr.micro_batch_size * max(1, getattr(m, "num_choices", 0)),
                  h=m.hidden_size, a=m.num_attention_heads, kv=m.kv_heads * m.head_dim,
                  groups=m.num_attention_heads // m.kv_heads, f=m.ffn_size, vocab=m.padded_vocab(dims.tp), t=dims.tp,
                  sp=p.sequence_parallel and dims.tp > 1,
                  e=FP32 if tr.precision == "fp32" else 2, autocast=tr.precision != "fp32", cpu=device == "cpu",
                  rope=getattr(m, "position_embedding", "learned") == "rope", swiglu=m.activation == "swiglu",
                  rmsnorm=m.normalization == "rmsnorm", bias=m.bias, dropout=m.dropout,
                  attention_dropout=m.attention_dropout, lm_head=not getattr(m, "fine_tuning_head", False),
                  bert=bert, post_norm=bert and m.norm_position == "post", token_types=bert and m.num_tokentypes > 0,
                  binary_head=bert and m.binary_head, cp=dims.cp, hd=m.head_dim,
                  experts=getattr(m, "num_experts", 0), topk=getattr(m, "moe_router_topk", 0),
                  sigmoid=getattr(m, "moe_router_score_function", "softmax") == "sigmoid",
                  aux=getattr(m, "moe_aux_loss_coeff", 0.0) > 0, z=getattr(m, "moe_z_loss_coeff", 0.0) > 0,
                  capacity=getattr(m, "moe_capacity_factor", None), ep=p.ep, relu=m.activation == "relu",
                  expert_tp=p.expert_tp if dims.tp > 1 else 1,
                  unfused=_unfused(m, tr, device))


def _unfused(m, tr, device: str) -> bool:
    """Whether the run's attention is the unfused one (model.attention_backend, `auto` resolved as the layers do)."""
    import torch
    from megalm.ops.attention import attention_backend
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(tr.precision, torch.float32)
    return attention_backend(getattr(m, "attention_backend", "sdpa"), device, dtype, tr.compile != "none") == "unfused"


def _norm(d: _Shape) -> float:
    """A pre-norm on the residual stream (fp32 under autocast too), per token, over the sequence-parallel region.

    LayerNorm's kernel keeps its input and the fp32 mean and rstd; RMSNorm keeps its input and rstd, and
    on CPU (torch's composite x * rsqrt(mean(x^2) + eps) * w) also the normalized x its weight multiplies."""
    return _norm_kept(d, FP32) / d.seq


def _attention_core(d: _Shape, selective: bool) -> float:
    """The attention core's saves per token (this rank's heads, so / t), q, k, v from the fused qkv linear.

    Without RoPE q, k, v are views of the qkv output, so its storage (h + 2kv) is what they keep. RoPE
    makes new q and k (h and kv), while v stays a view of qkv. Grouped-query attention repeats k and v
    to the query heads (two new h tensors) before SDPA. Fused SDPA then keeps q, k, v, its output (h)
    and the fp32 log-sum-exp (a values); its output follows q's layout, so for RoPE's contiguous q the
    (B, T, h) input of the output projection is a copy (h), for a view of qkv it is the same storage.
    The math path (CPU, attention dropout) keeps scaled q and k and v (3h, fp32 even under autocast), the
    projection's input (h) and the softmax, dropout noise and dropped probabilities (a*s fp32 each:
    Korthikanti's 5as/h term, there 2 + 1 + 2 bytes).
    With selective recomputation the core keeps only its inputs; the projection's input stays (h)."""
    h, kv = d.h, d.kv
    qkv = h + 2 * kv
    inputs = qkv if not d.rope else h + kv + qkv
    if selective:
        return (inputs + h) * d.e / d.t
    if d.unfused:
        return _unfused_core(d)
    if not d.fused_attention:  # CPU's math path computes in fp32 under autocast too, then casts its output back
        return (3 * h * FP32 + h * d.e + d.a * d.s * 3 * FP32) / d.t
    if d.groups > 1:  # k, v repeated: q (a view of qkv, or RoPE's), k_rep, v_rep
        kept = (qkv if not d.rope else h) + 2 * h
    else:
        kept = inputs
    out = h + (h if d.rope else 0)  # SDPA's output, and the projection's copy of it after RoPE
    return (kept + out) * d.e / d.t + d.a * FP32 / d.t


def _unfused_core(d: _Shape) -> float:
    """The unfused attention's saves per token (megalm.models.layers.unfused_attention; model.attention_backend),
    Korthikanti's 5as/h term in megalm's dtypes. With H = a / t heads on the rank:
    - the first matmul's operands as torch.matmul folds them to 3-D: q is RoPE's contiguous output (h), or a
      view of the qkv output, folded by a copy (h) or in place (the qkv storage) per `_reshape_copies`; k^T
      folds in place when k is contiguous (RoPE's output: kv; the grouped-query repeat: h), else like q;
    - the softmax's fp32 output (H s values); under autocast also its cast to the compute dtype, the second
      matmul's input; with attention dropout its noise (CPU: the compute dtype) and the dropped probabilities;
    - the second matmul's v: the grouped-query repeat (h), or a view of qkv, folded as q is;
    - the masked_fill's bool mask: causal, an s x s one a layer (s / b bytes a token); BERT's key mask, one a token;
    - the output projection's input, a copy of the heads' output merged back (h).
    Causal self-attention of CAUSAL_SPLIT_MIN tokens or more without dropout runs as two query halves, the first
    against the first half of the keys: scores and masks are 3/4 of the whole, and k and v, where the fold copies
    them, are copied once more for the first half (kv / 2 each)."""
    from megalm.ops.attention import CAUSAL_SPLIT_MIN  # here: the formulas import no torch until they need it
    h, kv, e, t = d.h, d.kv, d.e, d.t
    grouped = d.groups > 1
    split = not d.bert and d.attention_dropout == 0 and d.s >= CAUSAL_SPLIT_MIN and d.s % 2 == 0
    own = (h if d.rope else None, h if grouped else kv if d.rope else None, h if grouped else None)  # q, k, v
    kept = sum(w for w in own if w is not None)
    views = [width for width, w in zip((h, kv, kv), own) if w is None]  # views of the qkv output
    if views:
        copies = _reshape_copies(d.b, d.a // t, False)
        kept += sum(views) if copies else h + 2 * kv
        if copies and split:  # k's and v's first-half copies, where they are views
            kept += sum(kv for w in own[1:] if w is None) / 2
    probs = d.a * d.s / t * (0.75 if split else 1.0)
    if d.attention_dropout > 0:
        scores = probs * (FP32 + d.mask(d.e) + d.e)
    else:
        scores = probs * (FP32 + (d.e if d.autocast else 0))
    masks = (0.75 if split else 1.0) * d.s / d.b if not d.bert else 1.0
    return (kept + h) * e / t + scores + masks


def _reshape_copies(batch: int, heads: int, merged: bool) -> bool:
    """Whether torch.matmul's fold of a (batch, heads, rows, cols) operand into (batch * heads, rows, cols)
    for its bmm copies it: only when neither dimension is 1 and their strides do not merge."""
    return batch > 1 and heads > 1 and not merged


def ring_attention_bytes(d: _Shape, selective: bool = False) -> float:
    """What one layer's attention keeps for one micro-batch on one rank under context parallelism, in bytes
    (megalm.parallel.context.RingAttentionCore, in place of the layer's SDPA core; not per token: the scores
    grow with the square of the chunk). With s = seq_length / cp tokens on the rank, its two query chunks of
    c = s / 2, Hq = a / t query heads and Hk = kv_heads / t key / value heads:

    The ring runs `_partial` for every (query chunk, key chunk) pair the causal mask does not hide: query chunk
    qc sees key chunks kc < qc whole and kc == qc causally, so cp rank r's chunks r and 2cp - 1 - r see r + 1
    and 2cp - r key chunks, P = 2cp + 1 pairs on every rank (two of them diagonal). Each pair keeps full
    c x c blocks: its scores (logsumexp's input) and probabilities (exp's output), with attention dropout also
    the dropout's noise (CPU: a tensor of the scores' dtype) or mask (CUDA: a bool) and the dropped
    probabilities (the second matmul's input); a diagonal pair also its c x c bool mask (masked_fill). Each
    pair keeps its log-sum-exp (b, Hq, c, 1), and both matmuls their operands (see below). `_merge` folds a
    chunk's n pairs in with n - 1 merges, each keeping the running output and the new part (b, Hq, c, hd),
    the two exp factors (b, Hq, c, 1) and, after its first, the running log-sum-exp: over a rank's two chunks
    2(2cp - 1) outputs and 8cp - 3 log-sum-exp sized tensors on cp rank 0 (chunk 0 sees one key chunk, no
    merge); any other cp rank keeps one log-sum-exp sized tensor fewer (rank 0's is reported: the largest).

    The matmuls' operands, by precision:
    - fp32: q's slice of each pair is folded in place when q is RoPE's contiguous output (then q's storage,
      (b, s, Hq hd), is kept) or when batch or heads is 1 (then the qkv output's, (b, s, (Hq + 2 Hk) hd),
      which q views), else copied a pair (b, Hq, c, hd). Grouped-query attention repeats every block's k and
      v to Hq heads, which fold in place: the whole sequence's repeated k and v, 2 (b, Hq, cp s, hd). Without
      it k and v are halves of the (b, 2 Hk, s, hd) block that travels, copied a pair (b, Hk, c, hd) each,
      or, with batch or heads 1, folded in place: every block the rank saw, the whole sequence's k and v.
    - autocast (bf16, fp16): the ring runs with autocast off, so `_partial`'s casts of the compute-dtype
      slices to fp32 are copies: each pair keeps fp32 copies of its q (b, Hq, c, hd) and of its k and v
      ((b, Hq, c, hd) each with grouped-query attention, whose repeat comes first; else (b, Hk, c, hd)),
      and no block. Everything else is as in fp32.
    Then, outside the core: the output (the chunks' concatenation, (b, Hq, s, hd)) reaches the output
    projection as a (b, s, h / t) copy in the compute dtype, which it keeps; RoPE indexes its tables at the
    rank's positions, so each layer keeps its own cos and sin (s, hd / 2) fp32 (without cp they are views of
    the cached tables). RoPE's k, the block and v are not kept (concatenation saves nothing).

    With selective recomputation the core keeps only its inputs q, k and v (as `_attention_core`); the
    projection's input and the RoPE tables stay."""
    B, s, hd, cp, e = d.b, d.s, d.hd, d.cp, d.e
    hq, hk = d.a // d.t, d.a // d.groups // d.t
    c = s // 2
    tables = s * hd * FP32 if d.rope else 0
    proj_in = B * s * d.h * e / d.t
    if selective:
        qkv = d.h + 2 * d.kv
        inputs = qkv if not d.rope else d.h + d.kv + qkv
        return B * s * inputs * e / d.t + proj_in + tables
    pairs, merges, stats = 2 * cp + 1, 2 * cp - 1, 8 * cp - 3
    chunk = B * hq * c * hd          # one query chunk's q, or its output
    block = B * hq * c * c           # one pair's scores
    row = B * hq * c                 # one pair's log-sum-exp
    dropout = d.attention_dropout > 0
    masks = 2 * c * c
    if d.autocast:
        operands = pairs * (chunk + 2 * B * (hq if d.groups > 1 else hk) * c * hd) * FP32
    else:
        if not _reshape_copies(B, hq, d.rope):
            operands = B * s * (hq * hd if d.rope else (hq + 2 * hk) * hd) * FP32
        else:
            operands = pairs * chunk * FP32
        if d.groups > 1:
            operands += 2 * B * hq * cp * s * hd * FP32
        elif not _reshape_copies(B, hk, False):
            operands += cp * B * 2 * hk * s * hd * FP32
        else:
            operands += 2 * pairs * B * hk * c * hd * FP32
    scores = pairs * block * FP32 * 2
    if dropout:
        scores += pairs * block * (FP32 + FP32 if d.cpu else 1 + FP32)
    kept = stats * row * FP32 + 2 * merges * chunk * FP32
    return operands + scores + masks + kept + proj_in + tables


def _mlp(d: _Shape) -> float:
    """GELU: fc1's output (GELU's input) and GELU's output (fc2's input), f each. ReLU: its output only
    (its own backward and fc2's input). SwiGLU: fc1's output [gate | up] (2f, SiLU and the product keep
    views of it), SiLU's output and the product (f each). / t."""
    return (4 if d.swiglu else 1 if d.relu else 2) * d.f * d.e / d.t


def _norm_kept(d: _Shape, element: int) -> float:
    """A norm's saves per token over an input of `element` bytes (see `_norm`), not divided by sp."""
    return d.h * element + (FP32 if d.rmsnorm else 2 * FP32) + (d.h * element if d.rmsnorm and d.cpu else 0)


def _key_mask(d: _Shape) -> float:
    """BERT's padding mask in each layer's attention, per token: fused SDPA turns the (B, 1, 1, T) bool key
    mask into an additive mask of q's dtype and keeps it (one element a token, e bytes); the math path
    (CPU, attention dropout) adds it to the scores and keeps none. Not divided by tp or sp: every rank masks
    the same keys. Korthikanti et al.'s layer (GPT's causal mask) has no such term."""
    return d.e if d.bert and d.fused_attention else 0.0


def _hidden_dropout(d: _Shape) -> float:
    """The dropout after each row-parallel linear (attention output, MLP output), on the sequence shard
    under sp. Its input is the compute dtype, or fp32 when tp's row-parallel bias is added after autocast."""
    if d.dropout <= 0:
        return 0.0
    element = FP32 if d.autocast and d.t > 1 and d.bias else d.e
    return 2 * d.h * d.mask(element) / d.seq


def moe_rows(tokens: int, experts: int, topk: int, capacity: Optional[float]) -> int:
    """(token, expert) assignments a mixture-of-experts layer runs for `tokens` routed tokens, planned for the
    balanced case: dropless, all tokens x k; with a capacity factor f each expert keeps at most
    ceil(f x tokens x k / E) of its tokens x k / E, so min(tokens x k, E x ceil(f x tokens x k / E)). Under
    expert parallelism each rank also receives this many rows on average (every rank sends its rows out by
    expert; balanced routing spreads them evenly). Real routing moves these figures: an expert favoured by the
    router gets more rows than the mean (the planner does not model the imbalance)."""
    assigned = tokens * topk
    if capacity is None:
        return assigned
    return min(assigned, experts * math.ceil(capacity * assigned / experts))


def _moe_tokens(d: _Shape) -> int:
    """Tokens one rank routes in each MoE layer: its b x s, or under tp its 1/tp share (megalm.parallel.experts
    .split_tokens: the SP shard, or a shard cut from the replicated sequence)."""
    return d.b * d.s // d.t


def _moe_input(d: _Shape) -> float:
    """What a MoE layer keeps of its input (the norm's output, fp32), in bytes for one micro-batch: the
    router's linear saves it (fp32 under autocast too: the router runs with autocast off). Without tp that is
    the norm's output itself; under sp the rank's shard; under tp without sp the shard the layer cuts (a
    contiguous copy, except with one sequence a micro-batch, where the shard is a view that keeps the whole
    (s, h) output alive)."""
    if d.t > 1 and not d.sp and d.b == 1:
        return d.s * d.h * FP32
    return _moe_tokens(d) * d.h * FP32


def moe_kept_bytes(d: _Shape) -> Dict[str, float]:
    """What a mixture-of-experts layer (megalm.models.moe.MoE._forward, route, Experts; under expert
    parallelism megalm.parallel.experts.dispatch, under expert tensor parallelism run_experts) saves for
    backward besides its input, for one micro-batch on one rank, by part. N tokens routed by the rank
    (`_moe_tokens`), R = `moe_rows` assignments (the balanced case), E experts (E / ep on the rank), k a
    token, f the ffn width; the rows are fp32 (the norm's output; grouped_mm has no autocast rule, so the
    experts run in fp32 under bf16 / fp16 too).

    router: in fp32 (autocast off), at every precision. Kept: top-k's int64 indices (N k); softmax scoring the
    softmax of the top k (N k); sigmoid scoring the scores (N E) and, for k > 1, the top k and their sum
    (N k + N) of the renormalisation; with the load-balancing loss the softmax probabilities (N E) and the
    expert shares it multiplies them by (E); with the z-loss logsumexp's input and output (N E + N).
    experts: the assignment order and each row's token (R int64 each: the argsort of N k assignments, whose
    first R a capacity keeps, and order // k); the cumulative counts (E int32); fc1's input rows (R h) and
    the activation's tensors (SwiGLU: fc1's output 2f, SiLU's output and the product f each; GELU: fc1's
    output and GELU's; ReLU: its output, fc2's input too); fc2's output (R h, the weighting's input), the
    gathered weights (R) and the weighted rows index_add sums (R h). Under expert parallelism the rows are
    sent to their experts' ranks: the receiver keeps its arrival-to-expert order and its inverse (R int64
    each) and the experts' tensors for the R rows it receives (balanced: as many as it sends); the rows
    come back as a new tensor (R h), which the weighting keeps in place of fc2's output.
    Under expert tensor parallelism (T = parallel.expert_tp = tp) each tp rank runs the rows of all T tp
    ranks (after the ep exchange, if any) through its 1/T slices of the experts: fc1's input is T R rows
    (T R h), the activation's tensors T R rows of width / T (as many bytes as R rows of the whole width),
    and the gathered rows' grouping by expert keeps its order and inverse (T R int64 each); fc2's output is
    not kept (the all-to-all returning each rank its rows' partial sums takes it), and the sum of the
    partials (R h) is what the weighting keeps, or under ep what goes back (the new tensor above).
    dropout: with model.dropout, the MoE output's mask (N h, fp32 noise on CPU, a bool on CUDA)."""
    N, E, k, h, f = _moe_tokens(d), d.experts, d.topk, d.h, d.f
    R = moe_rows(N, E, k, d.capacity)
    router = N * k * INT64
    if d.sigmoid:
        router += N * E * FP32 + ((N * k + N) * FP32 if k > 1 else 0)
    else:
        router += N * k * FP32
    if d.aux:
        router += N * E * FP32 + E * FP32
    if d.z:
        router += (N * E + N) * FP32
    width = 4 * f if d.swiglu else (f if d.relu else 2 * f)
    T = d.expert_tp
    # the order and each row's token, the offsets; fc1's input rows, the activation, the weighting's input
    # (fc2's output, or the rows back), the gathered weights; the weighted rows
    experts = N * k * INT64 + R * INT64 + E // d.ep * 4 + (T * R * h + R * (width + h + 1)) * FP32 + R * h * FP32
    if d.ep > 1:  # the received rows grouped by expert and back
        experts += 2 * R * INT64
    if T > 1:  # the tp ranks' rows grouped by expert and back
        experts += 2 * T * R * INT64
    dropout = N * h * d.mask(FP32) if d.dropout > 0 else 0.0
    return {"router": router, "experts": experts, "dropout": dropout}


def layer_terms(cfg, world: int, recompute: Optional[str] = None, device: Optional[str] = None) -> Dict[str, float]:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank, by term.

    `recompute` overrides parallel.recompute (none | selective | full); `device` (cpu | cuda) defaults to
    trainer.device (auto: cuda). Per token, times s*b:
    - norms: the two pre-norms (see `_norm`), / t under sequence parallelism; BERT's post-norms (norm1 after
      the attention's residual, norm2 after the MLP's) keep the same: an fp32 residual sum and its statistics;
    - linear_inputs: the inputs of qkv and fc1, h each in the compute dtype: the norm's output (a copy under
      autocast), never sharded (tp: a view behind Megatron's f; sp: the all-gathered sequence); under
      post-norm the qkv input is the layer's input (the previous norm2's output, or the embedding's);
    - attention: `_attention_core`, or under context parallelism `ring_attention_bytes` (its chunk pairs'
      scores, the k and v it saw, the RoPE tables at its positions); key_mask: `_key_mask` (BERT); mlp:
      `_mlp`; dropout: `_hidden_dropout`;
    - full recomputation: only the block input the checkpoint saves, h fp32 (/ t under sp); BERT's key mask,
      its other input, is one bool tensor a stage shares (`stage_activation_bytes`).
    """
    d = _shape(cfg, world, device)
    mode = cfg.parallel.recompute if recompute is None else recompute
    tokens = d.s * d.b
    if mode == "full":
        return {"layer_input": tokens * d.h * FP32 / d.seq}
    if mode not in ("none", "selective"):
        raise ConfigError(f"recompute={mode} is not one of none, selective, full")
    attention = tokens * _attention_core(d, mode == "selective") if d.cp == 1 else \
        ring_attention_bytes(d, mode == "selective")
    if d.experts:  # a mixture of experts in place of the MLP
        moe = moe_kept_bytes(d)
        return {"norms": tokens * 2 * _norm(d), "linear_inputs": tokens * d.h * d.e + _moe_input(d),
                "attention": attention, "key_mask": 0.0, "router": moe["router"], "mlp": moe["experts"],
                "dropout": tokens * _hidden_dropout(d) / 2 + moe["dropout"]}
    return {"norms": tokens * 2 * _norm(d), "linear_inputs": tokens * 2 * d.h * d.e, "attention": attention,
            "key_mask": tokens * (_key_mask(d) if mode == "none" else 0.0), "mlp": tokens * _mlp(d),
            "dropout": tokens * _hidden_dropout(d)}


def layer_activation_bytes(cfg, world: int, recompute: Optional[str] = None, device: Optional[str] = None) -> int:
    """Bytes one transformer layer saves for backward, one micro-batch, one rank (tp, sp, recompute applied).

    For the default GPT-2 layer (LayerNorm, GELU, learned positions, no dropout) in fp32 without
    parallelism this is s*b*(64h + 4a + 16) bytes: 16h elements of 4 bytes (Korthikanti's 34 bytes less
    5as/h and the two 1-byte dropout masks are the same 16 elements in fp16) and the fp32 log-sum-exp and
    norm statistics; see `layer_terms`."""
    return round(sum(layer_terms(cfg, world, recompute, device).values()))


def embedding_bytes(cfg, world: int, device: Optional[str] = None) -> int:
    """What the first stage keeps for one micro-batch before the layers: the token ids its lookup reads
    (int64; under tp the local ids and the out-of-shard mask, 9 bytes; under pp without tp the lookup
    reads a view of the step's joined batch, counted once by `stage_activation_bytes`), the learned
    positions' ids (s int64), and with dropout its mask on the fp32 embedding, on the sequence shard when
    sp scatters first (RoPE models reduce-scatter the lookup; learned positions are added before the
    scatter).

    BERT adds its token-type ids (int64, read by a replicated lookup at any tp: a view of the joined batch
    under pp, counted there) and, under post-norm, the embedding's norm (fp32 input and statistics); its
    norm and dropout run on the whole sequence, which sp splits after them."""
    d = _shape(cfg, world, device)
    tokens = d.s * d.b
    ids = INT64 + 1 if d.t > 1 else (0 if cfg.parallel.pp > 1 else INT64)
    if d.token_types:
        ids += 0 if cfg.parallel.pp > 1 else INT64
    kept = tokens * ids + (0 if d.rope else d.s * INT64)
    if d.post_norm:
        kept += tokens * _norm_kept(d, FP32)
    if d.dropout > 0:
        kept += tokens * d.h * d.mask(FP32) / (d.seq if d.rope else 1)
    return round(kept)


def logits_and_loss_bytes(cfg, world: int, device: Optional[str] = None) -> int:
    """The last stage's logits and cross-entropy buffers for one micro-batch (megalm.models.losses).

    Without tp, F.cross_entropy keeps its fp32 log-softmax (padded vocabulary V) and the int64 targets;
    with tp, the vocabulary-parallel loss keeps its fp32 softmax of V/t columns, the local target ids
    and two bool masks per token, and one bool a column (its real, unpadded columns). The masked mean
    keeps the fp32 loss mask. The logits themselves are not kept. Under context parallelism (s the rank's
    tokens) the loss's weight (megalm.parallel.context.weighted_loss) keeps the micro-batch's (b,) fp32
    loss_weight. Left out: the losses' 4-byte scalars. A fine-tuning head (classifier, multiple choice)
    keeps almost nothing per token: 0."""
    d = _shape(cfg, world, device)
    if not d.lm_head:
        return 0
    per_token = FP32 * d.vocab / d.t + INT64 + FP32 + (2 if d.t > 1 else 0)
    weight = d.b * FP32 if d.cp > 1 else 0
    return round(d.s * d.b * per_token + (d.vocab / d.t if d.t > 1 else 0) + weight)


def head_bytes(cfg, world: int, device: Optional[str] = None) -> int:
    """The last stage's final norm (`_norm`) and the head's input (h in the compute dtype, full sequence:
    a view behind f under tp, gathered under sp), for one micro-batch; without the loss buffers.
    BERT's heads (`_bert_head`) in place of GPT's."""
    d = _shape(cfg, world, device)
    if d.bert:
        return round(_bert_head(d))
    return round(d.s * d.b * (_norm(d) + d.h * d.e))


def _bert_head(d: _Shape) -> float:
    """What BERT's last stage keeps after its layers, for one micro-batch (megalm.models.bert), by tensor:
    - pre-norm's final norm (`_norm`); post-norm has none;
    - the MLM transform, on sequence shards under sp: dense's input (the final norm's or the last layer's
      output, a copy under autocast, h e), GELU's input (dense's output, h e) and the norm's input (GELU's
      output: h e on CPU, where autocast leaves layer_norm in bf16; CUDA's autocast runs it in fp32, a copy
      of h fp32) with its statistics;
    - the tied output's input (the norm's output, or its copy, h e), whole sequence as GPT's head;
    - with the binary head, per sequence: tanh's output (the pooled h, also the binary head's input) and,
      under autocast, the pooler's copy of token 0 (h); in fp32 the pooler's input is a view of a tensor
      already kept, except under sp, where it views the whole gathered (s, h) fp32 sequence and keeps it
      alive; the sentence-order loss's fp32 log-softmax of 2 and int64 target.
    Korthikanti et al. count the layers only; Megatron's BERT has the same heads."""
    tokens, seqs, h, e = d.s * d.b, d.b, d.h, d.e
    norm_in = e if d.autocast and d.cpu else FP32
    kept = tokens * ((0 if d.post_norm else _norm(d)) + (2 * h * e + _norm_kept(d, norm_in)) / d.seq + h * e)
    if d.binary_head:
        kept += seqs * (h * e + (h * 2 if d.autocast else 0) + (d.s * h * FP32 if d.sp and not d.autocast else 0))
        kept += seqs * (2 * FP32 + INT64)
    return kept


def _weight_copy_bytes(d: _Shape, layers: int, last: bool) -> int:
    """Under autocast each linear keeps the half-precision copy of its weight it multiplied with: qkv, proj,
    fc1, fc2 of each layer that is not recomputed whole, and the head's on the last stage (/ t). Autocast
    caches the copy for its context, so a rank holds one set however many micro-batches are in flight.
    BERT's last stage adds its replicated MLM dense and, with the binary head, the pooler's and the head's.
    A mixture of experts has none in place of fc1's and fc2's: its router runs in fp32 with autocast off, and
    the experts' grouped_mm has no autocast rule (fp32 rows by fp32 weights)."""
    if not d.autocast:
        return 0
    per_layer = d.h * (d.h + 2 * d.kv) + d.h * d.h + (0 if d.experts else d.h * d.f * (3 if d.swiglu else 2))
    replicated = (d.h * d.h + (d.h * d.h + 2 * d.h if d.binary_head else 0)) * d.e if last and d.bert else 0
    return (layers * per_layer + (d.vocab * d.h if last and d.lm_head else 0)) * d.e // d.t + replicated


def schedule_actions(schedule: str, pp: int, rank: int, v: int, m: int) -> List[Tuple[str, int, int]]:
    """The compute actions pipeline rank `rank` runs in one step, in order, each as (kind, local
    stage k, micro-batch): `schedule_order`'s actions of that rank, its stages numbered in its own order.

    With stages of equal size the forwards alive at the peak (in virtual-stage units; divide by v for
    whole-rank micro-batches) come out as: gpipe m; 1f1b min(pp - rank, m); interleaved_1f1b
    min((v - 1) * R + 2 * (pp - 1 - rank) + 1, m * v) with R = m / max(1, m // pp) micro-batches a
    round (Megatron's (pp - rank - 1) * 2 + (v - 1) * pp warm-up plus the forward of the first 1F1B
    step, arXiv:2104.04473 sec. 2.2); interleaved_zb min((v - 1) * R + pp, m * v), the same for every
    rank (its warm-up is shorter by pp - 1 - rank, its weight passes trail by rank); zbv
    min(2 * pp, m + 1 + rank). A zero-bubble forward stays alive until its weight pass."""
    if schedule not in ("gpipe", "1f1b", *MULTI_STAGE):
        raise ConfigError(f"parallel.pipeline_schedule={schedule} is not one of gpipe, 1f1b, "
                          f"{', '.join(MULTI_STAGE)}")
    local = {s: k for k, s in enumerate(virtual_stages_of(rank, pp, v, schedule))}
    return [(kind, local[s], i) for kind, s, i in schedule_order(schedule, pp, v, m)[rank]]


def _peak(actions, kept: List[int], freed_by_input: List[int]) -> Tuple[int, int]:
    """The largest sum of activations alive over the actions, and the forwards alive at that moment."""
    live = alive = peak = at_peak = 0
    for kind, k, _ in actions:
        if kind == "F":
            live, alive = live + kept[k], alive + 1
            if live > peak:
                peak, at_peak = live, alive
        elif kind == "I":
            live -= freed_by_input[k]
        else:  # B frees the whole forward, W what the input pass left
            live -= kept[k] - (freed_by_input[k] if kind == "W" else 0)
            alive -= 1
    return peak, at_peak


def stage_activation_bytes(cfg, world: int, pp_rank: int, device: Optional[str] = None) -> Dict[str, object]:
    """Activation memory of pipeline rank `pp_rank` (any tp / dp rank of it; under context parallelism cp
    rank 0's, which `ring_attention_bytes` shows is the largest by a log-sum-exp a layer), over all its
    virtual stages.

    Keys: layers (transformer layers it holds), per_microbatch (bytes one micro-batch leaves saved on it:
    its layers, the embedding on the first stage, final norm, head input and loss buffers on the last),
    logits_and_loss (those loss buffers, 0 off the last stage), microbatches (m = global_batch /
    (micro_batch * dp)), in_flight (micro-batches alive at the peak, in whole-rank units: forwards of its
    virtual stages alive / their number), weight_copies (autocast's half-precision weights, once),
    batch_ids (the step's token ids a pipeline's first stage keeps without tp, and BERT's token types,
    once), peak (the largest total of saved activations during a step: the schedule's peak of per-stage
    bytes plus the two above),
    recompute_transient (what the backward of one recomputed layer rebuilds while it runs, on top of
    peak), per_stage (bytes of one micro-batch through each virtual stage, in this rank's order).

    Layer ranges come from megalm.parallel.stages, as parallelize splits them; the schedule's order of
    forwards and backwards from `schedule_actions`. Without a pipeline the trainer runs each micro-batch's
    forward and backward before the next: one in flight.
    """
    from megalm.distributed.mesh import ParallelDims
    from megalm.parallel.stages import stage_layer_ranges, virtual_stages_of
    p, t = cfg.parallel, cfg.trainer
    d = _shape(cfg, world, device)
    dims = ParallelDims.from_config(p, world)
    if not 0 <= pp_rank < dims.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside the pipeline of parallel.pp={dims.pp} ranks")
    if t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size("
                          f"{t.micro_batch_size}) * dp({dims.dp})")
    m = t.global_batch_size // (t.micro_batch_size * dims.dp)
    v = virtual_stages_per_rank(cfg, dims.pp)
    num_stages = dims.pp * v
    ranges = stage_layer_ranges(cfg.model.num_layers, num_stages, p.layers_per_stage if dims.pp > 1 else None)
    stage_ids = virtual_stages_of(pp_rank, dims.pp, v, p.pipeline_schedule) if dims.pp > 1 else [0]
    plain = layer_activation_bytes(cfg, world, "none" if p.recompute == "full" else None, device)
    whole = layer_activation_bytes(cfg, world, "full", device)
    rebuilt = layer_activation_bytes(cfg, world, "none", device) - layer_activation_bytes(cfg, world, None, device)
    n_full = cfg.model.num_layers if p.recompute_num_layers is None else p.recompute_num_layers
    head, loss = head_bytes(cfg, world, device), logits_and_loss_bytes(cfg, world, device)
    kept, freed_by_input, kept_layers = [], [], 0
    for s in stage_ids:
        n = len(ranges[s])
        full = min(n, n_full) if p.recompute == "full" else 0
        kept_layers += n - full
        last = s == num_stages - 1
        # BERT: a recomputed region (a layer, or the attention core) saves its inputs, the key mask among
        # them: the stage's one bool (b, s) tensor, shared by its layers.
        checkpointed = full if p.recompute == "full" else (n if p.recompute == "selective" else 0)
        kept.append(full * whole + (n - full) * plain + (embedding_bytes(cfg, world, device) if s == 0 else 0)
                    + (head + loss if last else 0) + (d.b * d.s if d.bert and checkpointed else 0))
        # The zero-bubble input pass drops what no weight gradient needs: the loss buffers behind the head.
        freed_by_input.append(loss if last else 0)
    weights = _weight_copy_bytes(d, kept_layers, num_stages - 1 in stage_ids)
    # The schedule splits the step's joined batch: without tp the embedding keeps views of its token ids,
    # and BERT's token-type lookup (replicated at any tp) views of its token types.
    joined = (d.t == 1) + d.token_types
    batch_ids = m * d.b * d.s * INT64 * joined if dims.pp > 1 and 0 in stage_ids else 0
    if dims.pp == 1:
        peak, alive = kept[0], 1
    else:
        peak, alive = _peak(schedule_actions(p.pipeline_schedule, dims.pp, pp_rank, v, m), kept, freed_by_input)
    return {"layers": sum(len(ranges[s]) for s in stage_ids), "per_microbatch": sum(kept),
            "logits_and_loss": loss if num_stages - 1 in stage_ids else 0, "microbatches": m,
            "in_flight": alive / v, "weight_copies": weights, "batch_ids": batch_ids,
            "peak": peak + weights + batch_ids, "recompute_transient": rebuilt, "per_stage": kept}


# ---------------------------------------------------------------------------------------------
# Collectives of a step, and the model state a rank holds
# ---------------------------------------------------------------------------------------------
#
# The collectives of one optimizer step and the exact model state of one rank, as formulas.
#
# Every count here is what megalm's code issues, term by term, for a GPT language model or BERT's
# pretraining (fine-tuning heads are not covered yet); bytes are counted as
# megalm.distributed.comm.CommStats counts them: an all-reduce its full tensor, an all-gather its local
# input, a reduce-scatter its full input, a send or receive its tensor. What is structural (which layers
# and buckets a rank holds, the ZeRO shards, padding included) is read off the meta-device model laid
# out over a fake process group of the layout's size, by the same code a run uses
# (megalm.parallel.parallelize and the DataParallel bucket layout); nothing is allocated. The rest is
# arithmetic on the config.
#
# Shapes: b = trainer.micro_batch_size, s = model.seq_length (the rank's seq_length / cp under context
# parallelism), h = model.hidden_size, m micro-batches a step (global_batch_size / (b dp): cp ranks share
# each micro-batch), L the layers this rank runs. fp32 tensors cost 4 bytes an element;
# under trainer.precision bf16 / fp16, autocast runs the matmuls in 2-byte floats, so a row-parallel
# layer's partial sums (and their gradients) are 2 bytes an element, while the embedding, the norms'
# outputs, the residual stream that crosses pipeline stages and the loss's scalars stay fp32.
#
# A step means a step after the first, as the trainer runs it: in the first, torch's pipeline schedules
# also infer the stages' shapes, which can run a stage's forward once more.

PURPOSES = ("tp", "cp", "ep", "pp", "dp", "edp", "embedding", "other")
ZERO_BUBBLE = ("interleaved_zb", "zbv")  # weight-gradient passes of their own (no accumulate hooks)

Kinds = Dict[str, Dict[str, int]]        # {kind: {"calls": n, "bytes": b}}
Collectives = Dict[str, Kinds]           # {purpose: Kinds}


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """What one rank of a layout holds and runs, read off the meta-device model (elements, not bytes)."""
    tp: int
    pp: int
    dp: int
    pp_rank: int
    stage_layers: Tuple[int, ...]      # layers of each of this rank's (virtual) stages, in its order
    stage_ids: Tuple[int, ...]
    owner: Tuple[int, ...]             # the pp rank running each stage
    params: int                        # elements this rank's model holds (a tied weight once)
    param_bytes: int
    buckets: Tuple[Tuple[int, int], ...] = ()  # (elements padded to a multiple of dp x cp, elements / (dp x cp))
    zero3_unit_buckets: Tuple[int, ...] = ()   # ZeRO-3: per unit, the shard elements of its buckets (not the
    zero3_unit_calls: int = 0                  # experts'); the buckets of every unit (a shared one per unit)
    owned: int = 0                     # elements of this rank's ZeRO shards of real parameters
    sp_elements: int = 0               # gradient elements summed over tp (sequence-parallel tags)
    tied_elements: int = 0             # gradient elements summed over the embedding group
    embedding_group: bool = False
    cp: int = 1                        # context-parallel ranks: buckets and ZeRO shards span dp x cp
    ep: int = 1                        # expert-parallel ranks (parallel.ep): E / ep experts a MoE layer here
    expert_buckets: Tuple[Tuple[int, int], ...] = ()  # experts' buckets over the (dp / ep) x cp ranks holding
                                                       # them: (elements padded to a multiple of that, / that)
    zero3_expert_unit_buckets: Tuple[int, ...] = ()  # ZeRO-3 under ep: per unit, the shard elements of its experts'
    zero3_expert_unit_calls: int = 0                 # buckets, and how many (gathered over (dp / ep) x cp)
    expert_tp: int = 1                 # tp ranks each expert is split over (parallel.expert_tp; 1: whole)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, over which gradients are averaged and ZeRO shards: dp x cp
        (megalm.distributed.mesh.replica_mesh)."""
        return self.dp * self.cp

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return len(self.owner) - 1 in self.stage_ids


_CACHE: Dict[tuple, RankLayout] = {}


def _check(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int, cp_rank: int = 0):
    from megalm.distributed.mesh import ParallelDims
    m, p, d = cfg.model, cfg.parallel, cfg.data
    if m.arch == "bert" and m.fine_tuning_head:
        raise ConfigError(_BERT_FINE_TUNING)
    if m.arch not in ("gpt", "bert") or getattr(m, "fine_tuning_head", False):
        raise ConfigError(f"megalm.plan's collective formulas cover GPT language models and BERT's pretraining; "
                          f"model.arch={m.arch!r}{' with a fine-tuning head' if m.arch == 'gpt' else ''} is not "
                          "modelled yet")
    if d.source == "sft" and d.packing:
        raise ConfigError("data.packing=true: stage boundaries then carry position and segment ids, which "
                          "megalm.plan's collective formulas do not model yet")
    dims = ParallelDims.from_config(p, world)
    if p.zero_stage == 3 and dims.pp > 1 and p.pipeline_schedule in ZERO_BUBBLE:
        raise ConfigError(f"parallel.zero_stage=3 with pipeline_schedule={p.pipeline_schedule}: a unit stays "
                          "gathered from its first input-gradient pass to the end of the step there, so its "
                          "all-gathers depend on the schedule's order of passes, which is not modelled")
    for name, value, size in (("pp_rank", pp_rank, dims.pp), ("tp_rank", tp_rank, dims.tp),
                              ("dp_rank", dp_rank, dims.dp), ("cp_rank", cp_rank, dims.cp)):
        if not 0 <= value < size:
            raise ValueError(f"{name}={value} is outside the layout's {size} ({name[:2]}={size})")
    return dims


def rank_layout(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0, cp_rank: int = 0) -> RankLayout:
    """The RankLayout of the rank at (pp_rank, dp_rank, cp_rank, tp_rank), from the meta-device model laid
    out over a fake process group of `world` ranks (torch's testing backend), as megalm.plan does."""
    dims = _check(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    # Recomputation changes no parameter, bucket or shard, and ZeRO-2 lays out ZeRO-1's buckets and shards
    # (it only frees the full gradients sooner): layouts that differ only there share a reading.
    layout_fields = dataclasses.replace(cfg.parallel, recompute="none", recompute_num_layers=None,
                                        zero_stage=1 if cfg.parallel.zero_stage == 2 else cfg.parallel.zero_stage)
    key = (repr(cfg.model), repr(layout_fields), world, pp_rank, tp_rank, dp_rank, cp_rank)
    if key not in _CACHE:  # megalm.distributed.mesh's rank order: (pp, dp, cp, tp), tp fastest
        _CACHE[key] = _read_layout(cfg, dims, ((pp_rank * dims.dp + dp_rank) * dims.cp + cp_rank) * dims.tp + tp_rank)
    return _CACHE[key]


def _read_layout(cfg, dims, rank: int) -> RankLayout:
    import torch.distributed as dist
    from megalm.distributed.mesh import build_mesh
    from megalm.models import build_model, family_of
    from megalm.parallel import build_data_parallel, parallelize
    p = cfg.parallel
    world = dims.world_size
    if world > 1:
        if dist.is_initialized():
            raise RuntimeError("rank_layout lays the model out over a fake process group of its own: call it "
                               "where no process group is initialised (megalm.plan, not inside a run)")
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(dims, "cpu") if world > 1 else None
        model = build_model(cfg.model, device="meta")
        layout = parallelize(model, family_of(model.cfg.arch), mesh, p, seed=cfg.trainer.seed)
        params = list(model.parameters())
        v = len(layout.stage_ids)
        owner = tuple(next(r for r in range(dims.pp) if s in virtual_stages_of(r, dims.pp, v, p.pipeline_schedule))
                      for s in range(layout.num_stages)) if dims.pp > 1 else (0,)
        fields = dict(tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, ep=p.ep,
                      expert_tp=p.expert_tp if dims.tp > 1 else 1,
                      pp_rank=rank // (dims.dp * dims.cp * dims.tp),
                      stage_layers=tuple(len(layout.stage_ranges[s]) for s in layout.stage_ids),
                      stage_ids=tuple(layout.stage_ids), owner=owner, params=sum(q.numel() for q in params),
                      param_bytes=sum(q.numel() * q.element_size() for q in params))
        if mesh is None:
            return RankLayout(**fields)
        # The bucket layout of a run (parallel/data.py, zero3.py), built on the meta device.
        dp = build_data_parallel(model, family_of(model.cfg.arch), mesh, layout, p.zero_stage, p.bucket_size_mb)
        tied = layout.tied_param(model)
        if dp.sharded:
            grads = [(s.tensor, s.stop - s.start, s.param is tied) for s in dp.shards]
        else:
            grads = [(q, q.numel(), q is tied) for q in dp.params]
        experts = [getattr(b.params[0], "ep_shard", None) is not None for b in dp.buckets]
        fields.update(
            buckets=tuple((b.size, b.shard_size) for b, e in zip(dp.buckets, experts) if not e),
            expert_buckets=tuple((b.size, b.shard_size) for b, e in zip(dp.buckets, experts) if e),
            owned=sum(s.stop - s.start for s in dp.shards),
            sp_elements=sum(n for t, n, _ in grads if getattr(t, "sequence_parallel", False)),
            tied_elements=sum(n for _, n, is_tied in grads if is_tied),
            embedding_group=layout.embedding_group is not None)
        if p.zero_stage == 3:  # each unit's buckets, the experts' (over their own group) apart
            is_experts = {id(b): e for b, e in zip(dp.buckets, experts)}
            for key, want in (("zero3_unit", False), ("zero3_expert_unit", True)):
                per_unit = [[b for b in dp.unit_buckets[u] if is_experts[id(b)] == want] for u in dp.units]
                fields[f"{key}_buckets"] = tuple(sum(b.shard_size for b in bs) for bs in per_unit)
                fields[f"{key}_calls"] = sum(len(bs) for bs in per_unit)
        return RankLayout(**fields)
    finally:
        if world > 1:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# One step's collectives
# ---------------------------------------------------------------------------------------------

def _add(kinds: Kinds, kind: str, calls: int, nbytes: int) -> None:
    if calls:
        entry = kinds.setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += calls
        entry["bytes"] += nbytes


def microbatches(cfg, dp: int) -> int:
    t = cfg.trainer
    return t.global_batch_size // (t.micro_batch_size * dp)


def local_tokens(cfg) -> int:
    """Tokens of a sequence on one rank: model.seq_length, or its 1 / cp under context parallelism
    (megalm.parallel.context: two chunks of 2 x cp)."""
    return cfg.model.seq_length // cfg.parallel.cp


def _replayed_layers(cfg, lay: RankLayout) -> int:
    """Layers of this rank whose forward full recomputation replays in backward (every layer of each of
    its stages, or the first recompute_num_layers of each)."""
    n = cfg.parallel.recompute_num_layers
    return sum(k if n is None else min(n, k) for k in lay.stage_layers)


def tensor_parallel(cfg, lay: RankLayout) -> Kinds:
    """Tensor- and sequence-parallel collectives of one step on this rank (megalm.parallel.tensor).

    Megatron-LM (Shoeybi et al., arXiv:1909.08053, sec. 3): a column-parallel linear's f is the
    identity forward and an all-reduce of its input's gradient backward; a row-parallel linear's g
    all-reduces its partial output forward. A layer has two pairs (attention qkv -> proj, MLP fc1 ->
    fc2): per micro-batch 2 all-reduces of (b, s, h) forward and 2 backward. The vocabulary-parallel
    embedding all-reduces its lookup forward; the head is column-parallel (one f); the vocabulary-
    parallel cross-entropy all-reduces the max (b, s) and then (sum of exp, target logit) (2, b, s)
    in fp32 (label smoothing 0, GPT's loss).

    Sequence parallelism (Korthikanti et al., arXiv:2205.05198, sec. 4.2.2) turns each f into an
    all-gather of the (b, s/tp, h) shard forward and a reduce-scatter of (b, s, h) backward, each g
    into a reduce-scatter forward and an all-gather backward. The embedding's lookup is all-reduced
    and then split by sequence (learned positions are added to the whole sequence; the split's
    backward all-gathers), or with RoPE reduce-scattered straight into shards (its backward
    all-gathers). Once a step the gradients of sequence-parallel parameters (norms, row-parallel
    biases: this rank's elements of them) are summed over tp in one all-reduce (parallel/grads.py).

    Full recomputation (parallel/recompute.py, torch.utils.checkpoint non-reentrant) replays each
    recomputed layer's forward in backward, up to the last operation that saves a tensor for
    backward (checkpoint's early stop): the attention's g, and the MLP's g only when hidden dropout
    is on (dropout saves its mask; with none, nothing after that g saves anything) or, in BERT's
    post-norm layer, always (norm2 saves its input). Selective recomputation replays the attention
    core, which communicates nothing.

    BERT (megalm.models.bert's tp_plan) has GPT's layers and embedding (learned positions: all-reduce,
    then the sequence split) and its vocabulary-parallel loss; its MLM head's output is column-parallel
    (one f, as GPT's head); its MLM dense and norm run on sequence shards, and under sp the pooler, which
    reads token 0, all-gathers the (b, s/tp, h) fp32 sequence forward (its backward keeps this rank's
    chunk: no collective). The MLM accuracy (VocabParallelLMLoss.correct, no autograd) adds two fp32
    (b, s) all-reduces a micro-batch through torch.distributed directly (`untracked_collectives`).

    Under context parallelism s is the rank's seq_length / cp tokens: every one of these runs on them.

    A mixture of experts (model.num_experts > 0) has no MLP pair: each tp rank routes its own share of the
    tokens through replicated experts (megalm.parallel.experts.split_tokens). Under sp that is its sequence
    shard, with no collective; without sp the layer cuts its shard of the replicated sequence (scatter_seq:
    an all-gather of the fp32 (b, s/tp, h) gradient backward) and all-gathers its fp32 output
    (gather_seq_replicated: forward; backward keeps the rank's chunk). Full recomputation's replay stops
    before that gather (the layer's last saving op comes first), so only the attention's f and g replay.
    The router's and experts' gradients are partial on every tp rank (tagged sequence_parallel): they join
    the once-a-step sum over tp, with sp or without; under expert tensor parallelism the experts are split
    over tp instead (their slices' gradients are whole: only the router joins the sum), and their rows'
    all-to-alls over tp (`expert_tensor_parallel`) count under "tp" too. The routing counts' all-reduce over
    the token group is issued through torch.distributed directly (`untracked_collectives`).
    """
    kinds: Kinds = {}
    if lay.tp == 1:
        return kinds
    mdl, p, t = cfg.model, cfg.parallel, cfg.trainer
    tp, sp = lay.tp, p.sequence_parallel
    b, s, h = t.micro_batch_size, local_tokens(cfg), mdl.hidden_size
    low = 2 if t.precision in ("bf16", "fp16") else 4
    act, act_low = b * s * h * FP32, b * s * h * low           # (b, s, h): fp32; a matmul's output
    shard, shard_low = act // tp, act_low // tp                # (b, s/tp, h)
    layers = sum(lay.stage_layers)
    replayed = _replayed_layers(cfg, lay) if p.recompute == "full" else 0
    post_norm = mdl.arch == "bert" and mdl.norm_position == "post"
    moe = bool(getattr(mdl, "num_experts", 0))
    pairs = 1 if moe else 2  # column -> row pairs a layer: attention's, and the dense MLP's
    g_replayed = replayed * (2 if (mdl.dropout > 0 or post_norm) and not moe else 1)
    f_replayed = replayed * pairs
    per_mb: Kinds = {}
    if lay.first:
        if sp and getattr(mdl, "position_embedding", "learned") != "learned":
            _add(per_mb, "reduce_scatter", 1, act)
        else:
            _add(per_mb, "all_reduce", 1, act)
        if sp:
            _add(per_mb, "all_gather", 1, shard)  # backward of the sequence split
    n = pairs * layers
    if sp:
        _add(per_mb, "all_gather", n + f_replayed, shard * (n + f_replayed))        # f forward
        _add(per_mb, "reduce_scatter", n + g_replayed, act_low * (n + g_replayed))  # g forward
        _add(per_mb, "reduce_scatter", n, act * n)                                  # f backward
        _add(per_mb, "all_gather", n, shard_low * n)                                # g backward
    else:
        _add(per_mb, "all_reduce", n + g_replayed, act_low * (n + g_replayed))      # g forward
        _add(per_mb, "all_reduce", n, act * n)                                      # f backward
        if moe:  # the MoE layer's own shard: its output gathered forward, its input's gradient backward
            _add(per_mb, "all_gather", 2 * layers, shard * 2 * layers)
    if lay.last:
        if sp:
            _add(per_mb, "all_gather", 1, shard)
            _add(per_mb, "reduce_scatter", 1, act)
            if mdl.arch == "bert" and mdl.binary_head:
                _add(per_mb, "all_gather", 1, shard)  # the pooler's gather of the sequence
        else:
            _add(per_mb, "all_reduce", 1, act)
        tokens = b * s * FP32
        _add(per_mb, "all_reduce", 2, tokens + 2 * tokens)
    m = microbatches(cfg, lay.dp)
    for kind, e in per_mb.items():
        _add(kinds, kind, m * e["calls"], m * e["bytes"])
    if lay.sp_elements:  # sp's norms; a mixture's router and experts (with sp or without)
        _add(kinds, "all_reduce", 1, lay.sp_elements * FP32)
    return kinds


def boundary_messages(cfg, tp: int) -> Tuple[List[int], int]:
    """Bytes of the tensors one micro-batch sends across a stage boundary: forward (the hidden states (b, s, h)
    fp32, (b, s/tp, h) under sp, s the rank's seq_length / cp tokens under context parallelism; BERT's (b, s)
    int64 padding mask beside them) and backward (the hidden states' gradient)."""
    mdl, t = cfg.model, cfg.trainer
    seq = local_tokens(cfg) // tp if cfg.parallel.sequence_parallel else local_tokens(cfg)
    msg = t.micro_batch_size * seq * mdl.hidden_size * FP32
    return [msg] + ([t.micro_batch_size * mdl.seq_length * INT64] if mdl.arch == "bert" else []), msg


def pipeline(cfg, lay: RankLayout) -> Kinds:
    """Point-to-point messages of one step (torch.distributed.pipelining; Narayanan et al.,
    arXiv:2104.04473, sec. 2.2): per micro-batch and per boundary between two stages of different
    ranks, the activation (b, s, h) fp32 forward and its gradient backward, each sent by one rank and
    received by the other; (b, s/tp, h) under sequence parallelism, where the stream between layers
    is split by sequence. Every schedule sends the same messages, only in another order; a boundary
    between two stages of one rank (ZBV's turn of the V) is handed over in memory.

    BERT's stages pass (hidden, padding mask): forward also the (b, s) int64 mask (whole sequence at any
    tp), backward only the hidden states' gradient (the mask has none)."""
    kinds: Kinds = {}
    if lay.pp == 1:
        return kinds
    forward, msg = boundary_messages(cfg, lay.tp)
    last = len(lay.owner) - 1
    inward = sum(s > 0 and lay.owner[s - 1] != lay.pp_rank for s in lay.stage_ids)  # from another rank's stage
    outward = sum(s < last and lay.owner[s + 1] != lay.pp_rank for s in lay.stage_ids)
    m = microbatches(cfg, lay.dp)
    # a boundary's upstream rank sends forward and receives the gradient; its downstream rank the reverse
    _add(kinds, "send", m * (outward * len(forward) + inward), m * (outward * sum(forward) + inward * msg))
    _add(kinds, "recv", m * (inward * len(forward) + outward), m * (inward * sum(forward) + outward * msg))
    return kinds


def context_parallel(cfg, lay: RankLayout) -> Kinds:
    """The ring's point-to-point exchanges of one step (megalm.parallel.context, counted by count_comm as kind
    "ring": one call a send, with the bytes of the block sent; its receive is the neighbour's send).

    Ring attention (Liu et al. 2023, arXiv:2310.01889; Megatron-Core's layout of 2 x cp chunks): each layer's
    attention passes the rank's (k, v) block, (b, 2 kv_heads / tp, s, head_dim) in the compute dtype (s =
    seq_length / cp tokens), on around the cp ring: cp - 1 sends forward a micro-batch, and cp - 1 sends of
    their gradients backward (`megalm.parallel.context.ring_bytes`). Recomputation replays the forward's
    sends in backward: selective recomputation's attention core in every layer, full recomputation's
    replayed layers (the core comes before the layer's last saving op, where checkpoint's replay stops)."""
    kinds: Kinds = {}
    if lay.cp == 1:
        return kinds
    p = cfg.parallel
    block = ring_block_bytes(cfg, lay.tp)
    layers = sum(lay.stage_layers)
    replayed = layers if p.recompute == "selective" else _replayed_layers(cfg, lay) if p.recompute == "full" else 0
    sends = microbatches(cfg, lay.dp) * (lay.cp - 1) * (2 * layers + replayed)
    _add(kinds, "ring", sends, sends * block)
    return kinds


def data_parallel(cfg, lay: RankLayout) -> Kinds:
    """Gradient and parameter collectives over the replicas of one step (parallel/data.py, zero3.py): the dp
    group, or under context parallelism dp x cp (every rank holding the same weights).

    ZeRO (Rajbhandari et al., arXiv:1910.02054): one collective per gradient bucket, each bucket
    padded to a multiple of the replicas: an all-reduce (stage 0) or a reduce-scatter (stages 1-3) of the
    whole bucket, fp32. Stages 1 and 2 all-gather each bucket's 1/replicas of updated parameters after the
    optimizer step. Stage 3 (sec. 5.3) instead gathers parameters when they are used: every micro-
    batch, each unit's buckets in its forward (a bucket two units share, the tied embedding, once for
    each) and every bucket once in backward. A run of one replica (dp x cp = 1) has no buckets and
    communicates nothing here. Under expert parallelism the experts' buckets are `expert_data_parallel`'s."""
    kinds: Kinds = {}
    if not lay.buckets:
        return kinds
    z = cfg.parallel.zero_stage
    n = len(lay.buckets)
    full = sum(size for size, _ in lay.buckets) * FP32
    shards = sum(shard for _, shard in lay.buckets) * FP32
    _add(kinds, "all_reduce" if z == 0 else "reduce_scatter", n, full)
    if z in (1, 2):
        _add(kinds, "all_gather", n, shards)
    elif z == 3:
        m = microbatches(cfg, lay.dp)
        _add(kinds, "all_gather", m * (lay.zero3_unit_calls + n), m * (sum(lay.zero3_unit_buckets) * FP32 + shards))
    return kinds


def expert_data_parallel(cfg, lay: RankLayout) -> Kinds:
    """The experts' buckets under expert parallelism (parallel.ep > 1; megalm.parallel.data): gradients of the
    experts a rank holds (tagged ep_shard) are bucketed apart and reduced over the expert-data-parallel group,
    the (dp / ep) x cp ranks holding the same experts (megalm.parallel.experts.expert_groups), each bucket padded
    to a multiple of that size: an all-reduce (ZeRO-0) or a reduce-scatter (ZeRO-1/2/3) of the whole bucket, fp32,
    and ZeRO-1/2's all-gather of each bucket's updated shard after the optimizer step. ZeRO-3 (megalm.parallel.zero3)
    keeps the experts in buckets of their own in each layer's unit, sharded over that group, and gathers them
    over it as `data_parallel` gathers the rest: every micro-batch, in the layer's forward and again in its
    backward. A group of one rank (dp = ep) still issues them. Without expert parallelism experts are ordinary
    parameters in the dp buckets (under expert tensor parallelism, their tp slices)."""
    kinds: Kinds = {}
    if not lay.expert_buckets:
        return kinds
    z, n = cfg.parallel.zero_stage, len(lay.expert_buckets)
    shards = sum(c for _, c in lay.expert_buckets) * FP32
    _add(kinds, "all_reduce" if z == 0 else "reduce_scatter", n, sum(b for b, _ in lay.expert_buckets) * FP32)
    if z in (1, 2):
        _add(kinds, "all_gather", n, shards)
    elif z == 3:
        m = microbatches(cfg, lay.dp)
        _add(kinds, "all_gather", m * (lay.zero3_expert_unit_calls + n),
             m * (sum(lay.zero3_expert_unit_buckets) * FP32 + shards))
    return kinds


def moe_row_bytes(cfg, tp: int) -> int:
    """Bytes of one all-to-all of a MoE layer's rows under expert parallelism, for one micro-batch: the `moe_rows`
    (token, expert) rows of the rank's routed tokens (b x s / tp), h fp32 each (the norm's output; the experts'
    output back). Balanced routing: what a rank sends out equals what it receives and sends back. Expert tensor
    parallelism's all-to-alls send tp times this (`expert_tensor_parallel`)."""
    m, t = cfg.model, cfg.trainer
    tokens = t.micro_batch_size * local_tokens(cfg) // tp
    return moe_rows(tokens, m.num_experts, m.moe_router_topk, m.moe_capacity_factor) * m.hidden_size * FP32


def _moe_passes(cfg, lay: RankLayout) -> int:
    """Forwards of the rank's MoE layers in a step: each layer once a micro-batch, and again where full
    recomputation replays it (its routing and dispatch come before the layer's last saving op)."""
    layers = sum(lay.stage_layers)
    replayed = _replayed_layers(cfg, lay) if cfg.parallel.recompute == "full" else 0
    return microbatches(cfg, lay.dp) * (layers + replayed)


def expert_parallel(cfg, lay: RankLayout) -> Kinds:
    """The all-to-alls of expert parallelism that count_comm records (megalm.parallel.experts.dispatch, kind
    "all_to_all", bytes: the rows the rank sends): each MoE forward sends its rows to their experts' ranks and
    the experts' outputs back, two a layer and micro-batch (and again where full recomputation replays the
    layer), and its backward sends both gradients back, two more a layer and micro-batch; `moe_row_bytes`
    each. The counts sent before the rows go through torch.distributed directly (`untracked_collectives`)."""
    kinds: Kinds = {}
    if lay.ep == 1:
        return kinds
    calls = 2 * _moe_passes(cfg, lay) + 2 * microbatches(cfg, lay.dp) * sum(lay.stage_layers)
    _add(kinds, "all_to_all", calls, calls * moe_row_bytes(cfg, lay.tp))
    return kinds


def expert_tensor_parallel(cfg, lay: RankLayout) -> Kinds:
    """The all-to-alls of expert tensor parallelism (parallel.expert_tp = tp > 1; megalm.parallel.experts
    .run_experts, kind "all_to_all" over the tp group, bytes: what the rank sends), counted under "tp": in each
    MoE forward (and its replay under full recomputation) a rank sends its rows to every tp rank (tp copies of
    the R = `moe_rows` rows of its tokens, or under ep of the rows it received, as many when balanced) and
    sends each tp rank its rows' partial outputs back (the tp x R rows it ran, h fp32); backward, the two
    gradients go back the same ways; each tp x `moe_row_bytes`. The per-expert counts gathered over tp first
    go through torch.distributed directly (`untracked_collectives`)."""
    kinds: Kinds = {}
    if lay.expert_tp == 1 or not getattr(cfg.model, "num_experts", 0):
        return kinds
    calls = 2 * _moe_passes(cfg, lay) + 2 * microbatches(cfg, lay.dp) * sum(lay.stage_layers)
    _add(kinds, "all_to_all", calls, calls * lay.expert_tp * moe_row_bytes(cfg, lay.tp))
    return kinds


def embedding(cfg, lay: RankLayout) -> Kinds:
    """The tied embedding's gradient summed between the first stage's embedding and the last stage's
    head copy (Megatron's embedding group; Narayanan et al., arXiv:2104.04473): one all-reduce a step of
    this rank's elements of it (its ZeRO shard, or the whole vocabulary shard)."""
    kinds: Kinds = {}
    if lay.embedding_group and lay.tied_elements:
        _add(kinds, "all_reduce", 1, lay.tied_elements * FP32)
    return kinds


def model_metrics(cfg) -> int:
    """Values the model logs beside its loss (its `metric_names`): BERT's pretraining heads lm_loss and
    mlm_acc, and with the binary head sop_loss and sop_acc; a GPT language model none."""
    m = cfg.model
    return (2 + 2 * bool(m.binary_head)) if m.arch == "bert" else 0


def _untracked(cfg, lay: RankLayout) -> Collectives:
    """`untracked_collectives` by purpose: "other", BERT's accuracy over tp under "tp", a mixture's routing
    counts over its token group under "tp" (or "cp" without tp), the all-to-all of its counts under "ep" and,
    under expert tensor parallelism, the all-gather of its per-expert counts under "tp"."""
    k = model_metrics(cfg)
    out: Collectives = {"tp": {}, "cp": {}, "ep": {}, "other": {}}
    experts = getattr(cfg.model, "num_experts", 0)
    if experts:
        passes = _moe_passes(cfg, lay)
        if lay.tp > 1 or lay.cp > 1:  # each layer's counts summed over the ranks sharing a micro-batch's tokens
            _add(out["tp" if lay.tp > 1 else "cp"], "all_reduce", passes, passes * experts * FP32)
        if lay.ep > 1:  # the counts before the rows
            _add(out["ep"], "all_to_all", passes, passes * experts * INT64)
        if lay.expert_tp > 1:  # the counts of the rank's (E / ep) experts, gathered over tp before the rows
            _add(out["tp"], "all_gather", passes, passes * experts // lay.ep * INT64)
        # the step's routing report (trainer._moe_report): float64 sums (4 + E) and the largest load, over
        # pp, tp, cp and dp, each group of more than one rank
        for size in (lay.pp, lay.tp, lay.cp, lay.dp):
            if size > 1:
                _add(out["other"], "all_reduce", 2, (4 + experts + 1) * INT64)
    if lay.pp > 1:
        _add(out["other"], "broadcast", 1, (1 + k) * FP32)
    if lay.replicas > 1:
        _add(out["other"], "all_reduce", 1, FP32)
        _add(out["other"], "all_reduce", 1 if k else 0, k * FP32)
    if cfg.trainer.precision == "fp16" and lay.tp * lay.pp * lay.replicas > 1:
        _add(out["other"], "all_reduce", 1, FP32)
    if cfg.model.arch == "bert" and lay.tp > 1 and lay.last:
        m = microbatches(cfg, lay.dp)
        tokens = cfg.trainer.micro_batch_size * cfg.model.seq_length
        _add(out["tp"], "all_reduce", 2 * m, 2 * m * tokens * FP32)
    return out


def untracked_collectives(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0,
                          cp_rank: int = 0) -> Kinds:
    """The collectives issued through torch.distributed directly, which count_comm does not see: the
    pipeline's mean loss broadcast from the last stage (Pipeline._share: one fp32, and one for each of
    the model's metrics, `model_metrics`), the logged loss averaged over the replicas, dp or dp x cp
    (trainer: grads.mean_over, one fp32) and the metrics in another all-reduce, under fp16 the overflow
    vote over every rank (DynamicLossScaler, one fp32); and BERT's MLM accuracy under tp
    (VocabParallelLMLoss.correct: the largest logit's max and the label's logit summed over tp, (b, s)
    fp32 each, a micro-batch). A mixture of experts adds, each MoE layer's forward (and its replay under full
    recomputation): the routing counts (E fp32) summed over the ranks sharing the micro-batch's tokens (tp
    and / or cp: megalm.models.moe's token_group), under expert parallelism the counts' all-to-all (E int64;
    bytes are what a rank sends, as for the rows), under expert tensor parallelism the counts of the rank's
    E / ep experts all-gathered over tp (megalm.parallel.experts.run_experts: E / ep int64, the input); and once
    a step the trainer's routing report, two float64 all-reduces (4 + E values, and the largest load) over each
    of pp, tp, cp and dp that has more than one rank. In step_collectives they count under "tp" (the accuracy;
    the counts under tp; expert tp's gather), "cp" (the counts under cp alone), "ep" (the counts' all-to-all)
    and "other" (the rest)."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    kinds: Kinds = {}
    for entries in _untracked(cfg, lay).values():
        for kind, e in entries.items():
            _add(kinds, kind, e["calls"], e["bytes"])
    return kinds


def other(cfg, lay: RankLayout) -> Kinds:
    """The gradient norm's scalars (parallel/grads.py): the squared sums of tp-sharded gradients
    summed over tp (one fp32), the stages' totals over pp (one fp32), and under ZeRO the shards'
    two partial sums over their replicas, dp x cp (two fp32), each only over a group of more than one
    rank; under expert parallelism without ZeRO the experts' own sum over ep (one fp32; as ZeRO shards they
    join the replicas' sum), and before it, under expert tensor parallelism, the sum of their tp slices' squares
    over tp (one fp32). Expert tp without ep leaves the slices with the other tp shards."""
    kinds: Kinds = {}
    if lay.tp > 1:
        _add(kinds, "all_reduce", 1, FP32)
    if lay.pp > 1:
        _add(kinds, "all_reduce", 1, FP32)
    if cfg.parallel.zero_stage >= 1 and lay.replicas > 1:
        _add(kinds, "all_reduce", 1, 2 * FP32)
    if lay.ep > 1 and cfg.parallel.zero_stage == 0 and sum(lay.stage_layers):
        _add(kinds, "all_reduce", 1, FP32)  # the experts' squared sum over ep (each rank holds E / ep of them)
        if lay.expert_tp > 1:
            _add(kinds, "all_reduce", 1, FP32)  # first, their tp slices' sum over tp
    return kinds


def step_collectives(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0,
                      cp_rank: int = 0) -> Collectives:
    """The collectives one optimizer step (all its micro-batches) issues on the rank at (pp_rank,
    dp_rank, cp_rank, tp_rank), by purpose: {"tp", "cp", "ep", "pp", "dp", "edp", "embedding", "other"} ->
    {kind: {"calls", "bytes"}}, kinds all_reduce, all_gather, reduce_scatter, send, recv, broadcast, the cp
    ring's sends, ring, and a mixture's all_to_all (ep: the rows to and from the experts' ranks; tp: expert
    tensor parallelism's rows among the tp ranks; edp: the experts' buckets). dp_rank and cp_rank matter only
    for ZeRO's padding, which the last replica's shard holds (replica dp_rank x cp + cp_rank). `cfg` is the
    composed Config (megalm.plan.compose); "other" includes `untracked_collectives`."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    out = {"tp": tensor_parallel(cfg, lay), "cp": context_parallel(cfg, lay), "ep": expert_parallel(cfg, lay),
           "pp": pipeline(cfg, lay), "dp": data_parallel(cfg, lay), "edp": expert_data_parallel(cfg, lay),
           "embedding": embedding(cfg, lay), "other": other(cfg, lay)}
    for kind, e in expert_tensor_parallel(cfg, lay).items():
        _add(out["tp"], kind, e["calls"], e["bytes"])
    for purpose, entries in _untracked(cfg, lay).items():
        for kind, e in entries.items():
            _add(out[purpose], kind, e["calls"], e["bytes"])
    return out


def by_kind(collectives: Collectives, minus: Optional[Kinds] = None) -> Kinds:
    """Calls and bytes per kind over every purpose, less `minus` (e.g. untracked_collectives: what
    count_comm() then records); kinds left with no call are dropped."""
    total: Kinds = {}
    for kinds in collectives.values():
        for kind, e in kinds.items():
            _add(total, kind, e["calls"], e["bytes"])
    for kind, e in (minus or {}).items():
        left = total.get(kind, {"calls": 0, "bytes": 0})
        total[kind] = {"calls": left["calls"] - e["calls"], "bytes": left["bytes"] - e["bytes"]}
    return {k: e for k, e in total.items() if e["calls"]}


# ---------------------------------------------------------------------------------------------
# Model state
# ---------------------------------------------------------------------------------------------

def optimizer_moments(cfg) -> int:
    """fp32 tensors of optimizer state per parameter element: Adam's two moments; SGD's momentum buffer."""
    o = cfg.optimizer
    if o.name == "adamw":
        return 2
    if o.name == "sgd":
        return 1 if o.momentum else 0
    raise ConfigError(f"optimizer.name={o.name!r} is not one of adamw, sgd")


def exact_model_state_bytes(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0,
                            cp_rank: int = 0) -> Dict[str, int]:
    """Bytes of weights, gradients and optimizer state the rank holds right after an optimizer step
    (before the gradients are zeroed), as megalm.training.memory.measured_model_state_bytes reports.

    fp32 weights, fp32 gradients, fp32 optimizer moments (megalm.training.memory; ZeRO, arXiv:1910.02054,
    sec. 5): with gradient buckets the gradients are the buckets' buffers, padding included: whole
    (ZeRO 0, 1) or this rank's 1/replicas chunk (ZeRO 2, 3; replicas = dp, or dp x cp under context
    parallelism); ZeRO 1-3 keep optimizer state for this rank's shards of real parameters only (no
    padding); ZeRO-3 keeps the weights' 1/replicas chunks, padding included (under expert parallelism the
    experts' buckets are chunked over their (dp / ep) x cp ranks instead). A single process, or a run
    without buckets (one replica, ZeRO 0), holds one gradient per parameter; ZeRO needs more than one
    rank (a single process runs unsharded)."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
    k = optimizer_moments(cfg)
    z = cfg.parallel.zero_stage
    if not lay.buckets:
        return {"weights": lay.param_bytes, "grads": lay.params * FP32, "optimizer": k * lay.params * FP32}
    full = sum(size for size, _ in lay.buckets + lay.expert_buckets) * FP32
    chunks = sum(shard for _, shard in lay.buckets + lay.expert_buckets) * FP32
    return {"weights": chunks if z == 3 else lay.param_bytes,
            "grads": full if z <= 1 else chunks,
            "optimizer": k * (lay.owned if z >= 1 else lay.params) * FP32}


# ---------------------------------------------------------------------------------------------
# Collectives: the alpha-beta model
# ---------------------------------------------------------------------------------------------

# Bytes each rank puts on its link per byte of the message CommStats records (megalm.distributed.comm:
# all_reduce counts the full tensor, all_gather the local input, reduce_scatter the full input), for
# ring algorithms over p ranks (Thakur, Rabenseifner and Gropp 2005; NCCL's nccl-tests
# doc/PERFORMANCE.md gives the same factors as its bus bandwidth: all-reduce 2(p-1)/p, all-gather and
# reduce-scatter (p-1)/p of the full buffer).
def wire_factor(kind: str, p: int) -> float:
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) / p
    if kind == "all_gather":  # the recorded size is the local input, 1/p of the full buffer
        return p - 1
    if kind == "reduce_scatter":
        return (p - 1) / p
    if kind in ("send", "recv", "broadcast", "ring"):
        return 1.0
    if kind == "all_to_all":  # the recorded size is what a rank sends; (p - 1) / p of it leaves the rank
        return (p - 1) / p
    raise ValueError(f"unknown collective kind {kind!r}: all_reduce, all_gather, reduce_scatter, send, recv, ring, "
                     "all_to_all")


def latency_steps(kind: str, p: int) -> int:
    """Messages in sequence a ring needs: 2(p - 1) for all-reduce, p - 1 for the others, 1 point to point
    (a pipeline send, a cp ring's send to its neighbour)."""
    if p <= 1:
        return 0
    if kind in ("send", "recv", "broadcast", "ring"):
        return 1
    return 2 * (p - 1) if kind == "all_reduce" else p - 1  # all_to_all: p - 1 pairwise exchanges


def collective_seconds(kind: str, nbytes: float, p: int, bandwidth: float, latency: float,
                       calls: int = 1) -> float:
    """Time of `calls` collectives of `kind` moving `nbytes` in all (as CommStats counts them) over p
    ranks: alpha x steps + bytes on the wire / bandwidth (Hockney's model; the ring's factors above)."""
    if p <= 1 or (nbytes <= 0 and calls <= 0):
        return 0.0
    return calls * latency_steps(kind, p) * latency + wire_factor(kind, p) * nbytes / bandwidth


# ---------------------------------------------------------------------------------------------
# Rank placement (megalm.distributed.mesh: (pp, dp, cp, tp), tp varying fastest)
# ---------------------------------------------------------------------------------------------

def group_ranks(dims, dim: str, rank: int) -> List[int]:
    """The global ranks of `rank`'s group along mesh dimension `dim`."""
    sizes = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}
    order = ["pp", "dp", "cp", "tp"]
    stride = 1
    for name in reversed(order):
        if name == dim:
            break
        stride *= sizes[name]
    index = (rank // stride) % sizes[dim]
    base = rank - index * stride
    return [base + i * stride for i in range(sizes[dim])]


def replica_ranks(dims, rank: int) -> List[int]:
    """The global ranks holding the same weights as `rank`: its dp group, or dp x cp flattened under context
    parallelism (megalm.distributed.mesh.replica_mesh), over which gradients are reduced."""
    return sorted({r for d in group_ranks(dims, "dp", rank) for r in group_ranks(dims, "cp", d)})


def expert_ranks(dims, ep: int, rank: int, which: str) -> List[int]:
    """The global ranks of `rank`'s expert-parallel group ("ep": its block of ep consecutive dp ranks) or
    expert-data-parallel group ("edp": the dp ranks at its place in every block, with every cp rank of each),
    as megalm.parallel.experts.expert_groups cuts dp."""
    dp_ranks = group_ranks(dims, "dp", rank)
    d = dp_ranks.index(rank)
    if which == "ep":
        return [dp_ranks[i] for i in range(d - d % ep, d - d % ep + ep)]
    return sorted(q for i in range(d % ep, dims.dp, ep) for q in group_ranks(dims, "cp", dp_ranks[i]))


def inside_one_node(ranks: Sequence[int], devices_per_node: int) -> bool:
    return len({r // devices_per_node for r in ranks}) == 1


# ---------------------------------------------------------------------------------------------
# Pipeline schedules and their simulation
# ---------------------------------------------------------------------------------------------

Action = Tuple[str, int, int]  # (kind: F forward | B backward | I input gradient | W weight gradient, stage, micro-batch)


@functools.lru_cache(maxsize=256)
def schedule_order(schedule: str, pp: int, vpp: int, m: int) -> Dict[int, List[Action]]:
    """The actions each pipeline rank runs in one step, in its order.

    GPipe (Huang et al. 2019): every forward, then every backward. 1F1B (PipeDream-Flush, Narayanan et al.
    2021, arXiv:2104.04473 sec. 2.2.1): rank r runs min(m, pp - r) forwards, then alternates one backward
    and one forward, then the remaining backwards; torch.distributed.pipelining runs these two the same
    way. The multi-stage schedules (interleaved 1F1B, interleaved zero bubble, ZBV) take the order torch's
    own classes compute (their `pipeline_order`), built over a fake process group, so the plan follows
    the schedule a run executes.
    """
    if schedule == "gpipe":
        return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)}
    if schedule == "1f1b":
        order = {}
        for r in range(pp):
            warm = min(m, pp - r)
            acts: List[Action] = [("F", r, i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                acts.append(("B", r, b))
                b += 1
                if f < m:
                    acts.append(("F", r, f))
                    f += 1
            order[r] = acts
        return order
    if schedule in MULTI_STAGE:
        return _torch_order(schedule, pp, vpp, m)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _torch_order(schedule: str, pp: int, vpp: int, m: int) -> Dict[int, List[Action]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining as pl
    from torch.testing._internal.distributed.fake_pg import FakeStore
    cls = {"interleaved_1f1b": pl.ScheduleInterleaved1F1B, "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
           "zbv": pl.ScheduleZBVZeroBubble}[schedule]
    v = 2 if schedule == "zbv" else vpp
    if dist.is_initialized():
        raise RuntimeError("schedule_order builds the schedule over a fake process group of its own: "
                           "call it where no process group is initialised (megalm.plan, not inside a run)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [pl.PipelineStage(nn.Identity(), s, pp * v, torch.device("cpu"), group=dist.group.WORLD)
                  for s in virtual_stages_of(0, pp, v, schedule)]
        sched = cls(stages, n_microbatches=m, loss_fn=lambda out, target: out.sum())
        order = sched.pipeline_order
    finally:
        dist.destroy_process_group()
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
             "BACKWARD_WEIGHT": "W", "FORWARD": "F"}
    out: Dict[int, List[Action]] = {}
    for rank, acts in order.items():
        seq = []
        for a in acts:
            if a is None:
                continue
            kind = kinds.get(str(a.computation_type).split(".")[-1])
            if kind is None:
                kind = kinds.get(str(a.computation_type))
            if kind is None:
                continue  # communication or gradient-reduction markers
            seq.append((kind, int(a.stage_index), int(a.microbatch_index)))
        out[int(rank)] = seq
    return out


@dataclasses.dataclass
class Simulation:
    step_seconds: float
    """From the first forward to the last action of any rank."""
    busy: Dict[int, float]
    """Seconds each pipeline rank computes."""

    def idle_share(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.step_seconds if self.step_seconds > 0 else 0.0


def simulate(order: Dict[int, List[Action]], seconds: Callable[[str, int], float],
             transfer: Callable[[int, int], float], owner: Callable[[int], int], num_stages: int) -> Simulation:
    """Run the schedule as events: each rank takes its actions in order, an action starting when its rank
    is free and its inputs have arrived. F(s, i) needs F(s - 1, i); B or I (s, i) needs F(s, i) and the
    input gradient of (s + 1, i); W(s, i) needs I(s, i). An input crossing to another rank arrives
    transfer(from_stage, to_stage) seconds after it is produced. `seconds(kind, stage)` is one action's
    time. Raises if the order can never finish (a schedule that waits on itself)."""
    done: Dict[Tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}

    def ready(kind: str, s: int, i: int) -> Optional[float]:
        def arrived(dep_kind: str, ds: int) -> Optional[float]:
            key = (dep_kind, ds, i)
            alt = ("I", ds, i) if dep_kind == "B" else None
            t = done.get(key, done.get(alt) if alt else None)
            if t is None:
                return None
            return t + (transfer(ds, s) if owner(ds) != owner(s) else 0.0)
        if kind == "F":
            return 0.0 if s == 0 else arrived("F", s - 1)
        if kind in ("B", "I"):
            own = done.get(("F", s, i))
            if own is None:
                return None
            if s == num_stages - 1:
                return own
            later = arrived("B", s + 1)
            return None if later is None else max(own, later)
        if kind == "W":
            return done.get(("I", s, i))
        raise ValueError(f"unknown action {kind!r}")

    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                kind, s, i = acts[pos[r]]
                t = ready(kind, s, i)
                if t is None:
                    break
                start = max(free[r], t)
                d = seconds(kind, s)
                free[r] = start + d
                busy[r] += d
                done[(kind, s, i)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pos[r]] for r, acts in order.items() if pos[r] < len(acts)}
            raise RuntimeError(f"the schedule cannot proceed: next actions {stuck}")
    return Simulation(max(free.values()), busy)


def virtual_stages_per_rank(cfg, pp: int) -> int:
    """The (virtual) stages each pipeline rank runs: 2 for ZBV's V, virtual_pipeline_size for the
    interleaved schedules, else 1 (and 1 without a pipeline)."""
    p = cfg.parallel
    if pp == 1:
        return 1
    return 2 if p.pipeline_schedule == "zbv" else (p.virtual_pipeline_size if p.pipeline_schedule in MULTI_STAGE else 1)


def stage_layers(cfg, pp: int) -> List[int]:
    """Layers of every (virtual) stage, as the run splits them (megalm.parallel.stages)."""
    v = virtual_stages_per_rank(cfg, pp)
    split = cfg.parallel.layers_per_stage if pp > 1 else None
    return [len(r) for r in stage_layer_ranges(cfg.model.num_layers, pp * v, split)]


def stage_owner(schedule: str, pp: int, num_stages: int) -> List[int]:
    """The pipeline rank that runs each (virtual) stage."""
    v = num_stages // pp
    return [next(r for r in range(pp) if s in virtual_stages_of(r, pp, v, schedule)) for s in range(num_stages)]


def action_seconds(work: StageWork, kind: str, rate: float, traffic: Optional[Traffic] = None,
                   bandwidth: Optional[float] = None) -> float:
    """Seconds of one pipeline action (F, B, or zero-bubble's I / W) of a stage: its FLOPs at `rate`, plus,
    with a memory `bandwidth`, its bytes outside the matmuls (`stage_traffic`) over that bandwidth."""
    flops = {"F": work.forward, "B": work.backward, "I": work.input_grad, "W": work.weight_grad}[kind]
    moved = traffic.of(kind) if traffic is not None and bandwidth else 0.0
    return flops / rate + (moved / bandwidth if moved else 0.0)


def crossings(kind: str, s: int, owner: Sequence[int]) -> int:
    """The boundary messages pipeline action (kind, s) sends or receives across ranks: a forward takes its
    input from stage s - 1 and hands its output to s + 1; a backward (or its input-gradient half) takes
    the output gradient from s + 1 and hands the input gradient to s - 1; the weight-gradient half none."""
    if kind == "W":
        return 0
    return sum(1 for t in (s - 1, s + 1) if 0 <= t < len(owner) and owner[t] != owner[s])


def compute_bubble(cfg, pp: int, m: int, flops_per_second: Optional[float] = None,
                   bytes_per_second: Optional[float] = None, message_seconds: float = 0.0,
                   message_cpu_seconds: float = 0.0) -> Dict[int, float]:
    """Each pipeline rank's share of the step spent not computing: the schedule's order simulated with
    each stage's time, so unequal stages (the head on the last) count. With no figures a stage's time is
    its FLOPs (`stage_work`); given a device's matmul FLOP/s and memory bandwidth (bytes/s), each stage's
    memory traffic outside the matmuls (`stage_traffic`: its layers, the embedding on the first, the heads
    and the loss on the last) is added as bytes over bandwidth.

    Boundary messages (one activation or its gradient, `crossings`) are free unless given: one arrives
    `message_seconds` after it is sent, and where the ranks handle messages on the cores that compute
    (gloo on CPU), each takes `message_cpu_seconds` from the rank at either end, time that lengthens the
    action and counts as not computing."""
    layers = stage_layers(cfg, pp)
    S = len(layers)
    owner = stage_owner(cfg.parallel.pipeline_schedule, pp, S)
    work = [stage_work(cfg, n, s == S - 1, 1) for s, n in enumerate(layers)]
    rate = flops_per_second or 1.0
    moves = flops_per_second and bytes_per_second
    traffic = [stage_traffic(cfg, n, s == 0, s == S - 1, 1, m) if moves else None for s, n in enumerate(layers)]
    order = schedule_order(cfg.parallel.pipeline_schedule, pp, S // pp, m)

    def seconds(kind: str, s: int) -> float:
        compute = action_seconds(work[s], kind, rate, traffic[s], bytes_per_second if moves else None)
        return compute + message_cpu_seconds * crossings(kind, s, owner)
    sim = simulate(order, seconds, lambda a, b: message_seconds, lambda s: owner[s], S)
    handling = {r: message_cpu_seconds * sum(crossings(k, s, owner) for k, s, _ in acts) for r, acts in order.items()}
    return {r: 1.0 - (sim.busy[r] - handling[r]) / sim.step_seconds for r in range(pp)}


def bubble_equal_stages(pp: int, m: int, v: int = 1) -> float:
    """The bubble as a share of the step with equal stages and no communication time: (p - 1) / (m v + p - 1)
    (Narayanan et al. 2021, arXiv:2104.04473 sec. 2.2: bubble time over ideal time is (p - 1) / (m v))."""
    return (pp - 1) / (m * v + pp - 1)


# ---------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------

def peak_flops(cluster, precision: str) -> Optional[float]:
    """The profile's dense FLOP/s of one device in `precision` (training's MFU denominator), or None."""
    if cluster.peak_flops:
        return float(cluster.peak_flops)
    value = cluster.peak_flops_per_dtype.get(precision)
    return float(value) if value else None


def link(cluster, ranks: Sequence[int]) -> Tuple[Optional[float], float]:
    """(effective bytes/s, latency) of a group: NVLink inside one node, the network otherwise (a ring
    across nodes runs at the slowest link's pace). Bandwidth None when the profile does not give it."""
    intra = inside_one_node(ranks, cluster.devices_per_node)
    bw = cluster.intra_node_bandwidth if intra else cluster.inter_node_bandwidth
    lat = cluster.intra_node_latency if intra else cluster.inter_node_latency
    return (bw * cluster.comm_efficiency if bw else None), lat


def group_seconds(kinds: Dict[str, Dict[str, float]], p: int, bandwidth: float, latency: float) -> float:
    """Time of a group's collectives of one step, {kind: {"calls", "bytes"}} as CommStats counts them."""
    return sum(collective_seconds(k, v["bytes"], p, bandwidth, latency, int(v["calls"])) for k, v in kinds.items())


def optimizer_bytes_per_param(cfg) -> int:
    """Bytes the optimizer step streams per parameter it updates: it reads the fp32 weight, gradient and
    its k state tensors and writes the weight and the state: 12 + 8k (AdamW, k = 2: 28; SGD with
    momentum: 20; plain SGD: 12)."""
    return 12 + 8 * optimizer_moments(cfg)


def optimizer_seconds(updated_params: float, cfg) -> float:
    """A memory-bound elementwise update of the parameters this rank's optimizer owns (all it holds, or its
    1/dp under ZeRO 1-3): the bytes it streams over the device's memory bandwidth."""
    if not cfg.cluster.memory_bandwidth:
        return 0.0
    return updated_params * optimizer_bytes_per_param(cfg) / cfg.cluster.memory_bandwidth


def ring_block_bytes(cfg, tp: int) -> int:
    """Bytes of one send of the cp ring (megalm.parallel.context): a rank's (k, v) block of one layer and
    micro-batch, (b, 2 kv_heads / tp, seq_length / cp, head_dim) in the compute dtype, or its gradient."""
    m, t = cfg.model, cfg.trainer
    e = 2 if t.precision in ("bf16", "fp16") else FP32
    return 2 * t.micro_batch_size * (m.kv_heads // tp) * local_tokens(cfg) * m.head_dim * e


def ring_exposed_seconds(cfg, tp: int, rate: float, bandwidth: float, latency: float) -> Tuple[float, float]:
    """(forward, backward) seconds the cp ring adds to one layer's pass over one micro-batch on one rank.

    Ring attention overlaps each step's exchange with the compute over the block already held (Liu et al.
    2023, arXiv:2310.01889, sec. 3): the cp - 1 sends of a pass, each a point-to-point message (latency plus
    `ring_block_bytes` over the cp group's link), run beside the attention core's compute of that pass, the
    forward's QK^T and AV (`attention_core_flops_per_token` over the rank's tokens / tp) and the backward's
    twice that; only the exchanges' time beyond it is added. Assumed: the overlap is taken over the whole
    pass (all its sends against all its core compute, not step by step), the exchanges slow no kernel
    beside them, and the ring's extra elementwise work (`stage_work`, `stage_traffic`) is not counted."""
    p = cfg.parallel
    if p.cp == 1:
        return 0.0, 0.0
    sends = (p.cp - 1) * (latency + ring_block_bytes(cfg, tp) / bandwidth)
    core = attention_core_flops_per_token(cfg.model) * cfg.trainer.micro_batch_size * local_tokens(cfg) / tp / rate
    return max(0.0, sends - core), max(0.0, sends - 2 * core)


def estimate_requirements(cfg, world: int) -> List[str]:
    """The cluster-profile fields a step-time estimate of `world` devices needs and cfg.cluster lacks."""
    c = cfg.cluster
    missing = []
    if peak_flops(c, cfg.trainer.precision) is None:
        missing.append(f"cluster.peak_flops_per_dtype.{cfg.trainer.precision} (or cluster.peak_flops)")
    if world > 1 and not c.intra_node_bandwidth:
        missing.append("cluster.intra_node_bandwidth")
    if world > c.devices_per_node and not c.inter_node_bandwidth:
        missing.append("cluster.inter_node_bandwidth")
    return missing


def estimate_step(cfg, dims, comm: Dict[int, Dict[str, Dict[str, Dict[str, float]]]],
                  updated_params: Dict[int, float]) -> Dict[str, object]:
    """Step time, tokens/s and MFU of a layout on cfg.cluster, or {"missing": [what the profile lacks]}.

    The model, each term in seconds:
    - every pipeline action (forward, backward, or zero-bubble's input / weight halves) computes its
      FLOPs (`stage_work`) at cluster.matmul_efficiency x the peak of trainer.precision, plus its share
      (by FLOPs) of the rank's tensor-parallel collectives, which wait on the compute (Megatron's layers
      issue them between dependent matmuls, nothing to overlap them with), and likewise of a mixture of
      experts' all-to-alls over the ep group (each `collective_seconds` over the group's link: the counts,
      the rows out and back, forward and backward, and their replay under full recomputation; dispatch
      waits on each), under expert tensor parallelism its all-to-alls and counts' gather over tp (with tp's
      collectives: run_experts waits on each) and its routing counts over the token group; and its bytes
      outside the
      matmuls (`stage_traffic`: norms, activations, copies, the loss on the last stage...) over
      cluster.memory_bandwidth;
    - activations cross pipeline ranks as point-to-point sends (`boundary_messages`: forward the
      activations, and BERT's padding mask; backward their gradient), over NVLink or the network by where
      the two ranks sit;
    - context parallelism's ring exchanges overlap the attention core's compute of the same pass and add
      only what they take beyond it (`ring_exposed_seconds`) to the actions of each layer: forward to F,
      the gradients' (and recomputation's replayed forward's) to B, or to zero-bubble's I;
    - `simulate` runs the schedule's order with these times: the step's pipeline part and each rank's
      bubble;
    - data-parallel gradient reduction overlaps the backward of the step's last micro-batch (megalm
      launches each bucket as its gradients are complete) and shows only beyond it, at least its last
      bucket (over the replicas: dp, or dp x cp; under expert parallelism the experts' buckets over their
      (dp / ep) x cp ranks too, after the others); ZeRO-1/2's parameter all-gather after the update and the
      tied-embedding sum are exposed, and so are the gradient-norm and loss scalars, each 2 log2(world)
      latencies (a tree, as NCCL runs small all-reduces); ZeRO-3's gathers (the experts' over their
      (dp / ep) x cp ranks under expert parallelism) are prefetched and show only beyond the rank's compute;
    - the optimizer step streams the parameters this rank updates through device memory (`optimizer_seconds`;
      `updated_params` per pipeline rank).
    The step ends when the slowest pipeline rank has done all of it.
    """
    c, p, t = cfg.cluster, cfg.parallel, cfg.trainer
    missing = estimate_requirements(cfg, dims.world_size)
    if missing:
        return {"missing": missing}
    peak = peak_flops(c, t.precision)
    rate = peak * c.matmul_efficiency
    m = t.global_batch_size // (t.micro_batch_size * dims.dp)
    layers = stage_layers(cfg, dims.pp)
    S = len(layers)
    owner = stage_owner(p.pipeline_schedule, dims.pp, S) if dims.pp > 1 else [0] * S
    work = [stage_work(cfg, n, s == S - 1, dims.tp) for s, n in enumerate(layers)]
    rank_of = lambda pp_rank: pp_rank * dims.dp * dims.cp * dims.tp  # noqa: E731  (dp, cp, tp index 0)

    def seconds_of(group: str, pp_rank: int, kinds=None) -> float:
        r = rank_of(pp_rank)
        if group == "other":  # gradient-norm and loss scalars: latency-bound, NCCL runs them as trees
            calls = sum(int(v["calls"]) for v in comm[pp_rank].get("other", {}).values())
            _, lat = link(c, list(range(dims.world_size)))
            return calls * 2 * math.ceil(math.log2(dims.world_size)) * lat if dims.world_size > 1 else 0.0
        if group == "embedding":
            ranks = [rank_of(0), rank_of(dims.pp - 1)]
        elif group == "dp":
            ranks = replica_ranks(dims, r)
        elif group in ("ep", "edp"):
            ranks = expert_ranks(dims, p.ep, r, group)
        else:
            ranks = group_ranks(dims, group, r)
        bw, lat = link(c, ranks)
        kinds = kinds if kinds is not None else comm[pp_rank].get(group, {})
        return group_seconds(kinds, len(ranks), bw, lat) if bw else 0.0

    flops_of_rank = {r: m * sum(work[s].forward + work[s].backward for s in range(S) if owner[s] == r)
                     for r in range(dims.pp)}

    def waited_on(r: int) -> float:  # tp's collectives (expert tp's among them), a mixture's all-to-alls and
        # its counts over cp
        cp_kinds = {k: v for k, v in comm[r].get("cp", {}).items() if k != "ring"}
        return seconds_of("tp", r) + seconds_of("ep", r) + (seconds_of("cp", r, cp_kinds) if cp_kinds else 0.0)
    tp_share = {r: waited_on(r) / flops_of_rank[r] if flops_of_rank[r] else 0.0 for r in range(dims.pp)}

    traffic = [stage_traffic(cfg, n, s == 0, s == S - 1, dims.tp, m) if c.memory_bandwidth else None
               for s, n in enumerate(layers)]

    ring_forward = ring_backward = 0.0
    if dims.cp > 1:
        bw, lat = link(c, group_ranks(dims, "cp", 0))
        ring_forward, ring_backward = ring_exposed_seconds(cfg, dims.tp, rate, bw, lat)
    n_replay = p.recompute_num_layers if p.recompute == "full" and p.recompute_num_layers is not None else None
    replayed = [0 if p.recompute == "none" else n if n_replay is None else min(n, n_replay) for n in layers]
    backward = [n * ring_backward + k * ring_forward for n, k in zip(layers, replayed)]
    ring = [{"F": n * ring_forward, "B": b, "I": b, "W": 0.0} for n, b in zip(layers, backward)]

    def seconds(kind: str, s: int) -> float:
        w = work[s]
        flops = {"F": w.forward, "B": w.backward, "I": w.input_grad, "W": w.weight_grad}[kind]
        return action_seconds(w, kind, rate, traffic[s], c.memory_bandwidth) + flops * tp_share[owner[s]] \
            + ring[s][kind]

    forward_msgs, backward_msg = boundary_messages(cfg, dims.tp)

    def transfer(a: int, b: int) -> float:  # from stage a to stage b: forward when a < b
        if dims.pp == 1:
            return 0.0
        pair = [rank_of(owner[a]), rank_of(owner[b])]
        bw, lat = link(c, pair)
        return lat + (sum(forward_msgs) if a < b else backward_msg) / bw

    order = schedule_order(p.pipeline_schedule, dims.pp, S // dims.pp, m) if dims.pp > 1 else \
        {0: [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]}
    sim = simulate(order, seconds, transfer, lambda s: owner[s], S)
    after = {}
    for r in range(dims.pp):
        reduce_s = gather_s = 0.0
        buckets = 0
        for group in ("dp", "edp"):  # the experts' buckets (expert parallelism) over their own group, in turn
            kinds = comm[r].get(group, {})
            reduce = {k: v for k, v in kinds.items() if k in ("all_reduce", "reduce_scatter")}
            reduce_s += seconds_of(group, r, reduce)
            gather_s += seconds_of(group, r, {k: v for k, v in kinds.items() if k == "all_gather"})
            buckets += sum(int(v["calls"]) for v in reduce.values())
        last_backward = sum(work[s].backward for s in range(S) if owner[s] == r) / rate
        buckets = max(1, buckets)
        exposed_reduce = max(reduce_s - last_backward, reduce_s / buckets) if reduce_s else 0.0
        compute = flops_of_rank[r] / rate
        exposed_gather = max(0.0, gather_s - compute) if p.zero_stage == 3 else gather_s
        after[r] = {"dp_reduce": exposed_reduce, "dp_gather": exposed_gather,
                    "embedding": seconds_of("embedding", r), "other": seconds_of("other", r),
                    "optimizer": optimizer_seconds(updated_params[r], cfg)}
    tail = max(sum(v.values()) for v in after.values())
    step = sim.step_seconds + tail
    tokens = t.global_batch_size * cfg.model.seq_length
    from megalm.models import flops_per_token
    model_flops = flops_per_token(cfg.model) * tokens
    return {"step_seconds": step, "pipeline_seconds": sim.step_seconds,
            "tokens_per_second": tokens / step, "mfu": model_flops / (step * dims.world_size * peak),
            "bubble": {r: sim.idle_share(r) for r in range(dims.pp)},
            "tp_seconds": {r: seconds_of("tp", r) for r in range(dims.pp)},
            "ep_seconds": {r: seconds_of("ep", r) for r in range(dims.pp)},
            "cp_seconds": {r: seconds_of("cp", r) for r in range(dims.pp)},
            "cp_exposed_seconds": {r: m * sum(ring[s]["F"] + ring[s]["B"] for s in range(S) if owner[s] == r)
                                   for r in range(dims.pp)},
            "after_backward": after, "micro_batches": m, "peak_flops": peak}
