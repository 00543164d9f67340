"""trainer.mixed_precision=main_params (Megatron's mixed precision): bf16 weights, fp32 main
parameters in the optimizer, gradients accumulated into fp32 main-grad buffers.

- In one process, each weight's main gradient after 4 micro-batches is exactly the fp32 sum of
  the 4 bf16 gradients a bf16 copy of the model computes alone (accumulation in fp32, not bf16),
  and it is the fp32 model's gradient to within bf16 rounding.
- At pipeline schedules (zero bubble's split weight pass included) and dp with ZeRO 1-3 the first
  step's main gradients on every rank equal the single process's to fp32 summation order, and
  the losses of several steps follow the single process of the same mode.
- Checkpoints hold the fp32 main parameters: a resume continues bit for bit, and weights move
  between fp32 and main-params runs without rounding.
"""

import copy
from pathlib import Path

import pytest
import torch

from configs import load
from layouts import BASE, GPT2, LLAMA, STEPS, composed, losses, rank_runs
from distributed import run_ranks

MAIN = ["trainer.precision=bf16", "trainer.mixed_precision=main_params"]


def _micro_batches(cfg, n=4):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1), generator=g) for _ in range(n)]


def _grads_by_name(model, n, step):
    """Run `step(model, x)` on each micro-batch: the fp32 sum of each weight's gradient, micro-batch by
    micro-batch in order (each gradient computed alone, in the model's dtype)."""
    total = {name: torch.zeros(p.shape, dtype=torch.float32) for name, p in model.named_parameters()}
    for x in n:
        model.zero_grad(set_to_none=True)
        step(model, x)
        for name, p in model.named_parameters():
            if p.grad is not None:
                total[name] += p.grad.float()
    return total


@pytest.mark.parametrize("family", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_main_grads_accumulate_each_micro_batch_in_fp32(family):
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import build_data_parallel, materialize, parallelize
    cfg = load(*BASE, *family, *MAIN)
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), None, cfg.parallel)
    materialize(model, "cpu")
    init_weights(model, cfg.model, 0)
    fp32, bf16 = copy.deepcopy(model), copy.deepcopy(model).to(torch.bfloat16)
    batches = _micro_batches(cfg)

    def step(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x[:, :-1], labels=x[:, 1:]) / len(batches)
        loss.backward()

    dp = build_data_parallel(model, family_of(model.cfg.arch), None, layout, 0, 0.02, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert len(dp.buckets) > 3  # several buckets, each a flat buffer the weights view
    for x in batches:
        step(model, x)
    dp.finish()
    names = {p: n for n, p in model.named_parameters()}
    main = {names[s.param]: s.tensor.grad.view(s.param.shape) for s in dp.shards}
    assert set(main) == set(names.values())
    assert all(p.grad is None for p in model.parameters())  # no bf16 gradient is kept
    by_hand = _grads_by_name(bf16, batches, step)
    for name, g in main.items():
        assert g.dtype == torch.float32
        assert torch.equal(g, by_hand[name]), name
    # Against fp32 training's gradient: the whole gradient within a few bf16 unit roundoffs (2^-8).
    reference = _grads_by_name(fp32, batches, lambda m, x: (m(x[:, :-1], labels=x[:, 1:]) / len(batches)).backward())
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    error = ((flat(main) - flat(reference)).norm() / flat(reference).norm()).item()
    assert error < 4 * 2.0 ** -8, error


def _first_main_grads(rank, world, jobs):
    """rank_runs of `jobs`, recording each run's first-step main gradients on this rank: by parameter name,
    (start, stop, the fp32 gradient of elements start:stop of the flat parameter)."""
    from megalm.parallel.data import DataParallel
    original = DataParallel.finish
    records = []

    def finish_and_record(self):
        original(self)
        if len(records) < len(jobs) and not getattr(self, "_recorded", False):
            self._recorded = True
            names = {p: n for n, p in self.model.named_parameters()}
            records.append({names[s.param]: (s.start, s.stop, s.tensor.grad.clone()) for s in self.shards})

    DataParallel.finish = finish_and_record
    try:
        results = rank_runs(rank, world, jobs)
    finally:  # the rank process serves later calls (tests/distributed.py)
        DataParallel.finish = original
    return results, records


# (family, layout, world). The loss tolerance after STEPS steps, against the single process of the same mode:
# without tp every micro-batch's bf16 gradient is computed as in one process and only fp32 sums change order,
# but bf16 weights make that noise visible: an fp32 difference that moves a main parameter across a bf16
# rounding boundary changes that weight by a whole bf16 ulp. Measured: at most 1.7e-5 (dp2 ZeRO-3), and
# autocast at the same layouts 2.1e-6. We allow 1e-4. Tensor parallelism splits the matmuls, summing bf16
# partial products over tp: 3.1e-4 measured (autocast: 1.0e-3), against bf16's unit roundoff 2^-8 = 3.9e-3.
# Expert parallelism hands an expert the tokens of several ranks in one bf16 grouped matmul (autocast leaves
# experts in fp32): its blocking, so its rounding, changes; 1.0e-4 measured (autocast 8e-6). Context
# parallelism computes each weight's bf16 gradient from half the sequence on each rank and sums the halves in fp32,
# where one process rounds the whole sum to bf16 once: 1.4e-3 measured. BERT's pipeline puts the tied embedding's
# two uses (the lookup, the MLM output) on two stages, whose bf16 gradients are summed in fp32, where one process's
# autograd sums them in bf16 first: 2.7e-3 relative on that weight's first gradient, 2.0e-4 on the losses (BERT
# tp2 + sp: 5.9e-4). For all these we allow 2e-3.
LAYOUTS = [
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=1"], 2),
    ("gpt2", ["parallel=dp2", "parallel.zero_stage=3"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=gpipe"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=1f1b"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_zb", "parallel.virtual_pipeline_size=2"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"], 2),
    ("llama", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("llama", ["parallel=tp2", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"], 2),
    ("llama", ["parallel=pp2_dp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2",
               "parallel.zero_stage=2"], 4),
    ("llama", ["parallel=tp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=3"], 4),
    ("moe", ["parallel=dp2", "parallel.ep=2", "parallel.zero_stage=1"], 2),  # experts' main params over ep's groups
    ("llama", ["parallel.cp=2", "parallel.zero_stage=1"], 2),
    ("llama", ["parallel=pp2", "parallel.pipeline_schedule=1f1b", "parallel.zero_stage=3"], 2),
    ("bert", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("bert", ["parallel=pp2", "parallel.pipeline_schedule=1f1b"], 2),
    ("t5", ["parallel=dp2", "parallel.zero_stage=1"], 2),
]
FAMILIES = {"gpt2": [*BASE, *GPT2], "llama": [*BASE, *LLAMA],
            "moe": [*(o for o in BASE if not o.startswith("model=")), "model=moe_tiny", "model.num_layers=4",
                    "model.moe_aux_loss_coeff=0.1", "model.moe_z_loss_coeff=0.01"],
            "bert": [*(o for o in BASE if not o.startswith("model=")), "model=bert_tiny", "model.num_layers=4"],
            "t5": [*(o for o in BASE if not o.startswith("model=")), "model=t5_tiny", "model.num_layers=4"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = {}
    for name, family in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"main_{name}")
        (_,), (grads,) = _first_main_grads(0, 1, [(load(*family, *MAIN), str(d))])
        out[name] = (losses(d), grads)
    return out


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    runs = {}
    for world in sorted({w for *_, w in LAYOUTS}):
        mine = [i for i, (*_, w) in enumerate(LAYOUTS) if w == world]
        dirs = {i: tmp_path_factory.mktemp(f"main_layout{i}") for i in mine}
        jobs = composed([([*FAMILIES[LAYOUTS[i][0]], *MAIN, *LAYOUTS[i][1]], str(dirs[i])) for i in mine])
        per_rank = run_ranks(world, _first_main_grads, jobs, timeout=240.0 * len(jobs))
        for k, i in enumerate(mine):
            runs[i] = (dirs[i], [records[k] for _, records in per_rank])
    return runs


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{f}-{'-'.join(l)}" for f, l, _ in LAYOUTS])
def test_main_params_layout_matches_single_process(single, layout_runs, index):
    family, overrides, _ = LAYOUTS[index]
    run_dir, per_rank = layout_runs[index]
    (ref_train, ref_val), ref_grads = single[family]
    train, val = losses(run_dir)
    assert len(train) == STEPS
    tp = any(o.startswith("parallel=tp") for o in overrides)
    regrouped = tp or "parallel.ep=2" in overrides or "parallel.cp=2" in overrides
    tied_across_stages = family == "bert" and "parallel=pp2" in overrides
    loose = regrouped or tied_across_stages
    assert train == pytest.approx(ref_train, rel=2e-3 if loose else 1e-4)
    assert val == pytest.approx(ref_val, rel=2e-3 if loose else 1e-4)
    assert ref_val[-1] != ref_val[0]
    if regrouped:
        return  # a tp rank's main gradients are of its shards of the weights; ep's are rounded differently
    # Without tp every weight's first-step main gradient equals the single process's, up to the order of fp32
    # sums (micro-batches over dp, the reduction): what accumulating in bf16 would miss by ~2^-9 relative.
    covered = {}
    for grads in per_rank:
        for name, (start, stop, g) in grads.items():
            if tied_across_stages and name == "lm_head.out.weight":  # the last stage's copy of the tied embedding
                name = "embed.tok.weight"
            ref = ref_grads[name][2].view(-1)[start:stop]
            assert g.dtype == torch.float32
            tied = tied_across_stages and name == "embed.tok.weight"  # its two uses' sum: see above
            close = 2.0 ** -7 if tied else 1e-6
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=close * ref.abs().max().item(), msg=name)
            covered[name] = covered.get(name, 0) + stop - start
    # each element on one rank of dp (the tied embedding on both its stages)
    assert covered == {name: ref_grads[name][2].numel() * (2 if tied_across_stages and name == "embed.tok.weight"
                                                            else 1) for name in ref_grads}


def _runs(rank, world, jobs):
    from megalm.train import run
    return [run(cfg, Path(run_dir), world) for cfg, run_dir in jobs]


def test_main_params_checkpoints_keep_fp32_weights(tmp_path):
    """A main-params run resumed from its checkpoint continues bit for bit (main parameters and Adam
    state saved whole); fp32 weights loaded into a main-params run and saved again come back unrounded,
    and back into an fp32 run the same."""
    from megalm.train import run
    from megalm.models import build_model
    from megalm.training.checkpoint import load_model_weights
    common = [*BASE, *LLAMA, "checkpoint.save=true", "optimizer.decay_steps=4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    saved = straight / "checkpoints" / "step_00000002"
    fp32_src, main_copy, fp32_copy = tmp_path / "fp32", tmp_path / "main_copy", tmp_path / "fp32_copy"
    # A step at learning rate 0 (which validation refuses a user: these runs skip it) loads, trains and saves
    # without moving a weight.
    still = ["optimizer.lr=0", "optimizer.min_lr=0", "trainer.max_steps=1", "checkpoint.finetune=true"]
    run_ranks(2, _runs, composed([
        ([*common, *MAIN, "parallel=dp2", "parallel.zero_stage=1", "checkpoint.interval=2"], str(straight)),
        ([*common, *MAIN, "parallel=dp2", "parallel.zero_stage=1", f"checkpoint.load={saved}"], str(resumed)),
        ([*common, "parallel=dp2", "trainer.max_steps=2"], str(fp32_src)),
        ([*common, *MAIN, *still, "parallel=dp2", "parallel.zero_stage=2",
          f"checkpoint.load={fp32_src / 'checkpoints'}"], str(main_copy)),
    ]))
    run(load(*common, *still, f"checkpoint.load={main_copy / 'checkpoints'}"), fp32_copy, 1)
    assert losses(resumed)[0] == losses(straight)[0][2:]  # exactly
    weights = {}
    for d in (fp32_src, main_copy, fp32_copy):
        model = build_model(load(*common).model)
        load_model_weights(d / "checkpoints", model)
        weights[d] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in weights[fp32_src].items():
        assert w.dtype == torch.float32
        assert not torch.equal(w, w.bfloat16().float()), name  # fp32 values that bf16 cannot hold
        assert torch.equal(weights[main_copy][name], w), name
        assert torch.equal(weights[fp32_copy][name], w), name


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norms_run_in_the_weights_low_precision_with_autocast_off(kind, monkeypatch):
    """A norm over a bf16 input with bf16 weights runs in bf16 with autocast off, so that CUDA's autocast (which
    lists layer_norm among its fp32 ops) does not keep an fp32 copy of the input; the kernel is watched for the
    autocast state it runs under, as CPU's autocast leaves norms alone either way. fp32 weights (autocast mode)
    run as autocast decides, and give the same numbers as before (torch's own module)."""
    import torch.nn.functional as F
    from megalm.config import ModelConfig
    from megalm.models.layers import build_norm
    op = "layer_norm" if kind == "layernorm" else "rms_norm"
    seen = []
    real = getattr(F, op)

    def watched(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, op, watched)
    norm = build_norm(ModelConfig(hidden_size=8, normalization=kind))
    reference = torch.nn.LayerNorm(8, eps=norm.eps) if kind == "layernorm" else torch.nn.RMSNorm(8, eps=norm.eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        reference.weight.copy_(norm.weight)
    x = torch.randn(2, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(norm(x), reference(x))  # fp32 weights: unchanged
        assert seen == [True, True]
        norm.to(torch.bfloat16)
        y = norm(x.bfloat16())
    assert seen[2:] == [False] and y.dtype == torch.bfloat16
