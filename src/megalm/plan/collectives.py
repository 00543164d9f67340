"""The collectives of one optimizer step and the exact model state of one rank, as formulas.

Every count here is what megalm's code issues, term by term, for a GPT language model (the only
family covered yet); bytes are counted as megalm.distributed.comm.CommStats counts them: an
all-reduce its full tensor, an all-gather its local input, a reduce-scatter its full input, a
send or receive its tensor. What is structural (which layers and buckets a rank holds, the ZeRO
shards, padding included) is read off the meta-device model laid out over a fake process group
of the layout's size, by the same code a run uses (megalm.parallel.parallelize and the
DataParallel bucket layout); nothing is allocated. The rest is arithmetic on the config.

Shapes: b = trainer.micro_batch_size, s = model.seq_length, h = model.hidden_size, m micro-batches a
step (global_batch_size / (b dp)), L the layers this rank runs. fp32 tensors cost 4 bytes an element;
under trainer.precision bf16 / fp16, autocast runs the matmuls in 2-byte floats, so a row-parallel
layer's partial sums (and their gradients) are 2 bytes an element, while the embedding, the norms'
outputs, the residual stream that crosses pipeline stages and the loss's scalars stay fp32.

A step means a step after the first, as the trainer runs it: in the first, torch's pipeline schedules
also infer the stages' shapes, which can run a stage's forward once more.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from megalm.errors import ConfigError
from megalm.parallel.stages import virtual_stages_of

PURPOSES = ("tp", "pp", "dp", "embedding", "other")
ZERO_BUBBLE = ("interleaved_zb", "zbv")  # weight-gradient passes of their own (no accumulate hooks)
FP32 = 4

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
    buckets: Tuple[Tuple[int, int], ...] = ()  # (elements padded to a multiple of dp, elements / dp)
    zero3_unit_buckets: Tuple[int, ...] = ()   # ZeRO-3: per unit, the shard elements of its buckets
    zero3_unit_calls: int = 0                  # ZeRO-3: the buckets of every unit (a shared one per unit)
    owned: int = 0                     # elements of this rank's ZeRO shards of real parameters
    sp_elements: int = 0               # gradient elements summed over tp (sequence-parallel tags)
    tied_elements: int = 0             # gradient elements summed over the embedding group
    embedding_group: bool = False

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return len(self.owner) - 1 in self.stage_ids


_CACHE: Dict[tuple, RankLayout] = {}


def _check(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int):
    from megalm.distributed.mesh import ParallelDims
    m, p, d = cfg.model, cfg.parallel, cfg.data
    if m.arch != "gpt" or getattr(m, "fine_tuning_head", False):
        raise ConfigError(f"megalm.plan's collective formulas cover GPT language models; model.arch={m.arch!r}"
                          f"{' with a fine-tuning head' if m.arch == 'gpt' else ''} is not modelled yet")
    if d.source == "sft" and d.packing:
        raise ConfigError("data.packing=true: stage boundaries then carry position and segment ids, which "
                          "megalm.plan's collective formulas do not model yet")
    dims = ParallelDims.from_config(p, world)
    if p.zero_stage == 3 and dims.pp > 1 and p.pipeline_schedule in ZERO_BUBBLE:
        raise ConfigError(f"parallel.zero_stage=3 with pipeline_schedule={p.pipeline_schedule}: a unit stays "
                          "gathered from its first input-gradient pass to the end of the step there, so its "
                          "all-gathers depend on the schedule's order of passes, which is not modelled")
    for name, value, size in (("pp_rank", pp_rank, dims.pp), ("tp_rank", tp_rank, dims.tp), ("dp_rank", dp_rank, dims.dp)):
        if not 0 <= value < size:
            raise ValueError(f"{name}={value} is outside the layout's {size} ({name[:2]}={size})")
    return dims


def rank_layout(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> RankLayout:
    """The RankLayout of the rank at (pp_rank, dp_rank, tp_rank), from the meta-device model laid out
    over a fake process group of `world` ranks (torch's testing backend), as megalm.plan does."""
    dims = _check(cfg, world, pp_rank, tp_rank, dp_rank)
    key = (repr(cfg.model), repr(cfg.parallel), world, pp_rank, tp_rank, dp_rank)
    if key not in _CACHE:
        _CACHE[key] = _read_layout(cfg, dims, (pp_rank * dims.dp + dp_rank) * dims.tp + tp_rank)
    return _CACHE[key]


def _read_layout(cfg, dims, rank: int) -> RankLayout:
    import torch.distributed as dist
    from megalm.distributed.mesh import build_mesh
    from megalm.models import build_model
    from megalm.parallel import parallelize
    from megalm.parallel.data import build_data_parallel
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
        layout = parallelize(model, mesh, p, seed=cfg.trainer.seed)
        params = list(model.parameters())
        v = len(layout.stage_ids)
        owner = tuple(next(r for r in range(dims.pp) if s in virtual_stages_of(r, dims.pp, v, p.pipeline_schedule))
                      for s in range(layout.num_stages)) if dims.pp > 1 else (0,)
        fields = dict(tp=dims.tp, pp=dims.pp, dp=dims.dp, pp_rank=rank // (dims.dp * dims.tp),
                      stage_layers=tuple(len(layout.stage_ranges[s]) for s in layout.stage_ids),
                      stage_ids=tuple(layout.stage_ids), owner=owner, params=sum(q.numel() for q in params),
                      param_bytes=sum(q.numel() * q.element_size() for q in params))
        if mesh is None:
            return RankLayout(**fields)
        # The bucket layout of a run (parallel/data.py, zero3.py), built on the meta device.
        dp = build_data_parallel(model, mesh, layout, p.zero_stage, p.bucket_size_mb)
        tied = layout.tied_param(model)
        if dp.sharded:
            grads = [(s.tensor, s.stop - s.start, s.param is tied) for s in dp.shards]
        else:
            grads = [(q, q.numel(), q is tied) for q in dp.params]
        fields.update(
            buckets=tuple((b.size, b.shard_size) for b in dp.buckets),
            owned=sum(s.stop - s.start for s in dp.shards),
            sp_elements=sum(n for t, n, _ in grads if getattr(t, "sequence_parallel", False)),
            tied_elements=sum(n for _, n, is_tied in grads if is_tied),
            embedding_group=layout.embedding_group is not None)
        if p.zero_stage == 3:
            fields["zero3_unit_buckets"] = tuple(sum(b.shard_size for b in dp.unit_buckets[u]) for u in dp.units)
            fields["zero3_unit_calls"] = sum(len(dp.unit_buckets[u]) for u in dp.units)
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
    is on (dropout saves its mask; with none, nothing after that g saves anything). Selective
    recomputation replays the attention core, which communicates nothing.
    """
    kinds: Kinds = {}
    if lay.tp == 1:
        return kinds
    mdl, p, t = cfg.model, cfg.parallel, cfg.trainer
    tp, sp = lay.tp, p.sequence_parallel
    b, s, h = t.micro_batch_size, mdl.seq_length, mdl.hidden_size
    low = 2 if t.precision in ("bf16", "fp16") else 4
    act, act_low = b * s * h * FP32, b * s * h * low           # (b, s, h): fp32; a matmul's output
    shard, shard_low = act // tp, act_low // tp                # (b, s/tp, h)
    layers = sum(lay.stage_layers)
    if p.recompute == "full":
        n = p.recompute_num_layers
        replayed = sum(k if n is None else min(n, k) for k in lay.stage_layers)
    else:
        replayed = 0
    g_replayed = replayed * (2 if mdl.dropout > 0 else 1)
    per_mb: Kinds = {}
    if lay.first:
        if sp and mdl.position_embedding != "learned":
            _add(per_mb, "reduce_scatter", 1, act)
        else:
            _add(per_mb, "all_reduce", 1, act)
        if sp:
            _add(per_mb, "all_gather", 1, shard)  # backward of the sequence split
    if sp:
        _add(per_mb, "all_gather", 2 * layers + 2 * replayed, shard * (2 * layers + 2 * replayed))  # f forward
        _add(per_mb, "reduce_scatter", 2 * layers + g_replayed, act_low * (2 * layers + g_replayed))  # g forward
        _add(per_mb, "reduce_scatter", 2 * layers, act * 2 * layers)                # f backward
        _add(per_mb, "all_gather", 2 * layers, shard_low * 2 * layers)              # g backward
    else:
        _add(per_mb, "all_reduce", 2 * layers + g_replayed, act_low * (2 * layers + g_replayed))  # g forward
        _add(per_mb, "all_reduce", 2 * layers, act * 2 * layers)                    # f backward
    if lay.last:
        if sp:
            _add(per_mb, "all_gather", 1, shard)
            _add(per_mb, "reduce_scatter", 1, act)
        else:
            _add(per_mb, "all_reduce", 1, act)
        tokens = b * s * FP32
        _add(per_mb, "all_reduce", 2, tokens + 2 * tokens)
    m = microbatches(cfg, lay.dp)
    for kind, e in per_mb.items():
        _add(kinds, kind, m * e["calls"], m * e["bytes"])
    if sp and lay.sp_elements:
        _add(kinds, "all_reduce", 1, lay.sp_elements * FP32)
    return kinds


def pipeline(cfg, lay: RankLayout) -> Kinds:
    """Point-to-point messages of one step (torch.distributed.pipelining; Narayanan et al.,
    arXiv:2104.04473, sec. 2.2): per micro-batch and per boundary between two stages of different
    ranks, the activation (b, s, h) fp32 forward and its gradient backward, each sent by one rank and
    received by the other; (b, s/tp, h) under sequence parallelism, where the stream between layers
    is split by sequence. Every schedule sends the same messages, only in another order; a boundary
    between two stages of one rank (ZBV's turn of the V) is handed over in memory."""
    kinds: Kinds = {}
    if lay.pp == 1:
        return kinds
    mdl, t = cfg.model, cfg.trainer
    seq = mdl.seq_length // lay.tp if cfg.parallel.sequence_parallel else mdl.seq_length
    msg = t.micro_batch_size * seq * mdl.hidden_size * FP32
    crossings = sum((s > 0 and lay.owner[s - 1] != lay.pp_rank) + (s < len(lay.owner) - 1 and lay.owner[s + 1] != lay.pp_rank)
                    for s in lay.stage_ids)
    m = microbatches(cfg, lay.dp)
    # each crossing: one direction sends forward and receives backward, the other the reverse
    _add(kinds, "send", m * crossings, m * crossings * msg)
    _add(kinds, "recv", m * crossings, m * crossings * msg)
    return kinds


def data_parallel(cfg, lay: RankLayout) -> Kinds:
    """Gradient and parameter collectives over dp of one step (parallel/data.py, zero3.py).

    ZeRO (Rajbhandari et al., arXiv:1910.02054): one collective per gradient bucket, each bucket
    padded to a multiple of dp: an all-reduce (stage 0) or a reduce-scatter (stages 1-3) of the
    whole bucket, fp32. Stages 1 and 2 all-gather each bucket's 1/dp of updated parameters after the
    optimizer step. Stage 3 (sec. 5.3) instead gathers parameters when they are used: every micro-
    batch, each unit's buckets in its forward (a bucket two units share, the tied embedding, once for
    each) and every bucket once in backward. A run of one rank in dp without ZeRO has no buckets
    and communicates nothing here."""
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


def embedding(cfg, lay: RankLayout) -> Kinds:
    """The tied embedding's gradient summed between the first stage's embedding and the last stage's
    head copy (Megatron's embedding group; Narayanan et al., arXiv:2104.04473): one all-reduce a step of
    this rank's elements of it (its ZeRO shard, or the whole vocabulary shard)."""
    kinds: Kinds = {}
    if lay.embedding_group and lay.tied_elements:
        _add(kinds, "all_reduce", 1, lay.tied_elements * FP32)
    return kinds


def untracked_collectives(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> Kinds:
    """The part of "other" issued through torch.distributed directly, which count_comm does not see:
    the pipeline's mean loss broadcast from the last stage (Pipeline._share, one fp32), the logged
    loss averaged over dp (trainer: grads.mean_over, one fp32) and under fp16 the overflow vote over
    every rank (DynamicLossScaler, one fp32)."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank)
    kinds: Kinds = {}
    if lay.pp > 1:
        _add(kinds, "broadcast", 1, FP32)
    if lay.dp > 1:
        _add(kinds, "all_reduce", 1, FP32)
    if cfg.trainer.precision == "fp16" and world > 1:
        _add(kinds, "all_reduce", 1, FP32)
    return kinds


def other(cfg, lay: RankLayout) -> Kinds:
    """The gradient norm's scalars (parallel/grads.py): the squared sums of tp-sharded gradients
    summed over tp (one fp32), the stages' totals over pp (one fp32), and under ZeRO the shards'
    two partial sums over dp (two fp32), each only over a group of more than one rank."""
    kinds: Kinds = {}
    if lay.tp > 1:
        _add(kinds, "all_reduce", 1, FP32)
    if lay.pp > 1:
        _add(kinds, "all_reduce", 1, FP32)
    if cfg.parallel.zero_stage >= 1 and lay.dp > 1:
        _add(kinds, "all_reduce", 1, 2 * FP32)
    return kinds


def step_collectives(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> Collectives:
    """The collectives one optimizer step (all its micro-batches) issues on the rank at (pp_rank,
    dp_rank, tp_rank), by purpose: {"tp", "pp", "dp", "embedding", "other"} -> {kind: {"calls",
    "bytes"}}, kinds all_reduce, all_gather, reduce_scatter, send, recv, broadcast. dp_rank matters
    only for ZeRO's padding, which the last dp rank's shard holds. `cfg` is the composed Config
    (megalm.plan.compose); "other" includes `untracked_collectives`."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank)
    out = {"tp": tensor_parallel(cfg, lay), "pp": pipeline(cfg, lay), "dp": data_parallel(cfg, lay),
           "embedding": embedding(cfg, lay), "other": other(cfg, lay)}
    for kind, e in untracked_collectives(cfg, world, pp_rank, tp_rank, dp_rank).items():
        _add(out["other"], kind, e["calls"], e["bytes"])
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


def exact_model_state_bytes(cfg, world: int, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> Dict[str, int]:
    """Bytes of weights, gradients and optimizer state the rank holds right after an optimizer step
    (before the gradients are zeroed), as megalm.training.memory.measured_model_state_bytes reports.

    fp32 weights, fp32 gradients, fp32 optimizer moments (megalm.training.memory; ZeRO, arXiv:1910.02054,
    sec. 5): with gradient buckets the gradients are the buckets' buffers, padding included: whole
    (ZeRO 0, 1) or this rank's 1/dp chunk (ZeRO 2, 3); ZeRO 1-3 keep optimizer state for this rank's
    shards of real parameters only (no padding); ZeRO-3 keeps the weights' 1/dp chunks, padding
    included. A single process, or a run without buckets (dp 1, ZeRO 0), holds one gradient per
    parameter; ZeRO needs more than one rank (a single process runs unsharded)."""
    lay = rank_layout(cfg, world, pp_rank, tp_rank, dp_rank)
    k = optimizer_moments(cfg)
    z = cfg.parallel.zero_stage
    if not lay.buckets:
        return {"weights": lay.param_bytes, "grads": lay.params * FP32, "optimizer": k * lay.params * FP32}
    full = sum(size for size, _ in lay.buckets) * FP32
    chunks = sum(shard for _, shard in lay.buckets) * FP32
    return {"weights": chunks if z == 3 else lay.param_bytes,
            "grads": full if z <= 1 else chunks,
            "optimizer": k * (lay.owned if z >= 1 else lay.params) * FP32}
