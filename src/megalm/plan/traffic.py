"""Device-memory bytes a stage moves outside its matmuls, which the step time takes over memory bandwidth: the
layers, embedding and heads counted op by op on fake tensors (`count_traffic`), the loss's passes over the logits
by formula (`loss_traffic_bytes`), and the two put together per stage and pipeline action (`stage_traffic`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megalm.family import Part
from megalm.models import build_model
from megalm.models.registry import family_of
from megalm.plan.shapes import FP32, encoder, local_tokens
from megalm.training.precision import autocast, param_dtype


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
    trainer.precision's autocast, with the weights in the 2-byte dtype under trainer.mixed_precision=main_params
    (so no weight casts, and a residual stream of that dtype). `fake`: on FakeTensorMode tensors (nothing
    allocated: any model size); False runs the same on real CPU tensors (the tests' reference). Cached per model,
    micro-batch, precision and weights' dtype."""
    import torch
    m, t = cfg.model, cfg.trainer
    low = param_dtype(t)
    key = repr((m, t.micro_batch_size, t.precision, low, fake))
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
        if low is not None:  # the parameters, as DataParallel holds them under main_params (buffers stay)
            for param in model.parameters():
                param.data = param.data.to(low)
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
    if encoder(m):  # the MLM accuracy
        fwd_bytes += FP32 * elements * (3 if tp > 1 else m.vocab_size / m.padded_vocab(tp))
        fwd_bytes += 6 * elements if cfg.trainer.precision != "fp32" else 0
    return fwd_bytes, bwd_bytes


GRAD_ACCUMULATION_BYTES = 3 * FP32
"""Adding a micro-batch's weight gradient into the accumulated one: two fp32 reads and a write a parameter."""
MAIN_GRAD_BYTES = 2 + 2 * FP32
"""trainer.mixed_precision=main_params: adding a micro-batch's 2-byte weight gradient into the fp32 main gradient
(Megatron's main_grad), every micro-batch: a 2-byte read, a 4-byte read and a 4-byte write a parameter."""


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
      accumulated ones (GRAD_ACCUMULATION_BYTES a parameter), spread here over the m micro-batches; under
      main_params every micro-batch adds into the fp32 main gradients (MAIN_GRAD_BYTES), which are zeroed
      once a step (4 bytes a parameter, spread likewise).
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
    if param_dtype(cfg.trainer) is not None:
        accumulate = (MAIN_GRAD_BYTES + FP32 / m) * params / tp
    else:
        accumulate = GRAD_ACCUMULATION_BYTES * params / tp * (m - 1) / m
    return total + Traffic(0.0, 0.0, accumulate)
