"""Activation memory: the bytes autograd keeps for backward per layer (`layer_terms`), before and after the layers
(embedding, heads, loss buffers, autocast's weight copies), and per pipeline stage and at a rank's peak under its
schedule (`stage_activation_bytes`). The attention's terms are megalm.plan.attention's, a mixture of experts'
megalm.plan.moe's; the method, its sources and where megalm departs from them are below."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megalm.distributed.mesh import ParallelDims
from megalm.errors import ConfigError
from megalm.parallel.stages import stage_layer_ranges, virtual_stages_of
from megalm.plan.attention import _attention_core, _key_mask, ring_attention_bytes
from megalm.plan.moe import _moe_input, moe_kept_bytes
from megalm.plan.schedules import schedule_actions, virtual_stages_per_rank
from megalm.plan.shapes import FP32, INT64, _Shape, _shape


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
# - sequence parallelism keeps the sequence shard of each column-parallel linear's input and gathers it again
#   in backward, as Megatron does (megalm.parallel.tensor._GatheredLinear); under autocast the shard is cast
#   before the gather, and that linear's weight copy is cast again in backward rather than saved
#   (`_weight_copy_bytes`);
# - training runs fp32 by default; with bf16 / fp16 autocast the residual stream, norms, the log-softmax
#   and the statistics stay fp32, and each linear keeps a half-precision copy of its input and its weight;
#   with trainer.mixed_precision=main_params (Megatron's: weights in the compute dtype) the residual stream
#   and the norms' inputs are in the compute dtype (`_Shape.r`; the norms run with autocast off,
#   megalm.models.layers.LayerNorm), no linear keeps a weight copy, and a GPT layer under sp with dropout
#   keeps the paper's 34sbh/t on CUDA's kernels (tests/test_plan_activations.py holds the planner to it);
# - selective recomputation wraps the attention core (Parts.selective): with fused attention that saves
#   only the log-sum-exp, the GQA-repeated keys and values and, after RoPE, SDPA's own output; not 5as/h.
# - packed sequences (data.packing: a mask per example, position ids) are not modeled;
# - a mixture of experts (`moe_kept_bytes`) keeps per routed (token, expert) row what a dense MLP keeps per
#   token, in the residual stream's dtype (its grouped matmuls have no autocast rule), plus its routing's
#   indices; the rows a rank runs depend on the router, and are planned for the balanced case (`moe_rows`);
#   under expert tensor parallelism a rank runs the rows of all tp ranks through its 1/tp slices of the
#   experts.
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


def _norm(d: _Shape) -> float:
    """A pre-norm on the residual stream (its element `d.r`: fp32 under autocast, the compute dtype with low-precision
    weights), per token, over the sequence-parallel region (see `_norm_kept`)."""
    return _norm_kept(d, d.r) / d.seq


def _norm_kept(d: _Shape, element: int) -> float:
    """A norm's saves per token over an input of `element` bytes, not divided by sp. LayerNorm's kernel keeps its
    input and the mean and rstd: fp32, except on CPU with low-precision weights, where the kernel returns them in
    the weights' dtype. RMSNorm on CUDA (torch's fused kernel) keeps its input and an fp32 rstd; on CPU torch's
    composite x * rsqrt(mean(x^2) + eps) * w works in fp32 whatever the input's dtype, and keeps the input upcast,
    the normalized x its weight multiplies and rstd, all fp32."""
    if d.rmsnorm:
        return 2 * d.h * FP32 + FP32 if d.cpu else d.h * element + FP32
    return d.h * element + 2 * (d.e if d.main and d.cpu else FP32)


def _mlp(d: _Shape) -> float:
    """GELU: fc1's output (GELU's input) and GELU's output (fc2's input), f each. ReLU: its output only
    (its own backward and fc2's input). SwiGLU: fc1's output [gate | up] (2f, SiLU and the product keep
    views of it), SiLU's output and the product (f each). / t. parallel.recompute_activation frees fc2's input
    (GELU's output, SwiGLU's product) after fc2's forward: f less; ReLU's is left alone."""
    kept = 4 if d.swiglu else 1 if d.relu else 2
    return (kept - (1 if _frees_fc2_input(d) else 0)) * d.f * d.e / d.t


def _frees_fc2_input(d: _Shape) -> bool:
    """parallel.recompute_activation applies: a dense MLP whose activation's output is not its own saved tensor."""
    return d.recompute_act and not d.relu and not d.experts


def _hidden_dropout(d: _Shape) -> float:
    """The dropout after each row-parallel linear (attention output, MLP output), on the sequence shard
    under sp. Its input is the compute dtype, or fp32 when tp's row-parallel fp32 bias is added after autocast."""
    if d.dropout <= 0:
        return 0.0
    element = FP32 if d.autocast and not d.main and d.t > 1 and d.bias else d.e
    return 2 * d.h * d.mask(element) / d.seq


def layer_terms(cfg, world: int, recompute: Optional[str] = None, device: Optional[str] = None) -> Dict[str, float]:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank, by term.

    `recompute` overrides parallel.recompute (none | selective | full); `device` (cpu | cuda) defaults to
    trainer.device (auto: cuda). Per token, times s*b:
    - norms: the two pre-norms (see `_norm`), / t under sequence parallelism; BERT's post-norms (norm1 after
      the attention's residual, norm2 after the MLP's) keep the same: a residual sum (`_Shape.r`) and its statistics;
    - linear_inputs: the inputs of qkv and fc1, h each in the compute dtype: the norm's output (a copy under
      autocast), whole under tp (a view behind Megatron's f), the sequence shard under sp (gathered again in
      backward); under post-norm the qkv input is the layer's input (the previous norm2's output, or the
      embedding's);
    - attention: `_attention_core`, or under context parallelism `ring_attention_bytes` (its chunk pairs'
      scores, the k and v it saw, the RoPE tables at its positions); key_mask: `_key_mask` (BERT); mlp:
      `_mlp`; dropout: `_hidden_dropout`;
    - full recomputation: only the block input the checkpoint saves, h in the residual stream's dtype (fp32
      under autocast, the compute dtype under main_params; / t under sp); BERT's key mask,
      its other input, is one bool tensor a stage shares (`stage_activation_bytes`).
    """
    d = _shape(cfg, world, device)
    mode = cfg.parallel.recompute if recompute is None else recompute
    tokens = d.s * d.b
    if mode == "full":
        return {"layer_input": tokens * d.h * d.r / d.seq}
    if mode not in ("none", "selective"):
        raise ConfigError(f"recompute={mode} is not one of none, selective, full")
    attention = tokens * _attention_core(d, mode == "selective") if d.cp == 1 else \
        ring_attention_bytes(d, mode == "selective")
    if d.experts:  # a mixture of experts in place of the MLP
        moe = moe_kept_bytes(d)
        return {"norms": tokens * 2 * _norm(d), "linear_inputs": tokens * d.h * d.e / d.seq + _moe_input(d),
                "attention": attention, "key_mask": 0.0, "router": moe["router"], "mlp": moe["experts"],
                "dropout": tokens * _hidden_dropout(d) / 2 + moe["dropout"]}
    return {"norms": tokens * 2 * _norm(d), "linear_inputs": tokens * 2 * d.h * d.e / d.seq, "attention": attention,
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
    positions' ids (s int64), and with dropout its mask on the embedding (the residual stream's dtype), on
    the sequence shard when sp scatters first (RoPE models reduce-scatter the lookup; learned positions are
    added before the scatter).

    BERT adds its token-type ids (int64, read by a replicated lookup at any tp: a view of the joined batch
    under pp, counted there) and, under post-norm, the embedding's norm (input and statistics, `_norm_kept`); its
    norm and dropout run on the whole sequence, which sp splits after them (its input in the residual stream's
    dtype)."""
    d = _shape(cfg, world, device)
    tokens = d.s * d.b
    ids = INT64 + 1 if d.t > 1 else (0 if cfg.parallel.pp > 1 else INT64)
    if d.token_types:
        ids += 0 if cfg.parallel.pp > 1 else INT64
    kept = tokens * ids + (0 if d.rope else d.s * INT64)
    if d.post_norm:
        kept += tokens * _norm_kept(d, d.r)
    if d.dropout > 0:
        kept += tokens * d.h * d.mask(d.r) / (d.seq if d.rope else 1)
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
    """The last stage's final norm (`_norm`) and the head's input (h in the compute dtype: the whole sequence, a
    view behind f, under tp; the sequence shard under sp, but whole when model.fused_loss gathers it into the
    chunked loss), for one micro-batch; without the loss buffers.
    BERT's heads (`_bert_head`) in place of GPT's."""
    d = _shape(cfg, world, device)
    if d.bert:
        return round(_bert_head(d))
    return round(d.s * d.b * (_norm(d) + d.h * d.e / (1 if d.fused_head else d.seq)))


def _bert_head(d: _Shape) -> float:
    """What BERT's last stage keeps after its layers, for one micro-batch (megalm.models.bert), by tensor:
    - pre-norm's final norm (`_norm`); post-norm has none;
    - the MLM transform, on sequence shards under sp: dense's input (the final norm's or the last layer's
      output, a copy under autocast, h e), GELU's input (dense's output, h e) and the norm's input (GELU's
      output: h e on CPU, where autocast leaves layer_norm in bf16; CUDA's autocast runs it in fp32, a copy
      of h fp32) with its statistics;
    - the tied output's input (the norm's output, or its copy, h e), as GPT's head (the shard under sp);
    - with the binary head, per sequence: tanh's output (the pooled h, also the binary head's input) and,
      under autocast, the pooler's copy of token 0 (h); in fp32 the pooler's input is a view of a tensor
      already kept, except under sp, where it views the whole gathered (s, h) fp32 sequence and keeps it
      alive; the sentence-order loss's fp32 log-softmax of 2 and int64 target.
    Korthikanti et al. count the layers only; Megatron's BERT has the same heads."""
    tokens, seqs, h, e = d.s * d.b, d.b, d.h, d.e
    norm_in = e if (d.autocast and d.cpu) or d.main else FP32
    kept = tokens * ((0 if d.post_norm else _norm(d)) + (2 * h * e + _norm_kept(d, norm_in)) / d.seq + h * e / d.seq)
    if d.binary_head:
        copy = d.autocast and not d.main  # the pooler casts token 0 of an fp32 stream, or views the stream
        kept += seqs * (h * e + (h * 2 if copy else 0) + (d.s * h * d.r if d.sp and not copy else 0))
        kept += seqs * (2 * FP32 + INT64)
    return kept


def _weight_copy_bytes(d: _Shape, layers: int, last: bool) -> int:
    """Under autocast each linear keeps the half-precision copy of its weight it multiplied with: qkv, proj,
    fc1, fc2 of each layer that is not recomputed whole, and the head's on the last stage (/ t). Autocast
    caches the copy for its context, so a rank holds one set however many micro-batches are in flight. Under
    sequence parallelism qkv, fc1 and the head keep none: they cast their weight again in backward
    (megalm.parallel.tensor._GatheredLinear). Not counted, as not saved: the copies autocast's cache holds
    only while the forward's region lasts (the trainer's micro-batch forward, a pipeline's whole step) of the
    layers recomputed whole and of those sequence-parallel linears.
    BERT's last stage adds its replicated MLM dense and, with the binary head, the pooler's and the head's.
    A mixture of experts has none in place of fc1's and fc2's: its router runs in fp32 with autocast off, and
    the experts' grouped_mm has no autocast rule (fp32 rows by fp32 weights)."""
    if not d.autocast or d.main:  # fp32, or the weights already in the compute dtype: no copies
        return 0
    column = d.h * (d.h + 2 * d.kv) + (0 if d.experts else d.h * d.f * (2 if d.swiglu else 1))  # qkv, fc1
    per_layer = d.h * d.h + (0 if d.experts else d.h * d.f) + (0 if d.sp else column)  # proj, fc2
    replicated = (d.h * d.h + (d.h * d.h + 2 * d.h if d.binary_head else 0)) * d.e if last and d.bert else 0
    head = d.vocab * d.h if last and d.lm_head and (d.fused_head or not d.sp) else 0
    return (layers * per_layer + head) * d.e // d.t + replicated


def _peak(actions, kept: List[int], freed_by_input: List[int]) -> Tuple[int, int]:
    """The largest sum of activations alive over the actions, and the forwards alive at that moment."""
    live = alive = peak = at_peak = 0
    for kind, k, _ in actions:
        if kind == "F":
            live, alive = live + kept[k], alive + 1
            if live > peak:
                peak, at_peak = live, alive
        elif kind == "I":  # (it may also refill: parallel.recompute_activation's fc2 inputs)
            live -= freed_by_input[k]
            if live > peak:
                peak, at_peak = live, alive
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
        # The zero-bubble input pass drops what no weight gradient needs: the loss buffers behind the head; with
        # parallel.recompute_activation it refills each layer's fc2 input, which the weight pass then needs.
        refilled = (n - full) * d.s * d.b * d.f * d.e / d.t if _frees_fc2_input(d) else 0
        freed_by_input.append((loss if last else 0) - refilled)
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
