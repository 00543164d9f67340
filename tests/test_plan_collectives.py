"""megalm.plan.collectives and megalm.plan.model_state against real training steps: on every rank of each
layout, the collectives a step issues (count_comm: calls and bytes per kind; the scalars sent through
torch.distributed directly, recorded here) equal step_collectives exactly, and the model state measured right
after the optimizer step equals exact_model_state_bytes exactly, padding included.

GPT language models and BERT's pretraining (its layouts name model=bert_tiny; the rest are GPT's), and
context parallelism (the ring's sends, gradients and ZeRO shards over dp x cp), mixtures of experts (expert
parallelism, expert tensor parallelism, both, with ZeRO 0-3), each family and parallelism also under
trainer.mixed_precision=main_params (MAIN). One launch of 2 ranks runs every 2-rank layout in turn, one of 8
ranks tp2_pp2_dp2 (sequence parallel with ZeRO-1, then ZeRO-3), tp2_pp2 at cp2, dp4 x ep2 at cp2, ep2 with
expert tp at tp2_pp2_dp2 (sequence parallel) and tp2 x dp4 (ZeRO-3), and under main_params tp2_pp2_dp2 and
dp4 x ep2 at cp2; the single processes run here.
Each layout runs a step first (the pipeline's shape inference, the buckets learning how many accumulations a
step makes) and is measured in its second.
"""

from __future__ import annotations

import pytest

from configs import plan_config
from distributed import run_ranks

GPT = ["model=gpt_tiny", "model.num_layers=4"]  # the model of a layout that names none
BASE = ["data=mock", "logging.curves=false", "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.num_threads=1",
        "trainer.progress_bar=false", "checkpoint.save=false",
        "parallel.bucket_size_mb=0.02"]  # ~5k-element buckets: several per rank
# BERT's pretraining heads: the padding mask crosses stages with the hidden states, the pooler gathers the
# sequence under sp, the MLM accuracy all-reduces over tp, its metrics join the loss's scalars.
BERT = ["model=bert_tiny", "model.num_layers=4"]
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.bias=false", "model.tie_embeddings=false", "model.num_query_groups=2"]
MOE = ["model=moe_tiny", "model.num_layers=4", "model.moe_router_topk=4"]
NEOX = ["model=neox_tiny", "model.num_layers=4"]
# Megatron's mixed precision: bf16 weights (ZeRO gathers them in bf16; the residual stream, so the embedding's, the
# stage boundaries' and sp's gradient collectives, in bf16), fp32 main gradients in the buckets (reduced in fp32,
# a single process and dp = 1 holding buckets too, with no all-reduce over one rank) and fp32 main parameters.
MAIN = ["trainer.precision=bf16", "trainer.mixed_precision=main_params"]
# Odd widths and a bucket per parameter: buckets of odd length, padded to a multiple of dp.
ODD = ["model.hidden_size=33", "model.num_attention_heads=3", "parallel.bucket_size_mb=0.0001"]
TWO_RANKS = [
    ["parallel=tp2"],
    ["parallel=tp2", "parallel.sequence_parallel=true", "model.dropout=0.1"],
    # RoPE: the embedding reduce-scatters into sequence shards; bf16: row-parallel sums in 2 bytes;
    # full recomputation with dropout replays both of a layer's g.
    ["parallel=tp2", "parallel.sequence_parallel=true", *LLAMA, "trainer.precision=bf16", "parallel.recompute=full",
     "model.dropout=0.1"],
    # no dropout: recomputation stops before the MLP's g; fp16: the overflow vote
    ["parallel=tp2", "parallel.recompute=full", "parallel.recompute_num_layers=1", "trainer.precision=fp16",
     "trainer.loss_scale=128"],
    ["parallel=tp2", "parallel.recompute=selective", "model.attention_dropout=0.1"],
    ["parallel=pp2", "parallel.pipeline_schedule=gpipe", "parallel.layers_per_stage=[1,3]"],
    ["parallel=pp2", "parallel.pipeline_schedule=1f1b"],
    ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2"],
    ["parallel=pp2", "parallel.pipeline_schedule=interleaved_zb", "parallel.virtual_pipeline_size=2", *LLAMA],
    ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"],
    # ZeRO-3 over a dp group of one: its gathers still run, across two stages of a rank in turn
    ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2",
     "parallel.zero_stage=3"],
    ["parallel=dp2", "parallel.zero_stage=0", *ODD],
    ["parallel=dp2", "parallel.zero_stage=1", *ODD],
    ["parallel=dp2", "parallel.zero_stage=2", *LLAMA],
    ["parallel=dp2", "parallel.zero_stage=3", *ODD, "parallel.recompute=full", "model.dropout=0.1"],
    # post-norm: full recomputation replays the MLP's g without dropout too (norm2 saves its input)
    [*BERT, "parallel=tp2", "parallel.sequence_parallel=true", "model.norm_position=post", "parallel.recompute=full"],
    [*BERT, "parallel=pp2", "parallel.pipeline_schedule=1f1b", "trainer.precision=bf16"],
    [*BERT, "parallel=dp2", "parallel.zero_stage=1", "model.binary_head=false"],
    # Context parallelism: the ring's sends and their gradients; ZeRO-1 shards (odd buckets, padded) over the
    # cp ranks; recomputation replays the ring's forward sends (full: bf16 blocks of GQA's kv heads, gradients
    # all-reduced over the cp ranks; selective: the attention core alone, with fp16's overflow vote).
    ["parallel.cp=2", "parallel.zero_stage=1", *ODD],
    ["parallel.cp=2", *LLAMA, "trainer.precision=bf16", "parallel.recompute=full", "model.dropout=0.1"],
    ["parallel.cp=2", "parallel.recompute=selective", "trainer.precision=fp16", "trainer.loss_scale=128"],
    # Mixtures of experts (k = E: every token to every expert, so each rank sends and receives exactly the
    # planned rows): expert parallelism's all-to-alls and the experts' buckets over dp / ep (here one rank:
    # ZeRO-0 skips the all-reduce over one), ZeRO-1 shards there, full recomputation replaying the dispatch,
    # a capacity;
    # under tp each rank's shard (cut and gathered without sp), the router and experts summed over tp, the
    # routing counts over tp or cp; ZeRO-3 units of experts; the routing report over pp.
    [*MOE, "parallel=dp2", "parallel.ep=2"],
    [*MOE, "parallel=dp2", "parallel.ep=2", "parallel.zero_stage=1", "trainer.precision=bf16",
     "parallel.recompute=full", "model.moe_capacity_factor=0.5"],
    [*MOE, "parallel=tp2", "parallel.recompute=full", "model.dropout=0.1"],
    [*MOE, "parallel=tp2", "parallel.sequence_parallel=true", "parallel.recompute=full", "parallel.zero_stage=0"],
    [*MOE, "parallel.cp=2", "parallel.zero_stage=2"],
    [*MOE, "parallel=dp2", "parallel.zero_stage=3"],
    [*MOE, "parallel=pp2", "parallel.pipeline_schedule=1f1b"],
    # Expert tensor parallelism: each tp rank's rows to both tp ranks and the partial outputs back (all-to-alls
    # over tp, replayed by full recomputation), the per-expert counts gathered over tp first, the experts
    # split over tp (left out of the sum over tp); ZeRO-3 under ep, the experts' buckets sharded and gathered
    # over their (dp / ep) ranks, here one.
    [*MOE, "parallel=tp2", "parallel.expert_tp=2", "parallel.recompute=full", "model.dropout=0.1",
     "parallel.zero_stage=1"],
    [*MOE, "parallel=tp2", "parallel.expert_tp=2", "parallel.sequence_parallel=true", "trainer.precision=bf16"],
    [*MOE, "parallel=dp2", "parallel.ep=2", "parallel.zero_stage=3"],
    # A decoder family planned by its kind alone (GPT-NeoX: attention and MLP in parallel off one residual, partial
    # rotary): the same column -> row pairs a layer, so the decoder formulas count its collectives and state.
    [*NEOX, "parallel=tp2", "parallel.sequence_parallel=true", "model.dropout=0.1"],
    [*NEOX, "parallel=pp2", "parallel.pipeline_schedule=1f1b"],
    # parallel.tp_comm_overlap: sp's collectives in pieces (2 here; 4 at tp4 below), the replayed ones too
    ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true", *LLAMA,
     "parallel.recompute=full", "model.dropout=0.1"],
    [*BERT, "parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"],
    *([*MAIN, *o] for o in (
        ["parallel=dp2", "parallel.zero_stage=0", *ODD], ["parallel=dp2", "parallel.zero_stage=1", *ODD],
        ["parallel=dp2", "parallel.zero_stage=2", *LLAMA], ["parallel=dp2", "parallel.zero_stage=3", *ODD],
        ["parallel=tp2", "parallel.sequence_parallel=true", "model.dropout=0.1"],
        ["parallel=tp2", "parallel.sequence_parallel=true", *LLAMA, "parallel.recompute=full", "model.dropout=0.1"],
        ["parallel=tp2", *LLAMA], ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"],
        ["parallel.cp=2", "parallel.zero_stage=1", *LLAMA], [*MOE, "parallel=dp2", "parallel.ep=2"],
        [*MOE, "parallel=tp2", "parallel.expert_tp=2", "parallel.sequence_parallel=true"],
        [*MOE, "parallel=tp2", "parallel.recompute=full", "model.dropout=0.1"],
        [*BERT, "parallel=tp2", "parallel.sequence_parallel=true"],
        [*BERT, "parallel=pp2", "parallel.pipeline_schedule=1f1b"])),
]
EIGHT_RANKS = [["parallel=tp2_pp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"],
               ["parallel=tp4", "parallel.pp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true",
                *MAIN],
               ["parallel=tp2_pp2_dp2", "parallel.zero_stage=3", *LLAMA],
               # cp2 with tp2 + sp and a pipeline: every term on the rank's half of each sequence
               ["parallel=tp2_pp2", "parallel.cp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"],
               # ep x cp: the experts' buckets over (dp / ep) x cp = 4 ranks (ZeRO-1 shards there)
               [*MOE, "parallel=dp4", "parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"],
               # ep x expert tp: the rows of the ep exchange through both tp ranks' slices; the experts' gradient
               # norm summed over tp, then ep (ZeRO-0), on both stages of a pipeline; ZeRO-3's expert buckets over
               # dp / ep = 2 ranks
               [*MOE, "parallel=tp2_pp2_dp2", "parallel.ep=2", "parallel.expert_tp=2",
                "parallel.sequence_parallel=true"],
               [*MOE, "parallel=tp2", "parallel.dp=4", "parallel.ep=2", "parallel.expert_tp=2",
                "parallel.zero_stage=3"],
               [*MAIN, "parallel=tp2_pp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"],
               # the experts' ZeRO-0 all-reduce over (dp / ep) x cp = 4 ranks, of fp32 main gradients
               [*MAIN, *MOE, "parallel=dp4", "parallel.cp=2", "parallel.ep=2"]]


def _compose(overrides):
    model = [] if any(o.startswith("model=") for o in overrides) else GPT
    return plan_config([*model, *BASE, *overrides])


def _step_on_this_rank(world, cfg):
    """Build the run as megalm.training.job.run does, take two trainer steps and measure the second:
    (count_comm's calls and bytes, the collectives issued through torch.distributed directly, the model
    state right after the optimizer step)."""
    import sys
    import tempfile
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from megalm.data import build_data, build_data_tokenizer, num_samples_for
    from megalm.distributed.comm import count_comm
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import build_data_parallel, materialize, parallelize
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.memory import measured_model_state_bytes
    from megalm.training.metrics import Throughput
    from megalm.training.optim import LRSchedule, build_optimizer
    from megalm.training.precision import param_dtype
    from megalm.parallel.pipeline import after_weight_passes
    from megalm.training.trainer import Trainer
    t, device = cfg.trainer, torch.device("cpu")
    torch.manual_seed(t.seed)
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = build_mesh(dims, "cpu")
    tokenizer, family = build_data_tokenizer(cfg.data), family_of(cfg.model.arch)
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed, tokenizer=tokenizer,
                      num_samples=num_samples_for(2, t.global_batch_size, 0, 1),
                      samples=family.samples(cfg.model) if family.samples else None)
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel, seed=t.seed)
    materialize(model, device)
    init_weights(model, cfg.model, t.seed)
    pipeline = None
    if dims.pp > 1:
        from megalm.parallel.pipeline import build_pipeline
        pipeline = build_pipeline(model, family_of(model.cfg.arch), layout, mesh["pp"].get_group(), cfg.parallel,
                                  t.global_batch_size // (t.micro_batch_size * dims.dp), device)
    dp = build_data_parallel(model, family_of(model.cfg.arch), mesh, layout, cfg.parallel.zero_stage,
                             cfg.parallel.bucket_size_mb, param_dtype(t))
    if pipeline is not None and dp is not None and dp.main_params:
        after_weight_passes(pipeline, dp.absorb)
    optimizer = build_optimizer(cfg.optimizer, model, dp)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(t, model=model, family=family, optimizer=optimizer, schedule=LRSchedule(cfg.optimizer, 2), data=data,
                          checkpointer=Checkpointer(cfg.checkpoint, Path(tmp)), mesh=mesh, layout=layout,
                          pipeline=pipeline, data_parallel=dp, throughput=Throughput(1.0, 1.0, world), device=device)
        trainer.train_step()
        state = {}
        step = optimizer.step

        def step_and_measure():
            step()
            state.update(measured_model_state_bytes(model, optimizer, dp))
        optimizer.step = step_and_measure
        # Collectives issued with torch.distributed itself, outside megalm's comm module (and outside
        # megalm.parallel.experts._AllToAll, which records the rows a MoE layer sends forward and their gradients
        # backward), and expert tp's counts gathered with comm's all-gather primitive, outside its recording
        # functions; an all-to-all counts the tensor a rank sends, an all-gather its input.
        from megalm.distributed import comm
        direct, saved = {}, {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_to_all_single")}
        saved_gather = comm._all_gather_single

        def tracked(frame):
            while frame is not None:
                code = frame.f_code
                if code.co_filename.endswith(("megalm/distributed/comm.py", "megalm/distributed/async_comm.py")) or (
                        code.co_qualname.startswith("_AllToAll.")
                        and code.co_filename.endswith("megalm/parallel/experts.py")):
                    return True
                frame = frame.f_back
            return False

        def recording(name, fn):
            def call(tensor, *args, **kwargs):
                sent = args[0] if name in ("all_to_all", "all_gather") else tensor
                if not tracked(sys._getframe(1)):
                    entry = direct.setdefault(name, {"calls": 0, "bytes": 0})
                    entry["calls"] += 1
                    entry["bytes"] += sent.numel() * sent.element_size()
                return fn(tensor, *args, **kwargs)
            return call
        try:
            for name, fn in saved.items():
                setattr(dist, name, recording(name.replace("_single", ""), fn))
            comm._all_gather_single = recording("all_gather", saved_gather)
            with count_comm() as stats:
                trainer.train_step()
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            comm._all_gather_single = saved_gather
    recorded = {k: {"calls": stats.calls[k], "bytes": stats.bytes[k]} for k in stats.calls}
    return recorded, direct, {k: state[k] for k in ("weights", "grads", "optimizer")}


def _layouts(rank, world, cfgs):
    """Every layout in turn on this set of ranks (starting the processes costs more than a tiny step)."""
    return [_step_on_this_rank(world, cfg) for cfg in cfgs]


@pytest.fixture(scope="module")
def measured():
    """{layout index: [per rank (recorded, direct, state)]} for TWO_RANKS + EIGHT_RANKS, and "single"."""
    out = {}
    for offset, world, layouts in ((0, 2, TWO_RANKS), (len(TWO_RANKS), 8, EIGHT_RANKS)):
        per_rank = run_ranks(world, _layouts, [_compose(o)[0] for o in layouts], timeout=600.0)
        for i in range(len(layouts)):
            out[offset + i] = [r[i] for r in per_rank]
    out.update({name: [_step_on_this_rank(1, _compose(overrides)[0])] for name, overrides in SINGLE.items()})
    return out


SINGLE = {"single": ["parallel=single"], "bert single": [*BERT, "parallel=single"],
          "main single": [*MAIN, "parallel=single"]}
CASES = [(i, o) for i, o in enumerate(TWO_RANKS + EIGHT_RANKS)] + list(SINGLE.items())


@pytest.mark.parametrize("index,overrides", CASES, ids=[" ".join(o) for _, o in CASES])
def test_step_collectives_and_model_state_equal_a_real_step_on_every_rank(measured, index, overrides):
    from megalm.distributed.mesh import ParallelDims
    from megalm.plan.collectives import by_kind, step_collectives, untracked_collectives
    from megalm.plan.model_state import exact_model_state_bytes
    cfg, world = _compose(overrides)
    dims = ParallelDims.from_config(cfg.parallel, world)
    ranks = measured[index]
    assert len(ranks) == world
    for rank, (recorded, direct, state) in enumerate(ranks):
        # megalm.distributed.mesh's order: (pp, dp, cp, tp), tp fastest
        tp_rank, cp_rank = rank % dims.tp, rank // dims.tp % dims.cp
        dp_rank, pp_rank = rank // (dims.tp * dims.cp) % dims.dp, rank // (dims.tp * dims.cp * dims.dp)
        where = f"rank {rank} (pp {pp_rank}, dp {dp_rank}, cp {cp_rank}, tp {tp_rank})"
        planned = step_collectives(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
        untracked = untracked_collectives(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank)
        assert by_kind(planned, minus=untracked) == recorded, where
        assert untracked == direct, where
        assert exact_model_state_bytes(cfg, world, pp_rank, tp_rank, dp_rank, cp_rank) == state, where


def test_what_the_layouts_exercise():
    """The checks above cover every term: each purpose and kind appears in some planned step."""
    from megalm.plan.collectives import step_collectives
    seen = set()
    for overrides in TWO_RANKS + EIGHT_RANKS:
        planned = step_collectives(*_compose(overrides), 0, 0)
        seen |= {(purpose, kind) for purpose, entries in planned.items() for kind in entries}
    assert seen >= {("tp", "all_reduce"), ("tp", "all_gather"), ("tp", "reduce_scatter"), ("cp", "ring"),
                    ("pp", "send"), ("pp", "recv"), ("dp", "all_reduce"), ("dp", "reduce_scatter"), ("dp", "all_gather"),
                    ("embedding", "all_reduce"), ("other", "all_reduce"), ("other", "broadcast"), ("ep", "all_to_all"),
                    ("edp", "all_reduce"), ("edp", "reduce_scatter"), ("edp", "all_gather"), ("cp", "all_reduce"),
                    ("tp", "all_to_all")}


def test_what_is_not_modelled_is_refused():
    import dataclasses
    from megalm.errors import ConfigError
    from megalm.plan.collectives import step_collectives
    cfg, world = _compose(["parallel=pp2_dp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2",
                           "parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match="zero_stage=3 with pipeline_schedule=zbv"):
        step_collectives(cfg, world, 0, 0)
    cfg, world = _compose([])
    classifier = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_labels=2))
    with pytest.raises(ConfigError, match="fine-tuning head"):
        step_collectives(classifier, world, 0, 0)
    cfg, world = _compose([*BERT])
    for head in ({"num_labels": 2}, {"num_choices": 4}, {"span_head": True}):
        tuned = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **head))
        with pytest.raises(ConfigError, match="BERT's fine-tuning heads"):
            step_collectives(tuned, world, 0, 0)


def test_bad_arguments_are_refused():
    import torch
    from megalm.distributed.comm import record_p2p
    from megalm.plan.model_state import exact_model_state_bytes
    cfg, world = _compose(["parallel=tp2"])
    with pytest.raises(ValueError, match=r"tp_rank=2 is outside the layout's 2"):
        exact_model_state_bytes(cfg, world, 0, 2)
    with pytest.raises(ValueError, match="record_p2p kind 'isend'"):
        record_p2p("isend", torch.zeros(1))
