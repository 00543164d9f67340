"""The whole model trained at tp / sp / dp layouts gives the single-process loss curve.

Each layout runs `megalm.train.run` on real gloo ranks (tests/distributed.py) and is compared
with the single-process run of the same config: fp32, relative 1e-5 on the loss after every
one of several optimizer steps, and on the final validation loss.
"""

import json
from pathlib import Path

import pytest
import torch
from configs import load
from distributed import run_ranks
from layouts import BASE, GPT2, LLAMA, STEPS, composed, grad_norms, losses, parallel_model, rank_runs, run_layouts

FUSED = ["model.fused_loss=true", "model.loss_chunk_tokens=24"]  # 64 tokens a micro-batch: chunks of 24, 24, 16
AOT = lambda mode: [f"trainer.compile={mode}", "trainer.compile_backend=aot_eager"]  # noqa: E731


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from megalm.train import run
    out = {}
    for name, family in (("gpt2", GPT2), ("llama", LLAMA)):
        d = tmp_path_factory.mktemp(f"single_{name}")
        run(load(*BASE, *family), d, 1)
        out[name] = (*losses(d), grad_norms(d))
    return out


LAYOUTS = [
    ("gpt2", ["parallel=tp2"], 2),
    ("gpt2", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("gpt2", ["parallel=tp4", "parallel.sequence_parallel=true"], 4),
    ("llama", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("gpt2", ["parallel=tp4"], 4),
    ("gpt2", ["parallel=dp2"], 2),
    ("llama", ["parallel=tp2_dp2", "parallel.sequence_parallel=true"], 4),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=gpipe"], 2),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=1f1b"], 2),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_zb", "parallel.virtual_pipeline_size=2"], 2),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"], 2),
    ("llama", ["parallel=pp2", "parallel.layers_per_stage=[1,3]"], 2),
    ("gpt2", ["parallel=pp4"], 4),
    ("gpt2", ["parallel=tp2_pp2", "parallel.sequence_parallel=true"], 4),
    # parallel.tp_comm_overlap: sp's collectives in pieces beside the matmuls; with the zero-bubble split backward
    # and full recomputation's replayed forward.
    ("gpt2", ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"], 2),
    ("llama", ["parallel=tp2_pp2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true",
               "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2", "parallel.recompute=full"], 4),
    # ZeRO: optimizer state (1), and gradients (2) sharded over dp.
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=1"], 2),
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=2"], 2),
    ("llama", ["parallel=tp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"], 4),
    ("gpt2", ["parallel=tp2_dp2", "parallel.zero_stage=2"], 4),
    ("gpt2", ["parallel=pp2_dp2", "parallel.zero_stage=1"], 4),
    ("llama", ["parallel=pp2_dp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2",
               "parallel.zero_stage=2"], 4),
    # (plain all-reduce at pp2_dp2 and tp2_pp2_dp2 is what the ZeRO-1 rows there run, less the sharding)
    ("gpt2", ["parallel=tp2_pp2_dp2", "parallel.zero_stage=1"], 8),
    # ZeRO-3: parameters sharded too, gathered layer by layer.
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=3"], 2),
    ("llama", ["parallel=tp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=3"], 4),
    ("gpt2", ["parallel=pp2_dp2", "parallel.zero_stage=3"], 4),
    ("llama", ["parallel=pp2_dp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2",
               "parallel.zero_stage=3", "parallel.recompute=full"], 4),
    # The fused head + loss (model.fused_loss) against the unfused single process: the last stage hands the
    # loss hidden states; the tied head split across stages (1f1b) or on one rank (zbv), the zero-bubble
    # split backward, the head gathered by ZeRO-3, vocabulary-parallel with SP inside an interleaved pipeline.
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=1f1b", *FUSED], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_zb", "parallel.virtual_pipeline_size=2",
               *FUSED], 2),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2", *FUSED], 2),
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=3", *FUSED], 2),
    ("llama", ["parallel=tp2_pp2", "parallel.sequence_parallel=true", "parallel.pipeline_schedule=interleaved_1f1b",
               "parallel.virtual_pipeline_size=2", *FUSED], 4),
    # torch.compile (trainer.compile) over the whole rank's forward (model: each pipeline stage) or each block,
    # with aot_eager: dynamo's graphs and AOT autograd's backward run, without code generation (inductor's:
    # test_inductor_compiled_blocks_train_like_eager).
    ("llama", ["parallel=tp2", "parallel.sequence_parallel=true", *AOT("model")], 2),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2", *AOT("model")], 2),
    ("gpt2", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2",
              *AOT("blocks")], 2),
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=2", "parallel.recompute=selective", *AOT("blocks")], 2),
    ("llama", ["parallel=tp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=3", *AOT("blocks")], 4),
    ("gpt2", ["parallel=tp2_pp2", "parallel.recompute=full", *AOT("model")], 4),
    # Unfused attention (model.attention_backend) on each rank's heads, recomputed, against SDPA's single process.
    ("llama", ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.recompute=selective",
               "model.attention_backend=unfused"], 2),
]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout's run directory and per-rank results, computed on first use: one set of
    ranks per world size runs all layouts of that size."""
    runs = {}
    for world in sorted({w for _, _, w in LAYOUTS}):
        mine = [i for i, (_, _, w) in enumerate(LAYOUTS) if w == world]
        dirs = {i: tmp_path_factory.mktemp(f"layout{i}") for i in mine}
        jobs = composed([([*BASE, *(GPT2 if LAYOUTS[i][0] == "gpt2" else LLAMA), *LAYOUTS[i][1]], str(dirs[i]))
                         for i in mine])
        # test_tp_dropout_compiles_whole_..., on the same ranks (2 layers: half the tracing)
        extra = ([load(*BASE, *LLAMA, "model.num_layers=2", "model.dropout=0.2", "model.attention_dropout=0.2",
                       "parallel=tp2", *case) for case in COMPILED_DROPOUT] if world == 2 else ())
        per_rank = run_ranks(world, _rank_runs_then_dropout, jobs, extra, timeout=240.0 * len(jobs))
        for k, i in enumerate(mine):
            runs[i] = (dirs[i], [r[0][k] for r in per_rank])
        if extra:
            runs["compiled_dropout"] = [r[1] for r in per_rank]
    return runs


def _rank_runs_then_dropout(rank, world, jobs, dropout_cases):
    return rank_runs(rank, world, jobs), _compiled_tp_dropout(rank, world, dropout_cases)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{f}-{'-'.join(l)}" for f, l, _ in LAYOUTS])
def test_layout_matches_single_process(single, layout_runs, index):
    family = LAYOUTS[index][0]
    tmp_path, results = layout_runs[index]
    train, val = losses(tmp_path)
    ref_train, ref_val, ref_norms = single[family]
    assert len(train) == STEPS
    assert train == pytest.approx(ref_train, rel=1e-5)
    # The clipped-by norm is the true global norm: shards summed over tp, stages over pp,
    # replicated weights and the tied embedding counted once (grad_clip=0.3 is active here).
    # Step 1 (same weights) to 1e-5; later steps to 1e-4, since Adam turns float-level gradient
    # differences of near-zero entries into visible weight differences that the norm picks up.
    norms = grad_norms(tmp_path)
    assert norms[0] == pytest.approx(ref_norms[0], rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    assert max(ref_norms) > 0.3
    assert val == pytest.approx(ref_val, rel=1e-5)
    assert all(r == pytest.approx(ref_val[-1], rel=1e-5) for r in results)  # every rank returns it
    assert ref_val[-1] != ref_val[0]  # the steps really changed the weights (fixed validation samples)
    if any(o.startswith("trainer.compile=") for o in LAYOUTS[index][1]):
        assert compile_record(tmp_path)["compile_graphs"] > 0  # compiled, not silently eager
        # Whole graphs: tp / sp's collectives are traced (functional collectives), and a recomputed module with
        # no tp dropout to replay is a plain checkpoint, not run eagerly around graph breaks.
        assert compile_record(tmp_path)["compile_graph_breaks"] == 0


def compile_record(run_dir: Path) -> dict:
    """What trainer.compile built in a run, from its first metrics record after step 1."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in recs if "compile_graphs" in r)


def test_inductor_compiled_blocks_train_like_eager(single, tmp_path):
    """trainer.compile=blocks with inductor (generated C++ kernels on CPU) trains as the eager single process
    does, to the layouts' tolerances: inductor fuses and reorders fp32 elementwise work and reductions, which
    moves results by a few float32 ulps an op (measured: losses within 2e-7, gradient norms within 5e-6 after
    4 steps), far inside 1e-5."""
    from megalm.train import run
    run(load(*BASE, *LLAMA, "trainer.compile=blocks"), tmp_path, 1)
    train, val = losses(tmp_path)
    ref_train, ref_val, ref_norms = single["llama"]
    assert train == pytest.approx(ref_train, rel=1e-5) and val == pytest.approx(ref_val, rel=1e-5)
    assert grad_norms(tmp_path) == pytest.approx(ref_norms, rel=1e-4)
    assert compile_record(tmp_path)["compile_graphs"] > 0


def _comm_volume(rank, world, cfg):
    import torch
    from megalm.distributed.comm import count_comm
    from megalm.parallel.grads import clip_grads, finalize_grads
    mesh, model, layout = parallel_model(cfg, world)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(0))
    with count_comm() as fwd:
        loss = model(x[:, :-1], labels=x[:, 1:])
    with count_comm() as bwd:
        loss.backward()
        finalize_grads(model, mesh, layout)
        clip_grads(list(model.parameters()), 1.0, mesh["tp"].get_group())
    return fwd.calls, fwd.bytes, bwd.calls, bwd.bytes


COMPILED_DROPOUT = ([], ["parallel.recompute=full"], ["parallel.sequence_parallel=true", "parallel.recompute=selective"])


def _compiled_tp_dropout(rank, world, cases):
    """Per case (a Config): the graph breaks of a compiled tp model with dropout on, and the gradients of its replicated
    weights (the norms) after two training micro-batches, as this rank has them."""
    import torch._dynamo
    from megalm.parallel.grads import finalize_grads
    from megalm.models import family_of
    from megalm.training.compiling import apply_compile, compile_stats
    out = []
    for cfg in cases:
        mesh, model, layout = parallel_model(cfg, world)
        apply_compile(model, family_of(model.cfg.arch).parts, "model", "aot_eager", "cpu")
        before = compile_stats()
        torch.manual_seed(1)  # the default generator, alike on every rank as training seeds it
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            model(x[:, :-1], labels=x[:, 1:]).backward()
        finalize_grads(model, mesh, layout)
        out.append((compile_stats(before)["compile_graph_breaks"],
                    {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n}))
        torch._dynamo.reset()
    return out


def test_tp_dropout_compiles_whole_and_keeps_replicas_in_step(layout_runs):
    """Dropout drawn per tp rank (attention dropout over a rank's heads; with sp, the residual dropouts on
    sequence shards), recomputed or not, inside a graph compiled with no break: the tp ranks draw their
    masks from the default generator, so it stays in step across them. Without sp the residual dropouts are
    replicated: the same masks on both ranks, hence the same gradients of the replicated norms, which a
    generator out of step would make differ. (The masks themselves: test_tensor_parallel.)"""
    ranks = layout_runs["compiled_dropout"]
    for k, case in enumerate(COMPILED_DROPOUT):
        (breaks0, grads0), (breaks1, grads1) = ranks[0][k], ranks[1][k]
        assert breaks0 == breaks1 == 0, case
        assert grads0 and grads0.keys() == grads1.keys()
        for name in grads0:
            assert grads0[name].abs().sum() > 0
            assert torch.equal(grads0[name], grads1[name]), (case, name)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_communication_matches_the_analytic_volume(sequence_parallel):
    """No collective moves more than Megatron's math needs (counted per rank, fp32 bytes)."""
    tp = 2
    cfg = load(*BASE, *GPT2)
    B, T, h, L = 2, cfg.model.seq_length, cfg.model.hidden_size, cfg.model.num_layers
    act, tok = B * T * h * 4, B * T * 4  # one activation tensor; one fp32 value per token
    ce = [tok, 2 * tok]  # cross-entropy: max, then (sum-exp, target logit) in one call
    layout = load(*BASE, *GPT2, f"parallel=tp{tp}", f"parallel.sequence_parallel={sequence_parallel}")
    (fc, fb, bc, bb), = run_ranks(tp, _comm_volume, layout)[:1]
    if not sequence_parallel:
        # forward: embedding g + (attn proj, fc2) per layer; backward: f of (qkv, fc1) per layer + head's f
        assert fc == {"all_reduce": 1 + 2 * L + 2} and fb == {"all_reduce": act * (1 + 2 * L) + sum(ce)}
        assert bc == {"all_reduce": 2 * L + 1 + 1}            # + the gradient norm's scalar
        assert bb == {"all_reduce": act * (2 * L + 1) + 4}
    else:
        shard = act // tp
        # forward: embedding all-reduce (positions are added after it), then per layer 2 all-gathers
        # before column-parallel and 2 reduce-scatters after row-parallel, the head's all-gather.
        assert fc == {"all_reduce": 1 + 2, "all_gather": 2 * L + 1, "reduce_scatter": 2 * L}
        assert fb == {"all_reduce": act + sum(ce), "all_gather": shard * (2 * L + 1), "reduce_scatter": act * 2 * L}
        # backward mirrors it; the embedding's scatter gathers back; each column-parallel linear (qkv, fc1,
        # the head) gathers the input shard it kept again (Megatron's sequence parallelism); sequence-parallel
        # weights (2 LayerNorms with bias and 2 row-parallel biases per layer, the final norm) are summed.
        sp_params = (L * (2 * 2 * h + 2 * h) + 2 * h) * 4
        regathered = 2 * L + 1
        assert bc == {"all_gather": 2 * L + 1 + regathered, "reduce_scatter": 2 * L + 1, "all_reduce": 2}
        assert bb == {"all_gather": shard * (2 * L + 1 + regathered), "reduce_scatter": act * (2 * L + 1),
                      "all_reduce": sp_params + 4}


# pp (resume, and loads from and to other layouts), tp2_pp2_dp2, dp and zero: test_reshard.py,
# test_checkpoint.py, test_zero.py.
CKPT_LAYOUTS = [("llama", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
                # compiled blocks save and resume like eager ones, and load into an eager single process
                ("gpt2", ["parallel=dp2", "parallel.zero_stage=1", *AOT("blocks")], 2)]


@pytest.mark.parametrize("family,layout,world", CKPT_LAYOUTS, ids=["-".join(l) for _, l, _ in CKPT_LAYOUTS])
def test_checkpoint_resumes_and_loads_at_single(tmp_path, family, layout, world):
    """Save at step 2 of 4; resuming at the same layout and loading at single both continue the curve."""
    common = [*BASE, *(GPT2 if family == "gpt2" else LLAMA), "checkpoint.save=true", "checkpoint.interval=2",
              "optimizer.decay_steps=4"]
    parallel = [*common, *layout]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_layouts(world, [(parallel, str(straight)), ([*parallel, "trainer.max_steps=2"], str(resumed)),
                        (parallel, str(resumed))])  # the last auto-resumes from step 2 in its directory
    ref, _ = losses(straight)
    assert losses(resumed)[0] == pytest.approx(ref, rel=1e-5)

    from megalm.train import run
    single = tmp_path / "single"
    run(load(*common, f"checkpoint.load={resumed / 'checkpoints' / 'step_00000002'}"), single, 1)
    after, _ = losses(single)
    assert after == pytest.approx(ref[2:], rel=1e-5)  # steps 3 and 4 from the full-shape tensors
