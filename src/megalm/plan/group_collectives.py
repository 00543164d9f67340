"""The collectives one step issues on one rank, group by group, each as {kind: {"calls", "bytes"}} (`Kinds`):
tensor and sequence parallelism's, the pipeline's sends, the cp ring's, the data-parallel buckets and ZeRO's
gathers, the tied embedding's sum and the gradient norm's scalars. A mixture's experts' are
megalm.plan.expert_collectives'; megalm.plan.collectives puts them all together. How they are counted is below."""

from __future__ import annotations

from typing import Dict, List, Tuple

from megalm.parallel.tensor import overlap_pieces
from megalm.plan.layout import RankLayout
from megalm.plan.shapes import FP32, INT64, encoder, held_bytes, local_tokens, microbatches


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
# outputs, the residual stream that crosses pipeline stages and the loss's scalars stay fp32. With
# trainer.mixed_precision=main_params the weights are held in the 2-byte dtype, so the embedding, the norms'
# outputs and the residual stream are too (`held_bytes`), and ZeRO gathers the weights in it; the gradient
# buckets (the fp32 main gradients) and the loss's scalars stay fp32.
#
# A step means a step after the first, as the trainer runs it: in the first, torch's pipeline schedules
# also infer the stages' shapes, which can run a stage's forward once more.


Kinds = Dict[str, Dict[str, int]]        # {kind: {"calls": n, "bytes": b}}


def _add(kinds: Kinds, kind: str, calls: int, nbytes: int) -> None:
    if calls:
        entry = kinds.setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += calls
        entry["bytes"] += nbytes


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
    all-gather of the (b, s/tp, h) shard forward (in the compute dtype: under autocast the shard is cast
    before it) and a reduce-scatter of (b, s, h) backward, plus the same all-gather again in backward
    (the linear keeps the shard, not the gathered input: megalm.parallel.tensor._GatheredLinear), each g
    into a reduce-scatter forward and an all-gather backward. With parallel.tp_comm_overlap each f's forward
    all-gather, each g's reduce-scatter and its backward all-gather are issued in k pieces (the same bytes,
    `megalm.parallel.tensor.overlap_pieces` of the rank's s/tp tokens: tp when they divide evenly); the f's
    backward gather and reduce-scatter stay whole. The embedding's lookup is all-reduced
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
    act, act_low = b * s * h * held_bytes(t), b * s * h * low  # (b, s, h): the residual stream; a matmul's output
    shard, shard_low = act // tp, act_low // tp                # (b, s/tp, h)
    layers = sum(lay.stage_layers)
    replayed = _replayed_layers(cfg, lay) if p.recompute == "full" else 0
    post_norm = encoder(mdl) and mdl.norm_position == "post"
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
    k = overlap_pieces(s // tp, tp) if sp and p.tp_comm_overlap else 1  # tp_comm_overlap: calls a collective is cut in
    if sp:
        _add(per_mb, "all_gather", (n + f_replayed) * k, shard_low * (n + f_replayed))    # f forward
        _add(per_mb, "all_gather", n, shard_low * n)                                      # f backward: the input again
        _add(per_mb, "reduce_scatter", (n + g_replayed) * k, act_low * (n + g_replayed))  # g forward
        _add(per_mb, "reduce_scatter", n, act * n)                                        # f backward
        _add(per_mb, "all_gather", n * k, shard_low * n)                                  # g backward
    else:
        _add(per_mb, "all_reduce", n + g_replayed, act_low * (n + g_replayed))      # g forward
        _add(per_mb, "all_reduce", n, act * n)                                      # f backward
        if moe:  # the MoE layer's own shard: its output gathered forward, its input's gradient backward
            _add(per_mb, "all_gather", 2 * layers, shard * 2 * layers)
    if lay.last:
        if sp:
            # the head's f as a layer's; model.fused_loss gathers its input whole into the chunked loss, once
            fused = getattr(mdl, "fused_loss", False)
            _add(per_mb, "all_gather", 1 if fused else 1 + k, shard if fused else 2 * shard_low)
            _add(per_mb, "reduce_scatter", 1, act)
            if encoder(mdl) and mdl.binary_head:
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
    int64 padding mask beside them) and backward (the hidden states' gradient). fp32 stands for the residual
    stream's dtype (`held_bytes`) throughout."""
    mdl, t = cfg.model, cfg.trainer
    seq = local_tokens(cfg) // tp if cfg.parallel.sequence_parallel else local_tokens(cfg)
    msg = t.micro_batch_size * seq * mdl.hidden_size * held_bytes(t)
    return [msg] + ([t.micro_batch_size * mdl.seq_length * INT64] if encoder(mdl) else []), msg


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


def ring_block_bytes(cfg, tp: int) -> int:
    """Bytes of one send of the cp ring (megalm.parallel.context): a rank's (k, v) block of one layer and
    micro-batch, (b, 2 kv_heads / tp, seq_length / cp, head_dim) in the compute dtype, or its gradient."""
    m, t = cfg.model, cfg.trainer
    e = 2 if t.precision in ("bf16", "fp16") else FP32
    return 2 * t.micro_batch_size * (m.kv_heads // tp) * local_tokens(cfg) * m.head_dim * e


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
    communicates nothing here, except for ZeRO 1-3's collectives over the group of one; under
    trainer.mixed_precision=main_params it has buckets (the main gradients) but no all-reduce over one rank.
    The parameters are gathered in the weights' dtype (`held_bytes`: the bf16 / fp16 weights under main_params).
    Under expert parallelism the experts' buckets are `expert_data_parallel`'s."""
    kinds: Kinds = {}
    if not lay.buckets:
        return kinds
    z = cfg.parallel.zero_stage
    n = len(lay.buckets)
    full = sum(size for size, _ in lay.buckets) * FP32
    shards = sum(shard for _, shard in lay.buckets) * held_bytes(cfg.trainer)
    if z > 0 or lay.replicas > 1:  # (an all-reduce over one rank is skipped: megalm.parallel.data)
        _add(kinds, "all_reduce" if z == 0 else "reduce_scatter", n, full)
    if z in (1, 2):
        _add(kinds, "all_gather", n, shards)
    elif z == 3:
        m = microbatches(cfg, lay.dp)
        _add(kinds, "all_gather", m * (lay.zero3_unit_calls + n),
             m * (sum(lay.zero3_unit_buckets) * held_bytes(cfg.trainer) + shards))
    return kinds


def embedding(cfg, lay: RankLayout) -> Kinds:
    """The tied embedding's gradient summed between the first stage's embedding and the last stage's
    head copy (Megatron's embedding group; Narayanan et al., arXiv:2104.04473): one all-reduce a step of
    this rank's elements of it (its ZeRO shard, or the whole vocabulary shard)."""
    kinds: Kinds = {}
    if lay.embedding_group and lay.tied_elements:
        _add(kinds, "all_reduce", 1, lay.tied_elements * FP32)
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
