"""Activation memory of a GPT layout: the bytes autograd keeps for backward, per layer, per pipeline
stage and at a rank's peak under its schedule. Arithmetic only: nothing is built or run.

The frame is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198): one layer keeps s*b*h*(34 + 5*a*s/h) bytes in fp16 without parallelism (sec. 4.1,
Table 2); tensor parallelism divides the parts inside the column -> row pairs by t, sequence parallelism
the rest too (sec. 4.2); selective recomputation drops the 5as/h attention term, full recomputation keeps
only the layer input (sec. 5). The micro-batches alive at once follow the pipeline schedule
(Narayanan et al. 2021, arXiv:2104.04473, sec. 2.2: 1F1B holds pp - rank, the interleaved schedule
more). The coefficients here are not the paper's but megalm's own (megalm.models.layers, parallel/):
each term names the tensor its ops save, checked against autograd's saved tensors on CPU by
tests/test_plan_activations.py. Where megalm differs from the paper:

- attention runs on SDPA's fused kernels, which keep q, k, v, the output and a log-sum-exp (a fp32 values
  a token) instead of the a*s score matrices; only on CPU with attention dropout does SDPA fall back to
  its math path, which keeps them (softmax, dropout noise, dropped probabilities: 3 a*s values a token);
- sequence parallelism keeps the all-gathered (full-sequence) input of each column-parallel linear,
  where Megatron keeps the shard and gathers again in backward: 2h a token stay unsharded;
- training runs fp32 by default; with bf16 / fp16 autocast the residual stream, norms, the log-softmax
  and the statistics stay fp32, and each linear keeps a half-precision copy of its input and its weight;
- selective recomputation wraps the attention core (Parts.selective): with fused attention that saves
  only the log-sum-exp, the GQA-repeated keys and values and, after RoPE, SDPA's own output; not 5as/h.
- packed sequences (data.packing: a mask per example, position ids) are not modeled.

Not counted: the tensors a pipeline schedule itself holds (received inputs, a stage's output until its
backward, the gradients of intermediates that zero-bubble schedules keep until the weight pass),
transient buffers, and the working set of a recomputed layer during its backward (`recompute_transient`
gives it). CUDA assumptions not measured here: dropout keeps a 1-byte mask (native_dropout) where CPU
keeps a noise tensor of the activation's dtype; SDPA stays fused with dropout; RMSNorm runs torch's fused
kernel (input and rstd), where CPU's composite also keeps the normalized input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megalm.errors import ConfigError

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class _Shape:
    """What the formulas read, resolved once from the config: sizes of one micro-batch on one rank."""
    s: int        # tokens a sequence
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

    @property
    def seq(self) -> int:
        """Divisor of the sequence-parallel region (norms, residual, hidden dropout)."""
        return self.t if self.sp else 1

    @property
    def fused_attention(self) -> bool:
        return not (self.cpu and self.attention_dropout > 0)

    def mask(self, element: int) -> int:
        """Bytes a dropout keeps an element: CUDA's native_dropout a bool, CPU's a noise tensor of the input's dtype."""
        return element if self.cpu else 1


def _shape(cfg, world: int, device: Optional[str] = None) -> _Shape:
    from megalm.distributed.mesh import ParallelDims
    m, p, tr = cfg.model, cfg.parallel, cfg.trainer
    if m.arch != "gpt":
        raise ConfigError(f"activation memory is derived for the gpt family's layers; model.arch={m.arch}")
    if m.transformer_impl != "local" or tr.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"activation memory is derived for transformer_impl=local in fp32 / bf16 / fp16; got "
                          f"model.transformer_impl={m.transformer_impl}, trainer.precision={tr.precision}")
    device = device or ("cpu" if tr.device == "cpu" else "cuda")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; choose cpu or cuda")
    dims = ParallelDims.from_config(p, world)
    if p.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"parallel.recompute={p.recompute} is not one of none, selective, full")
    return _Shape(s=m.seq_length, b=tr.micro_batch_size * max(1, getattr(m, "num_choices", 0)), h=m.hidden_size,
                  a=m.num_attention_heads, kv=m.kv_heads * m.head_dim, groups=m.num_attention_heads // m.kv_heads,
                  f=m.ffn_size, vocab=m.padded_vocab(dims.tp), t=dims.tp, sp=p.sequence_parallel and dims.tp > 1,
                  e=FP32 if tr.precision == "fp32" else 2, autocast=tr.precision != "fp32", cpu=device == "cpu",
                  rope=m.position_embedding == "rope", swiglu=m.activation == "swiglu",
                  rmsnorm=m.normalization == "rmsnorm", bias=m.bias, dropout=m.dropout,
                  attention_dropout=m.attention_dropout, lm_head=not getattr(m, "fine_tuning_head", False))


def _norm(d: _Shape) -> float:
    """A pre-norm on the residual stream (fp32 under autocast too), per token, over the sequence-parallel region.

    LayerNorm's kernel keeps its input and the fp32 mean and rstd; RMSNorm keeps its input and rstd, and
    on CPU (torch's composite x * rsqrt(mean(x^2) + eps) * w) also the normalized x its weight multiplies."""
    kept = d.h * FP32 + (FP32 if d.rmsnorm else 2 * FP32) + (d.h * FP32 if d.rmsnorm and d.cpu else 0)
    return kept / d.seq


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
    if not d.fused_attention:  # CPU's math path computes in fp32 under autocast too, then casts its output back
        return (3 * h * FP32 + h * d.e + d.a * d.s * 3 * FP32) / d.t
    if d.groups > 1:  # k, v repeated: q (a view of qkv, or RoPE's), k_rep, v_rep
        kept = (qkv if not d.rope else h) + 2 * h
    else:
        kept = inputs
    out = h + (h if d.rope else 0)  # SDPA's output, and the projection's copy of it after RoPE
    return (kept + out) * d.e / d.t + d.a * FP32 / d.t


def _mlp(d: _Shape) -> float:
    """GELU: fc1's output (GELU's input) and GELU's output (fc2's input), f each. SwiGLU: fc1's output
    [gate | up] (2f, SiLU and the product keep views of it), SiLU's output and the product (f each). / t."""
    return (4 if d.swiglu else 2) * d.f * d.e / d.t


def _hidden_dropout(d: _Shape) -> float:
    """The dropout after each row-parallel linear (attention output, MLP output), on the sequence shard
    under sp. Its input is the compute dtype, or fp32 when tp's row-parallel bias is added after autocast."""
    if d.dropout <= 0:
        return 0.0
    element = FP32 if d.autocast and d.t > 1 and d.bias else d.e
    return 2 * d.h * d.mask(element) / d.seq


def layer_terms(cfg, world: int, recompute: Optional[str] = None, device: Optional[str] = None) -> Dict[str, float]:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank, by term.

    `recompute` overrides parallel.recompute (none | selective | full); `device` (cpu | cuda) defaults to
    trainer.device (auto: cuda). Per token, times s*b:
    - norms: the two pre-norms (see `_norm`), / t under sequence parallelism;
    - linear_inputs: the inputs of qkv and fc1, h each in the compute dtype: the norm's output (a copy under
      autocast), never sharded (tp: a view behind Megatron's f; sp: the all-gathered sequence);
    - attention: `_attention_core`; mlp: `_mlp`; dropout: `_hidden_dropout`;
    - full recomputation: only the block input the checkpoint saves, h fp32 (/ t under sp).
    """
    d = _shape(cfg, world, device)
    mode = cfg.parallel.recompute if recompute is None else recompute
    tokens = d.s * d.b
    if mode == "full":
        return {"layer_input": tokens * d.h * FP32 / d.seq}
    if mode not in ("none", "selective"):
        raise ConfigError(f"recompute={mode} is not one of none, selective, full")
    return {"norms": tokens * 2 * _norm(d), "linear_inputs": tokens * 2 * d.h * d.e,
            "attention": tokens * _attention_core(d, mode == "selective"), "mlp": tokens * _mlp(d),
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
    scatter)."""
    d = _shape(cfg, world, device)
    tokens = d.s * d.b
    ids = INT64 + 1 if d.t > 1 else (0 if cfg.parallel.pp > 1 else INT64)
    kept = tokens * ids + (0 if d.rope else d.s * INT64)
    if d.dropout > 0:
        kept += tokens * d.h * d.mask(FP32) / (d.seq if d.rope else 1)
    return round(kept)


def logits_and_loss_bytes(cfg, world: int, device: Optional[str] = None) -> int:
    """The last stage's logits and cross-entropy buffers for one micro-batch (megalm.models.losses).

    Without tp, F.cross_entropy keeps its fp32 log-softmax (padded vocabulary V) and the int64 targets;
    with tp, the vocabulary-parallel loss keeps its fp32 softmax of V/t columns, the local target ids
    and two bool masks. The masked mean keeps the fp32 loss mask. The logits themselves are not kept.
    A fine-tuning head (classifier, multiple choice) keeps almost nothing per token: 0."""
    d = _shape(cfg, world, device)
    if not d.lm_head:
        return 0
    per_token = FP32 * d.vocab / d.t + INT64 + FP32 + (2 if d.t > 1 else 0)
    return round(d.s * d.b * per_token)


def head_bytes(cfg, world: int, device: Optional[str] = None) -> int:
    """The last stage's final norm (`_norm`) and the head's input (h in the compute dtype, full sequence:
    a view behind f under tp, gathered under sp), for one micro-batch; without the loss buffers."""
    d = _shape(cfg, world, device)
    return round(d.s * d.b * (_norm(d) + d.h * d.e))


def _weight_copy_bytes(d: _Shape, layers: int, last: bool) -> int:
    """Under autocast each linear keeps the half-precision copy of its weight it multiplied with: qkv, proj,
    fc1, fc2 of each layer that is not recomputed whole, and the head's on the last stage (/ t). Autocast
    caches the copy for its context, so a rank holds one set however many micro-batches are in flight."""
    if not d.autocast:
        return 0
    per_layer = d.h * (d.h + 2 * d.kv) + d.h * d.h + d.h * d.f * (3 if d.swiglu else 2)
    return (layers * per_layer + (d.vocab * d.h if last and d.lm_head else 0)) * d.e // d.t


# -- pipeline schedules: the order of compute actions of one rank, as torch.distributed.pipelining runs them --
# Each action is (kind, local stage k, micro-batch): F forward, B full backward, I backward for the
# input (activations stay for the weight pass), W backward for the weights (frees them).

def _looped_actions(pp: int, rank: int, v: int, m: int, zero_bubble: bool) -> List[Tuple[str, int, int]]:
    """Interleaved 1F1B (Megatron's order, arXiv:2104.04473 sec. 2.2) and interleaved zero bubble
    (arXiv:2401.10241) as torch builds them: chunks of `per_round` micro-batches move through the local
    stages; warm-up holds (v - 1) * per_round + 2 (ZB: 1) * (pp - 1 - rank) forwards, then each step
    runs a forward before a backward; ZB defers each weight pass by `rank` backward steps."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    fwd = lambda op: (op // per_round) % v  # noqa: E731
    bwd = lambda op: v - 1 - ((op - warmup) // per_round) % v  # noqa: E731
    done = {"F": [0] * v, "B": [0] * v, "W": [0] * v}
    out: List[Tuple[str, int, int]] = []
    pending: List[int] = []

    def add(kind: str, k: int, count: str) -> None:
        out.append((kind, k, done[count][k]))
        done[count][k] += 1

    for op in range(m * v + warmup):
        if op < m * v:
            add("F", fwd(op), "F")
        if op >= warmup:
            k = bwd(op)
            add("I" if zero_bubble else "B", k, "B")
            pending.append(k)
            if zero_bubble and op - warmup >= rank:
                add("W", pending.pop(0), "W")
    for k in pending if zero_bubble else []:
        add("W", k, "W")
    return out


def _zbv_actions(pp: int, rank: int, m: int) -> List[Tuple[str, int, int]]:
    """ZB-V (arXiv:2401.10241 sec. 6) as torch's ScheduleZBVZeroBubble orders it: chunk 0 is stage
    `rank`, chunk 1 stage 2pp - 1 - rank; warm-up 2(pp - rank) - 1 chunk-0 forwards, then `rank` pairs,
    then chunk-1 forward + backward for input + weight, a steady state of both chunks, and a cool-down
    that leaves weight passes for the end. Actions past the step's m micro-batches are dropped."""
    n = max(2 * pp - 1, m)
    count = {(kind, k): 0 for kind in "FIW" for k in (0, 1)}
    out: List[Tuple[str, int, int]] = []

    def add(kind: str, k: int) -> None:
        out.append((kind, k, count[kind, k]))
        count[kind, k] += 1

    for _ in range(2 * (pp - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1), add("F", 0)
    for _ in range(pp - rank):
        add("F", 1), add("I", 1), add("W", 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            add("F", 0)
        add("I", 0), add("W", 0), add("F", 1), add("I", 1), add("W", 1)
    for _ in range(rank):
        add("I", 0), add("I", 1)
    for _ in range(pp - rank):
        add("I", 0), add("W", 0)
    while count["W", 1] < count["I", 1]:
        add("W", 1)
    while count["W", 0] < count["I", 0]:
        add("W", 0)
    return [a for a in out if a[2] < m]


def schedule_actions(schedule: str, pp: int, rank: int, v: int, m: int) -> List[Tuple[str, int, int]]:
    """The compute actions pipeline rank `rank` runs in one step, in order (see the helpers above).

    With stages of equal size the forwards alive at the peak (in virtual-stage units; divide by v for
    whole-rank micro-batches) come out as: gpipe m; 1f1b min(pp - rank, m); interleaved_1f1b
    min((v - 1) * R + 2 * (pp - 1 - rank) + 1, m * v) with R = m / max(1, m // pp) micro-batches a
    round (Megatron's (pp - rank - 1) * 2 + (v - 1) * pp warm-up plus the forward of the first 1F1B
    step, arXiv:2104.04473 sec. 2.2); interleaved_zb min((v - 1) * R + pp, m * v), the same for every
    rank (its warm-up is shorter by pp - 1 - rank, its weight passes trail by rank); zbv
    min(2 * pp, m + 1 + rank). A zero-bubble forward stays alive until its weight pass."""
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":  # warm-up min(m, pp - rank) forwards, then backward-forward pairs
        warmup = min(m, pp - rank)
        out = [("F", 0, i) for i in range(warmup)]
        for i in range(m):
            out.append(("B", 0, i))
            if warmup + i < m:
                out.append(("F", 0, warmup + i))
        return out
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        return _looped_actions(pp, rank, v, m, schedule == "interleaved_zb")
    if schedule == "zbv":
        return _zbv_actions(pp, rank, m)
    raise ConfigError(f"parallel.pipeline_schedule={schedule} is not one of gpipe, 1f1b, interleaved_1f1b, "
                      "interleaved_zb, zbv")


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
    """Activation memory of pipeline rank `pp_rank` (any tp / dp rank of it), over all its virtual stages.

    Keys: layers (transformer layers it holds), per_microbatch (bytes one micro-batch leaves saved on it:
    its layers, the embedding on the first stage, final norm, head input and loss buffers on the last),
    logits_and_loss (those loss buffers, 0 off the last stage), microbatches (m = global_batch /
    (micro_batch * dp)), in_flight (micro-batches alive at the peak, in whole-rank units: forwards of its
    virtual stages alive / their number), weight_copies (autocast's half-precision weights, once),
    batch_ids (the step's token ids a pipeline's first stage keeps without tp, once), peak (the largest
    total of saved activations during a step: the schedule's peak of per-stage bytes plus the two above),
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
    v = 1 if dims.pp == 1 else (2 if p.pipeline_schedule == "zbv" else p.virtual_pipeline_size)
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
        kept.append(full * whole + (n - full) * plain + (embedding_bytes(cfg, world, device) if s == 0 else 0)
                    + (head + loss if last else 0))
        # The zero-bubble input pass drops what no weight gradient needs: the loss buffers behind the head.
        freed_by_input.append(loss if last else 0)
    weights = _weight_copy_bytes(d, kept_layers, num_stages - 1 in stage_ids)
    # The schedule splits the step's joined batch: without tp the embedding keeps views of its token ids.
    batch_ids = m * d.b * d.s * INT64 if dims.pp > 1 and d.t == 1 and 0 in stage_ids else 0
    if dims.pp == 1:
        peak, alive = kept[0], 1
    else:
        peak, alive = _peak(schedule_actions(p.pipeline_schedule, dims.pp, pp_rank, v, m), kept, freed_by_input)
    return {"layers": sum(len(ranges[s]) for s in stage_ids), "per_microbatch": sum(kept),
            "logits_and_loss": loss if num_stages - 1 in stage_ids else 0, "microbatches": m,
            "in_flight": alive / v, "weight_copies": weights, "batch_ids": batch_ids,
            "peak": peak + weights + batch_ids, "recompute_transient": rebuilt, "per_stage": kept}
