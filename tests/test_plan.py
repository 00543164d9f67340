"""megalm.plan: the parameters and model state of each rank position, from the meta-device model
over a fake process group, against a hand count of GPT-3 175B's layers and against the ranks of
real two-rank runs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import plan_config
from distributed import run_ranks


def _plan(*overrides):
    from megalm.plan import plan
    return plan(*plan_config(overrides))


def test_gpt3_175b_at_tp8_pp16_by_hand():
    """Per rank and layer: the tp-sharded matrices and their biases (12h^2 + 7h)/8, and the replicated
    row-parallel biases and two norms 6h; the first stage adds its vocabulary shard (51200/8 rows) and
    the learned positions (2048 rows, replicated), the last its tied head shard and the final norm."""
    got = _plan("model=gpt_175b", "parallel=tp8_pp16", "trainer.micro_batch_size=1", "trainer.global_batch_size=64")
    h, layers = 12288, 96 // 16
    per_layer = (12 * h * h + 7 * h) // 8 + 6 * h
    params = {(q["stage"], q["tp_rank"]): q["params"] for q in got["positions"]}
    assert set(params) == {(s, t) for s in range(16) for t in (0, 7)}
    assert params[(5, 0)] == params[(5, 7)] == layers * per_layer
    assert params[(0, 0)] == layers * per_layer + (51200 // 8) * h + 2048 * h
    assert params[(15, 7)] == layers * per_layer + (51200 // 8) * h + 2 * h
    middle = [q for q in got["positions"] if q["stage"] == 5][0]
    assert middle["model_state_bytes"] == 16 * middle["params"]  # fp32 weights and grads, Adam's two moments
    assert got["layout"]["world"] == 128


def test_zero_shards_the_model_state():
    small = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    got = _plan(*small, "parallel=dp2", "parallel.zero_stage=1")
    q = got["positions"][0]
    assert q["model_state_bytes"] == pytest.approx(q["params"] * (4 + 4 + 8 / 2))
    got = _plan(*small, "parallel=dp2", "parallel.zero_stage=3")
    assert got["positions"][0]["model_state_bytes"] == pytest.approx(got["positions"][0]["params"] * 16 / 2)


def _held(rank, world, overrides):
    """What this rank of a real run's layout holds: the parameters of its part of the model."""
    import torch
    from configs import load
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, family_of
    from megalm.parallel import materialize, parallelize
    cfg = load(*overrides)
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
    model = build_model(cfg.model, device="meta")
    parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel, seed=0)
    materialize(model, torch.device("cpu"))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layout", [["parallel=tp2"], ["parallel=pp2"], ["parallel=tp2", "parallel.sequence_parallel=true"]])
def test_positions_hold_what_real_ranks_hold(layout):
    overrides = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=2", "trainer.global_batch_size=4", *layout]
    planned = {q["example_rank"]: q["params"] for q in _plan(*overrides)["positions"]}
    held = run_ranks(2, _held, overrides, timeout=300.0)
    assert planned == {rank: n for rank, n in enumerate(held)}


def test_cli_table_and_json(capsys):
    """The command line once (the table); --json and a refused layout through the same main, in this process."""
    from megalm.plan import main
    args = ["model=gpt_tiny", "data=mock", "parallel=pp2", "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    table = subprocess.run([sys.executable, "-m", "megalm.plan", *args], capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "gpt_tiny at tp1 pp2 dp1 (2 ranks, 1f1b x1)" in table.stdout and "model state kB" in table.stdout
    assert "No step time on cluster=local" in table.stdout  # the local profile gives no peak or bandwidth
    main(args + ["--json"])
    out = json.loads(capsys.readouterr().out)
    assert [q["stage"] for q in out["positions"]] == [0, 1]
    with pytest.raises(SystemExit) as bad:
        main(["model=gpt_tiny", "parallel.tp=3"])
    err = capsys.readouterr().err
    assert bad.value.code != 0 and "megalm.plan" in err and "tp" in err


def test_cli_config_dir_takes_any_path(tmp_path, capsys):
    """--config-dir as train's: presets there are found, whatever characters the folder's path holds."""
    from megalm.config import conf_dir
    from megalm.plan import main
    odd = tmp_path / "runs, [a]'s = b" / "model"
    odd.mkdir(parents=True)
    text = (Path(conf_dir()) / "model" / "gpt_tiny.yaml").read_text()
    (odd / "mine.yaml").write_text(text.replace("name: gpt_tiny", "name: mine"))
    main(["--config-dir", str(odd.parent), "model=mine", "data=mock", "--json"])
    assert json.loads(capsys.readouterr().out)["positions"]


@pytest.mark.parametrize("override,expected", [
    ("cluster=cpu", "cluster=cpu is not a cluster preset; the cluster presets are: local"),
    ("trainer.max_stepz=3", "unknown key trainer.max_stepz (did you mean trainer.max_steps?)"),
    ("trainer.max_steps=abc", "trainer.max_steps=abc: Value 'abc'"),
])
def test_cli_composition_mistakes_read_as_train_says_them(capsys, override, expected):
    """A misspelt preset or key is one line naming it and what is allowed, as megalm.train says it: not Hydra's traceback."""
    from megalm.plan import main
    with pytest.raises(SystemExit) as stop:
        main(["model=gpt_tiny", "data=mock", override])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and err.startswith("megalm.plan: invalid config: ") and expected in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# Schedules, step time, search
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12)])
def test_simulated_bubble_is_megatrons_with_equal_stages(schedule, v, pp, m):
    """Equal stages, backward twice forward, no transfer time: every rank idles (p - 1) / (m v + p - 1)
    of the step (arXiv:2104.04473 sec. 2.2), under the order torch's schedule runs."""
    from megalm.plan.schedules import schedule_order, simulate, stage_owner
    order = schedule_order(schedule, pp, v, m)
    owner = stage_owner(schedule, pp, pp * v)
    assert sorted(a for acts in order.values() for a in acts) == sorted(
        (k, s, i) for k in "FB" for s in range(pp * v) for i in range(m))  # each action once
    sim = simulate(order, lambda kind, s: (1.0 if kind == "F" else 2.0) / v, lambda a, b: 0.0,
                   lambda s: owner[s], pp * v)
    assert sim.step_seconds == pytest.approx(3.0 * (m + (pp - 1) / v))
    for r in range(pp):
        assert sim.idle_share(r) == pytest.approx((pp - 1) / (m * v + pp - 1))


def test_zero_bubble_schedules_idle_less_and_transfers_lengthen_the_step():
    from megalm.plan.schedules import bubble_equal_stages, schedule_order, simulate, stage_owner
    pp, m = 4, 8
    split = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    base = bubble_equal_stages(pp, m, 2)
    for schedule in ("interleaved_zb", "zbv"):
        order = schedule_order(schedule, pp, 2, m)
        assert {k for acts in order.values() for k, _, _ in acts} == {"F", "I", "W"}
        owner = stage_owner(schedule, pp, 2 * pp)
        sim = simulate(order, lambda k, s: split[k] / 2, lambda a, b: 0.0, lambda s: owner[s], 2 * pp)
        assert max(sim.idle_share(r) for r in range(pp)) < base / 2
        slow = simulate(order, lambda k, s: split[k] / 2, lambda a, b: 0.25, lambda s: owner[s], 2 * pp)
        assert slow.step_seconds > sim.step_seconds


class _LogitPasses:
    """Bytes read and written over tensors of at least `n` elements, op by op below autograd (a
    TorchDispatchMode): what a loss streams over its logits. Views move nothing; indexed ops (a gather of
    one element a row, nll_loss's, a scatter into a row) touch a few elements a row, not the row;
    nll_loss's backward writes a zero gradient shaped like its input without reading it."""
    INDEXED = {"nll_loss_forward", "gather", "scatter", "scatter_add_", "scatter_add", "nll_loss2d_forward"}
    WRITE_ONLY = {"nll_loss_backward", "nll_loss2d_backward", "zeros_like", "empty_like", "new_zeros"}

    def __init__(self, n):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.record(func, args, kwargs or {}, out)
                return out
        self.n, self.mode, self.bytes = n, Mode(), 0

    def record(self, func, args, kwargs, out):
        import torch
        from torch.utils._pytree import tree_leaves
        name = func.overloadpacket.__name__
        if name in self.INDEXED or any(r.alias_info is not None and not r.alias_info.is_write
                                       for r in func._schema.returns):
            return
        big = lambda xs: [x for x in tree_leaves(xs) if isinstance(x, torch.Tensor) and x.numel() >= self.n]  # noqa: E731
        reads = [] if name in self.WRITE_ONLY else big((args, kwargs))
        self.bytes += sum(x.numel() * x.element_size() for x in reads + big(out))


def _loss_passes(logits, loss_fn):
    """(forward, backward) bytes the loss streams over `logits` (a leaf that requires grad)."""
    import torch
    passes = _LogitPasses(logits.numel())
    with passes.mode:
        loss = loss_fn(logits)
    forward, passes.bytes = passes.bytes, 0
    with passes.mode:
        torch.autograd.grad(loss, logits)
    return forward, passes.bytes


@pytest.mark.parametrize("overrides", [[], ["model.vocab_size=250"], ["trainer.precision=bf16"],
                                       ["model.vocab_size=250", "trainer.precision=bf16"]])
def test_loss_traffic_counts_the_passes_the_loss_makes(overrides):
    """`loss_traffic_bytes` (no tp) equals the bytes megalm's LMLoss reads and writes over the logits, counted
    op by op as they run (padded vocabularies and bf16 logits included)."""
    import torch
    from megalm.models.losses import LMLoss
    from megalm.plan.traffic import loss_traffic_bytes
    cfg = _compose(*TINY, "trainer.global_batch_size=8", *overrides)
    mc = cfg.model
    dtype = torch.float32 if cfg.trainer.precision == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, mc.seq_length, mc.padded_vocab_size, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, mc.vocab_size, (2, mc.seq_length), generator=gen)
    assert _loss_passes(logits, lambda x: LMLoss(mc.vocab_size)(x, labels)) == loss_traffic_bytes(cfg, 1)


BERT_TINY = ["model=bert_tiny", "data=mock", "trainer.micro_batch_size=2"]


def _bert_batch(cfg, n: int):
    """n of BERT's mock samples (padding, masked positions, sentence order) as a batch dict."""
    from megalm.data import build_data_tokenizer
    from megalm.data.samples.bert import MockBertDataset
    from megalm.data.loader import collate
    data = MockBertDataset(build_data_tokenizer(cfg.data), cfg.model.seq_length, 1, "train", n)
    return collate([data[i] for i in range(n)])


@pytest.mark.parametrize("overrides", [[], ["trainer.precision=bf16"]])
def test_bert_loss_traffic_counts_the_mlm_loss_and_its_accuracy(overrides):
    """BERT's loss (its own loss_and_metrics) runs LMLoss over the logits of every position, the loss mask
    keeping the masked ones, then reads them once more for the logged MLM accuracy: `loss_traffic_bytes`
    equals the bytes it reads and writes over the logits, counted op by op."""
    import torch
    from megalm.models import build_model
    from megalm.plan.traffic import loss_traffic_bytes
    cfg = _compose(*BERT_TINY, "trainer.global_batch_size=8", *overrides)
    mc = cfg.model
    model, batch = build_model(mc), _bert_batch(cfg, 2)
    dtype = torch.float32 if cfg.trainer.precision == "fp32" else torch.bfloat16
    logits = torch.randn(2, mc.seq_length, mc.padded_vocab_size, generator=torch.Generator().manual_seed(0))
    order = torch.zeros(2, 2)
    assert _loss_passes(logits.to(dtype).requires_grad_(), lambda x: model.loss_and_metrics((x, order), batch)[0]) \
        == loss_traffic_bytes(cfg, 1)


def _vocab_parallel_passes(rank, world, cases):
    """For each override list of `cases`: (counted, planned) loss traffic on this rank's vocabulary shard, of
    GPT's vocabulary-parallel loss and BERT's loss_and_metrics with the vocabulary-parallel criterion its tp
    plan gives it."""
    return [_vocab_parallel_case(rank, world, overrides) for overrides in cases]


def _vocab_parallel_case(rank, world, overrides):
    import torch
    from megalm.models import build_model
    from megalm.parallel.tensor import vocab_parallel_cross_entropy
    from megalm.parallel.styles import VocabParallelLMLoss
    from megalm.plan.traffic import loss_traffic_bytes
    import torch.distributed as dist
    out = []
    for model in (TINY, BERT_TINY):
        cfg = _compose(*model, "trainer.global_batch_size=8", f"parallel.tp={world}", *overrides)
        mc = cfg.model
        cols = mc.padded_vocab(world) // world
        gen = torch.Generator().manual_seed(rank)
        dtype = torch.float32 if cfg.trainer.precision == "fp32" else torch.bfloat16
        logits = torch.randn(2, mc.seq_length, cols, generator=gen).to(dtype).requires_grad_()
        if mc.arch == "bert":
            bert, batch = build_model(mc), _bert_batch(cfg, 2)
            bert.criterion = VocabParallelLMLoss(dist.group.WORLD, rank * cols, mc.vocab_size)
            got = _loss_passes(logits, lambda x: bert.loss_and_metrics((x, torch.zeros(2, 2)), batch)[0])
        else:
            labels = torch.randint(0, mc.vocab_size, (2, mc.seq_length), generator=torch.Generator().manual_seed(0))
            got = _loss_passes(logits, lambda x: vocab_parallel_cross_entropy(
                x, labels, dist.group.WORLD, vocab_start=rank * cols, vocab_size=mc.vocab_size).mean())
        out.append((mc.arch, got, loss_traffic_bytes(cfg, world)))
    return out


def test_loss_traffic_counts_the_vocab_parallel_passes():
    """At tp 2 the vocabulary-parallel loss's passes over each rank's shard (GPT's loss; BERT's loss and its
    MLM accuracy) equal `loss_traffic_bytes`."""
    cases = ([], ["trainer.precision=bf16"])
    for rank in run_ranks(2, _vocab_parallel_passes, cases):  # one set of ranks for both cases
        for overrides, case in zip(cases, rank):
            for arch, got, expected in case:
                assert got == expected, (arch, overrides)


def test_the_memory_traffic_lengthens_each_stage_by_bytes_over_bandwidth():
    """GPipe at pp 2 with one micro-batch runs F0, F1, B1, B0 back to back: rank 0 idles F1 + B1. With a
    matmul rate and a bandwidth, each action adds its stage's traffic over the bandwidth (`stage_traffic`:
    the layers, the embedding on the first, the heads and the loss's passes on the last), by hand."""
    from megalm.plan.flops import stage_work
    from megalm.plan.schedules import compute_bubble
    from megalm.plan.traffic import loss_traffic_bytes, stage_traffic
    cfg = _compose(*TINY, "trainer.global_batch_size=4", "parallel.pp=2", "parallel.pipeline_schedule=gpipe")
    first, last = stage_work(cfg, 1, False, 1), stage_work(cfg, 1, True, 1)
    t0, t1 = stage_traffic(cfg, 1, True, False, 1, 1), stage_traffic(cfg, 1, False, True, 1, 1)
    assert t1.forward > loss_traffic_bytes(cfg, 1)[0] > 0 and t0.forward > 0
    rate, bandwidth = 1e9, 1e8
    f0, b0 = first.forward / rate + t0.forward / bandwidth, first.backward / rate + t0.input_grad / bandwidth
    f1, b1 = last.forward / rate + t1.forward / bandwidth, last.backward / rate + t1.input_grad / bandwidth
    assert compute_bubble(cfg, 2, 1, rate, bandwidth)[0] == pytest.approx((f1 + b1) / (f0 + b0 + f1 + b1), rel=1e-12)
    flops_only = (last.forward + last.backward) / (first.forward + first.backward + last.forward + last.backward)
    assert compute_bubble(cfg, 2, 1)[0] == pytest.approx(flops_only, rel=1e-12)


def test_boundary_messages_lengthen_the_step_and_take_time_from_both_ends():
    """GPipe at pp 2 with one micro-batch: F0 sends, F1 receives, B1 sends, B0 receives, each message
    taking c from its action and arriving L after it; rank 0 computes F0 + B0 of F0 + F1 + B1 + B0 + 4c + 2L.
    `crossings` counts a stage's messages from its neighbours' owners (ZBV's V turns on one rank)."""
    from megalm.plan.flops import stage_work
    from megalm.plan.schedules import compute_bubble, crossings
    cfg = _compose(*TINY, "trainer.global_batch_size=4", "parallel.pp=2", "parallel.pipeline_schedule=gpipe")
    first, last = stage_work(cfg, 1, False, 1), stage_work(cfg, 1, True, 1)
    rate, L, c = 1e9, 2e-4, 3e-4
    f0, b0, f1, b1 = first.forward / rate, first.backward / rate, last.forward / rate, last.backward / rate
    wall = f0 + f1 + b1 + b0 + 4 * c + 2 * L
    got = compute_bubble(cfg, 2, 1, rate, message_seconds=L, message_cpu_seconds=c)
    assert got[0] == pytest.approx(1 - (f0 + b0) / wall, rel=1e-12)
    assert got[1] == pytest.approx(1 - (f1 + b1) / wall, rel=1e-12)
    assert compute_bubble(cfg, 2, 1, rate)[0] == pytest.approx(1 - (f0 + b0) / (f0 + f1 + b1 + b0), rel=1e-12)
    v_owner = [0, 1, 1, 0]
    assert [crossings("F", s, v_owner) for s in range(4)] == [1, 1, 1, 1]
    assert [crossings(k, 1, [0, 1, 0, 1]) for k in ("F", "B", "I", "W")] == [2, 2, 2, 0]


def test_collective_times_follow_the_ring_factors():
    """Ring collectives over p ranks put 2(p-1)/p (all-reduce) or (p-1)/p (reduce-scatter of the full input,
    all-gather of the full output) of the buffer on each link (nccl-tests' bus bandwidth factors)."""
    from megalm.plan.collective_time import collective_seconds
    full = 8e9
    assert collective_seconds("all_reduce", full, 8, 1e9, 0.0) == pytest.approx(2 * 7 / 8 * 8)
    assert collective_seconds("reduce_scatter", full, 8, 1e9, 0.0) == pytest.approx(7 / 8 * 8)
    assert collective_seconds("all_gather", full / 8, 8, 1e9, 0.0) == pytest.approx(7 / 8 * 8)
    assert collective_seconds("all_reduce", 0, 4, 1e9, 1e-5, calls=3) == pytest.approx(3 * 6 * 1e-5)
    assert collective_seconds("all_reduce", full, 1, 1e9, 1e-5) == 0.0


@pytest.mark.parametrize("layout", [["parallel=pp2"], ["parallel.tp=2", "parallel.pp=2"],
                                    ["parallel.pp=4", "parallel.pipeline_schedule=interleaved_1f1b",
                                     "parallel.virtual_pipeline_size=2", "model.num_layers=8"],
                                    ["parallel.pp=2", "parallel.pipeline_schedule=zbv",
                                     "parallel.virtual_pipeline_size=2", "model.num_layers=4"]])
def test_search_parameter_counts_equal_the_laid_out_model(layout):
    """The search's per-stage parameters, composed from three layouts (embedding alone, head alone, one
    layer's share), equal those of the meta model laid out at the layout itself."""
    from megalm.plan import compose, rank_params, stage_params_estimate
    from megalm.plan.positions import _dims, _rank_of
    cfg, world = compose(["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=1", "trainer.global_batch_size=8",
                          *layout])
    dims = _dims(cfg, world)
    for s in range(dims.pp):
        assert stage_params_estimate(cfg, world, s) == rank_params(cfg, world, _rank_of(s, 0, dims))


TINY = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=2"]


def _traffic_beside_the_loss(cfg, m: int) -> float:
    """Bytes a single-stage step moves outside the matmuls besides the loss's passes (`stage_traffic`, checked
    on its own above): m micro-batches through the layers, the embedding and the heads."""
    from megalm.plan.traffic import loss_traffic_bytes, stage_traffic
    t = stage_traffic(cfg, cfg.model.num_layers, True, True, 1, m)
    return m * (t.forward + t.input_grad + t.weight_grad - sum(loss_traffic_bytes(cfg, 1)))


@pytest.mark.parametrize("optimizer,update_bytes,extra", [("adamw", 28, []), ("sgd", 20, []),
                                                          ("adamw", 34, ["trainer.mixed_precision=main_params"])])
def test_single_device_step_time_by_hand(optimizer, update_bytes, extra):
    """One H100 in bf16: every micro-batch's forward and backward at 70% of 989 TFLOP/s, the loss's passes
    over the logits at 3.35 TB/s, then the optimizer streaming its bytes a parameter at 3.35 TB/s: AdamW
    reads the fp32 weight, gradient and two moments and writes three (28); SGD with momentum reads three
    and writes two (20); under main_params AdamW's fp32 weight is the main parameter, then cast into the bf16
    weight (a 4-byte read and a 2-byte write: 34), and the layers' traffic is counted on bf16 weights. The loss,
    per logit (vocabulary 256, unpadded): forward the cast to fp32 (2 + 4
    bytes) and log_softmax (4 + 4), backward nll_loss's zero gradient (4), log_softmax's backward (4 + 4
    + 4) and the cast back (4 + 2): 36 bytes."""
    from megalm.models import flops_per_token
    got = _plan(*TINY, "trainer.global_batch_size=8", "cluster=slurm_h100", "trainer.precision=bf16",
                f"optimizer={optimizer}", *extra)
    cfg = _compose(*TINY, "trainer.global_batch_size=8", "trainer.precision=bf16", *extra)
    params = got["positions"][0]["params"]
    tokens = 8 * cfg.model.seq_length
    assert cfg.model.padded_vocab_size == cfg.model.vocab_size == 256
    expected = tokens * flops_per_token(cfg.model) / (989e12 * 0.7) + tokens * 256 * 36 / 3.35e12 \
        + _traffic_beside_the_loss(cfg, 4) / 3.35e12 + update_bytes * params / 3.35e12
    assert got["estimate"]["step_seconds"] == pytest.approx(expected, rel=1e-9)
    assert got["estimate"]["mfu"] == pytest.approx(got["model_flops_per_step"] / (expected * 989e12), rel=1e-9)


def _compose(*overrides):
    return plan_config(overrides)[0]


def test_gpus_fill_data_parallel_and_the_table_names_the_estimate():
    args = [sys.executable, "-m", "megalm.plan", *TINY, "parallel=tp2", "trainer.global_batch_size=16",
            "cluster=slurm_h100", "trainer.precision=bf16", "--gpus", "8"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gpt_tiny at tp2 pp1 dp4 (8 ranks)" in out.stdout and "on cluster=slurm_h100: step" in out.stdout
    bad = subprocess.run(args[:-1] + ["0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--gpus=0" in bad.stderr


def test_overrides_may_come_before_between_or_after_the_flags(capsys):
    """`model=... --gpus 2 cluster=...` plans as with every override first: not argparse's "unrecognized arguments"."""
    from megalm.plan import main
    main([*TINY, "trainer.global_batch_size=4", "cluster=slurm_h100", "--gpus", "2", "--json"])
    first = json.loads(capsys.readouterr().out)
    main(["model=gpt_tiny", "--gpus", "2", "data=mock", "trainer.micro_batch_size=2", "--json",
          "trainer.global_batch_size=4", "cluster=slurm_h100"])
    mixed = json.loads(capsys.readouterr().out)
    assert mixed == first and first["cluster"] == "slurm_h100" and first["layout"]["dp"] == 2


def test_search_ranks_fitting_layouts_and_says_why_others_drop():
    from megalm.plan import compose, plan, search
    cfg, _ = compose([*TINY, "trainer.global_batch_size=32", "cluster=slurm_h100", "trainer.precision=bf16",
                      "parallel.dp=-1"])
    got = search(cfg, 8, top=0)
    steps = [r["step_seconds"] for r in got["ranked"]]
    assert steps == sorted(steps) and len(steps) == got["fitting"] > 3
    assert got["considered"] == got["fitting"] + len(got["dropped"])
    assert any("does not split evenly" in why or "num_layers" in why for why in got["dropped"].values())
    best = got["ranked"][0]
    again = plan(*compose([*TINY, "trainer.global_batch_size=32", "cluster=slurm_h100", "trainer.precision=bf16",
                           f"parallel.tp={best['tp']}", f"parallel.pp={best['pp']}", f"parallel.dp={best['dp']}",
                           f"parallel.sequence_parallel={best['sequence_parallel']}",
                           f"parallel.pipeline_schedule={best['schedule'] or '1f1b'}",
                           f"parallel.virtual_pipeline_size={best['virtual_stages']}",
                           f"parallel.zero_stage={best['zero_stage']}", f"parallel.recompute={best['recompute']}",
                           f"trainer.micro_batch_size={best['micro_batch_size']}"], gpus=8))
    # the search counts model state by the per-parameter formula, the plan exactly (padding): a hair apart
    assert again["estimate"]["step_seconds"] == pytest.approx(best["step_seconds"], rel=1e-3)
    small = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, memory_per_device_gb=1e-6))
    none = search(small, 8)
    assert none["fitting"] == 0 and any(why.startswith("needs ") for why in none["dropped"].values())


def test_bert_single_device_step_time_by_hand():
    """BERT on one H100 in bf16, as GPT's by hand above, with BERT's FLOPs (its MLM transform's dense on every
    token) and 46 bytes a logit: its MLM loss over every position streams GPT's 36, and the logged accuracy
    casts the logits to fp32 once more (2 + 4) and reads them for their max (4)."""
    from megalm.models import flops_per_token
    got = _plan(*BERT_TINY, "trainer.global_batch_size=8", "cluster=slurm_h100", "trainer.precision=bf16")
    cfg = _compose(*BERT_TINY, "trainer.global_batch_size=8", "trainer.precision=bf16")
    assert "not_modelled" not in got and cfg.model.padded_vocab_size == cfg.model.vocab_size == 256
    params, tokens = got["positions"][0]["params"], 8 * cfg.model.seq_length
    expected = tokens * flops_per_token(cfg.model) / (989e12 * 0.7) + tokens * 256 * 46 / 3.35e12 \
        + _traffic_beside_the_loss(cfg, 4) / 3.35e12 + 28 * params / 3.35e12
    assert got["estimate"]["step_seconds"] == pytest.approx(expected, rel=1e-9)


def test_bert_stage_boundaries_carry_the_padding_mask_in_the_step_time():
    """GPipe at pp 2 with two micro-batches, the last stage (the heads, the loss's traffic) the slower:
    F(0, 0) F(0, 1) | send | F(1, 0) F(1, 1) B(1, 0) B(1, 1) | send | B(0, 1) ends the step. BERT's forward
    send carries the (b, s) int64 padding mask beside the (b, s, h) fp32 hidden states, its backward the
    hidden states' gradient alone: each crossing one latency plus its bytes over NVLink, by hand."""
    from megalm.plan.flops import stage_work
    from megalm.plan.traffic import stage_traffic
    layout = ("trainer.global_batch_size=4", "parallel.pp=2", "parallel.pipeline_schedule=gpipe",
              "cluster=slurm_h100", "trainer.precision=bf16")
    cfg = _compose(*BERT_TINY, *layout)
    got = _plan(*BERT_TINY, *layout)["estimate"]
    c, m = cfg.cluster, cfg.model
    rate, bw = 989e12 * c.matmul_efficiency, c.intra_node_bandwidth * c.comm_efficiency
    first, last = stage_work(cfg, 1, False, 1), stage_work(cfg, 1, True, 1)
    t0, t1 = stage_traffic(cfg, 1, True, False, 1, 2), stage_traffic(cfg, 1, False, True, 1, 2)
    bw_mem = c.memory_bandwidth
    head_f, head_b = last.forward / rate + t1.forward / bw_mem, last.backward / rate + t1.of("B") / bw_mem
    first_f, first_b = first.forward / rate + t0.forward / bw_mem, first.backward / rate + t0.of("B") / bw_mem
    assert first_f < head_f and first_b < head_b  # the order above
    hidden, mask = 2 * m.seq_length * m.hidden_size * 4, 2 * m.seq_length * 8
    expected = first_f + first_b + 2 * (head_f + head_b) \
        + 2 * c.intra_node_latency + (2 * hidden + mask) / bw
    assert got["pipeline_seconds"] == pytest.approx(expected, rel=1e-12)


def test_bert_gets_activations_collectives_and_step_time():
    """BERT's pretraining heads are modelled: every pipeline rank gets its activation peak and sends, and
    the table its step time."""
    from megalm.plan import format_table
    got = _plan(*BERT_TINY, "trainer.global_batch_size=16", "parallel=tp2_pp2", "parallel.sequence_parallel=true",
                "cluster=slurm_h100", "trainer.precision=bf16")
    assert "not_modelled" not in got and got["estimate"]["step_seconds"] > 0
    for q in got["positions"]:
        assert q["activation_peak_bytes"] > 0 and q["comm_bytes"]["pp"] > 0 and q["comm_bytes"]["tp"] > 0, q
    assert "bert_tiny at tp2 pp2 dp1" in format_table(got) and "on cluster=slurm_h100: step" in format_table(got)


def test_a_head_without_activation_formulas_still_gets_its_parameters():
    """BERT's fine-tuning heads are not modelled: the table says so, and still counts parameters and state."""
    got = _plan("model=bert_tiny", "model.num_labels=2", "data=classification", "data.paths=[train.tsv]",
                "data.task=sst2", "trainer.micro_batch_size=2", "trainer.global_batch_size=4")
    assert "fine-tuning heads" in got["not_modelled"] and got["positions"][0]["params"] > 0


@pytest.mark.parametrize("override,named", [("cluster.matmul_efficiency=1.5", "cluster.matmul_efficiency=1.5"),
                                            ("cluster.inter_node_bandwidth=-1", "cluster.inter_node_bandwidth=-1"),
                                            ("cluster.intra_node_latency=-0.1", "cluster.intra_node_latency=-0.1")])
def test_bad_cluster_figures_are_named(override, named):
    from megalm.errors import ConfigError
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        _compose(*TINY, "trainer.global_batch_size=8", "cluster=slurm_h100", override)


MAIN = ["trainer.precision=bf16", "trainer.mixed_precision=main_params"]


@pytest.mark.parametrize("zero_stage,bytes_per_param", [(0, 18), (1, 2 + 4 + 12 / 4), (3, 18 / 4)])
def test_main_params_are_planned_whole(zero_stage, bytes_per_param):
    """trainer.mixed_precision=main_params: Megatron's bytes a parameter (bf16 weights, fp32 main gradients,
    fp32 main parameters and moments), which the rank's exact model state also gives (measured equal on real
    ranks in tests/test_plan_collectives.py), its activations, collectives and a step time; in fp32 the option
    changes nothing."""
    over = [*TINY, "parallel.dp=4", f"parallel.zero_stage={zero_stage}", "trainer.global_batch_size=8",
            "cluster=slurm_h100"]
    got = _plan(*over, *MAIN)
    assert "not_modelled" not in got and got["estimate"]["step_seconds"] > 0
    assert got["bytes_per_param"] == pytest.approx(bytes_per_param)
    q = got["positions"][0]
    assert q["model_state_bytes"] == pytest.approx(bytes_per_param * q["params"], rel=1e-3)  # ZeRO's padding
    assert q["activation_peak_bytes"] > 0 and q["comm_bytes"]["dp"] > 0
    fp32 = _plan(*over, "trainer.mixed_precision=main_params")
    assert fp32 == _plan(*over)


def test_a_layout_search_under_main_params_ranks_layouts(capsys):
    from megalm.plan.cli import main
    main([*TINY, "--search", "--gpus", "4", "--jobs", "1", "--json", "trainer.global_batch_size=8",
          "cluster=slurm_h100", *MAIN])
    got = json.loads(capsys.readouterr().out)
    assert got["ranked"] and all(r["step_seconds"] > 0 for r in got["ranked"])


@pytest.mark.parametrize("m", [1, 4])
def test_gradient_accumulation_traffic_by_hand(m):
    """The weight-gradient traffic of a single-stage step of m micro-batches, a parameter: autocast adds each
    micro-batch's fp32 gradient after the first into the accumulated one (two 4-byte reads, a 4-byte write:
    12 (m - 1) / m spread over the micro-batches); main_params adds every micro-batch's bf16 gradient into the
    fp32 main gradient (a 2-byte read, a 4-byte read and write: 10) and zeroes the main gradients once a step
    (4 / m)."""
    from megalm.plan.traffic import count_traffic, stage_traffic
    for extra, per_param in (([], 12 * (m - 1) / m), (MAIN, 10 + 4 / m)):
        cfg = _compose(*TINY, "trainer.global_batch_size=8", *extra)
        c = count_traffic(cfg)
        params = cfg.model.num_layers * c.layer_params + c.first_params + c.last_params
        got = stage_traffic(cfg, cfg.model.num_layers, True, True, 1, m).weight_grad
        assert got == pytest.approx(per_param * params, rel=1e-12), extra


def test_traffic_counted_on_fake_tensors_equals_a_real_run():
    """`count_traffic` counts on FakeTensorMode tensors (nothing allocated, so any size): the same layer,
    embedding and heads run on real CPU tensors move the same bytes, op for op; across norms, activations,
    positions, dropout, bf16 autocast, grouped-query attention, BERT (post-norm, its masks and heads) and bf16
    weights (main_params), which move fewer bytes than autocast's casts and fp32 residual stream."""
    from megalm.plan.traffic import count_traffic
    cases = [[*TINY], [*TINY, "model.normalization=layernorm", "model.activation=gelu",
                       "model.position_embedding=learned", "model.dropout=0.1", "model.bias=true"],
             [*TINY, "trainer.precision=bf16"], [*TINY, "model.num_query_groups=2"],
             [*BERT_TINY], [*BERT_TINY, "model.norm_position=post", "trainer.precision=bf16"],
             [*TINY, *MAIN], [*BERT_TINY, *MAIN]]
    for overrides in cases:
        cfg = _compose(*overrides, "trainer.global_batch_size=8")
        fake, real = count_traffic(cfg), count_traffic(cfg, fake=False)
        assert fake == real, overrides
        assert min(fake.layer_forward[0], fake.layer_forward[1], fake.layer_backward[1]) > 0, overrides
    autocast, main = (count_traffic(_compose(*TINY, "trainer.global_batch_size=8", *o)) for o in
                      (["trainer.precision=bf16"], MAIN))
    assert sum(main.layer_forward + main.layer_backward) < sum(autocast.layer_forward + autocast.layer_backward)


def test_traffic_of_a_plain_layer_by_hand():
    """GPT's layer with LayerNorm (no bias), tanh GELU, learned positions, no dropout, fp32, N tokens:
    forward, each norm reads x (N h) and writes y (its weight, mean and 1/std, h or N elements, are left
    out); each residual add reads two N h and writes one: the hidden part 2 x 8 Nh + 2 x 12 Nh. The rest is
    GELU, which reads and writes N x 4h (32 Nh): the matmuls and SDPA are FLOPs', and views move nothing
    (SDPA's CPU kernel lays its output out as (B, T, heads, hd), so merging the heads is a view).
    Before the layers, the embedding reads and writes the N rows it looks up (not its whole table), the
    learned positions' lookup its T rows, and adding them reads N h + T h and writes N h."""
    from megalm.plan.traffic import count_traffic
    cfg = _compose(*TINY, "model.normalization=layernorm", "model.activation=gelu", "model.bias=false",
                   "model.position_embedding=learned", "model.dropout=0.0", "trainer.global_batch_size=8")
    m = cfg.model
    assert m.ffn_size == 4 * m.hidden_size
    N, h = cfg.trainer.micro_batch_size * m.seq_length, m.hidden_size
    hidden, width = count_traffic(cfg).layer_forward
    assert hidden == 16 * N * h + 24 * N * h
    assert width == 32 * N * h
    T = m.seq_length
    assert count_traffic(cfg).first_forward == (8 * N * h, 8 * T * h + 4 * (2 * N * h + T * h))


def test_stage_traffic_shards_recomputes_and_accumulates():
    """tp divides the width part, sequence parallelism the hidden part too; full recomputation adds the
    layers' forward to the input gradient; each micro-batch after the first adds 12 bytes a weight."""
    from megalm.plan.traffic import count_traffic, loss_traffic_bytes, stage_traffic
    base = _compose(*TINY, "trainer.global_batch_size=8")
    c = count_traffic(base)
    (hf, wf), (hb, wb) = c.layer_forward, c.layer_backward
    one = stage_traffic(base, 3, False, False, 1, 1)
    assert (one.forward, one.input_grad, one.weight_grad) == (3 * (hf + wf), 3 * (hb + wb), 0.0)
    tp = stage_traffic(_compose(*TINY, "trainer.global_batch_size=8", "parallel.tp=2"), 3, False, False, 2, 4)
    assert tp.forward == pytest.approx(3 * (hf + wf / 2))
    assert tp.weight_grad == pytest.approx(12 * 3 * c.layer_params / 2 * 3 / 4)
    sp = stage_traffic(_compose(*TINY, "trainer.global_batch_size=8", "parallel.tp=2", "parallel.sequence_parallel=true"),
                       3, False, False, 2, 4)
    assert sp.forward == pytest.approx(3 * (hf + wf) / 2) and sp.input_grad == pytest.approx(3 * (hb + wb) / 2)
    full = stage_traffic(_compose(*TINY, "trainer.global_batch_size=8", "parallel.recompute=full"), 3, False, False, 1, 1)
    assert full.input_grad == pytest.approx(3 * (hb + wb) + 3 * (hf + wf))
    last = stage_traffic(base, 3, False, True, 1, 1)
    loss = loss_traffic_bytes(base, 1)
    assert last.forward == pytest.approx(one.forward + sum(c.last_forward) + loss[0])
    first = stage_traffic(base, 3, True, False, 1, 1)
    assert first.input_grad == pytest.approx(one.input_grad + sum(c.first_backward))


# ---------------------------------------------------------------------------------------------
# Context parallelism
# ---------------------------------------------------------------------------------------------

def test_context_parallel_shards_the_model_state_over_dp_x_cp():
    """ZeRO shards over every rank holding the same weights: dp x cp (megalm.distributed.mesh.replica_mesh)."""
    small = ["model=gpt_tiny", "data=mock", "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    got = _plan(*small, "parallel.cp=2", "parallel.zero_stage=1")
    q = got["positions"][0]
    assert q["model_state_bytes"] == pytest.approx(q["params"] * (4 + 4 + 8 / 2))
    assert got["bytes_per_param"] == 4 + 4 + 8 / 2
    got = _plan(*small, "parallel=dp2", "parallel.cp=2", "parallel.zero_stage=3")
    assert got["positions"][0]["model_state_bytes"] == pytest.approx(got["positions"][0]["params"] * 16 / 4, rel=1e-3)
    assert _plan(*small)["positions"][0]["params"] == q["params"]  # every cp rank holds the whole model


def test_context_parallel_step_time_by_hand():
    """cp2 on one H100 node in bf16: each rank computes half of every micro-batch (FLOPs and the bytes outside
    the matmuls; gradient accumulation is per weight, there is one micro-batch here), and each layer's pass
    adds what its cp - 1 ring sends take beyond the attention core's compute of that pass: one NVLink latency
    plus the (k, v) block (batch 2 x 2 kv heads x 16 tokens x 8 channels x 2 bytes) over the link, forward
    against the core's forward, backward against twice it. The block equals the run's own ring_bytes."""
    from megalm.parallel.context import ring_bytes
    from megalm.plan.flops import stage_work
    from megalm.plan.group_collectives import ring_block_bytes
    from megalm.plan.step_time import ring_exposed_seconds
    from megalm.plan.traffic import stage_traffic
    layout = (*TINY, "trainer.global_batch_size=2", "cluster=slurm_h100", "trainer.precision=bf16")
    cfg, one = _compose(*layout, "parallel.cp=2"), _compose(*layout)
    c, m = cfg.cluster, cfg.model
    assert (m.seq_length, m.num_attention_heads, m.kv_heads, m.head_dim) == (32, 4, 4, 8)
    block = 2 * 2 * 4 * 16 * 8 * 2
    assert ring_block_bytes(cfg, 1) == block and 2 * ring_block_bytes(cfg, 1) == ring_bytes(2, 16, 4, 8, 2, 2)
    rate, bw = 989e12 * c.matmul_efficiency, c.intra_node_bandwidth * c.comm_efficiency
    core = 4 * 32 * 4 * 8 * (2 * 16) / rate  # QK^T and AV of the rank's 32 queries over 32 keys
    send = c.intra_node_latency + block / bw
    assert send > 2 * core  # a tiny layer: the ring shows
    assert ring_exposed_seconds(cfg, 1, rate, bw, c.intra_node_latency) == pytest.approx((send - core, send - 2 * core))
    work, half = stage_work(one, m.num_layers, True, 1), stage_work(cfg, m.num_layers, True, 1)
    assert (half.forward, half.backward) == pytest.approx((work.forward / 2, work.backward / 2))
    traffic, halved = (stage_traffic(c_, m.num_layers, True, True, 1, 1) for c_ in (one, cfg))
    assert (halved.forward, halved.of("B")) == pytest.approx((traffic.forward / 2, traffic.of("B") / 2))
    expected = half.forward / rate + halved.forward / c.memory_bandwidth + m.num_layers * (send - core) \
        + half.backward / rate + halved.of("B") / c.memory_bandwidth + m.num_layers * (send - 2 * core)
    got = _plan(*layout, "parallel.cp=2")["estimate"]
    assert got["pipeline_seconds"] == pytest.approx(expected, rel=1e-12)
    assert got["cp_exposed_seconds"][0] == pytest.approx(m.num_layers * (2 * send - 3 * core))


def test_context_parallel_in_the_table_and_the_search():
    """The table names cp and shows the ring's bytes; the search keeps parallel.cp and fills dp with the rest."""
    from megalm.plan import candidates, compose, format_table
    from megalm.plan.layout_search import _best_option
    got = _plan(*TINY, "trainer.global_batch_size=8", "parallel=tp2", "parallel.cp=2",
                "parallel.sequence_parallel=true")
    table = format_table(got)
    assert "gpt_tiny at tp2 pp1 dp1 cp2 (4 ranks)" in table and " cp kB " in table
    assert all(q["comm_bytes"]["cp"] > 0 for q in got["positions"])
    cfg, _ = compose([*TINY, "trainer.global_batch_size=32", "cluster=slurm_h100", "trainer.precision=bf16",
                      "parallel.cp=2", "parallel.dp=-1"])
    found = list(candidates(cfg, 8))
    assert found and all(tp * pp * dp * 2 == 8 for tp, pp, dp, *_ in found)
    name, best, why = _best_option(cfg, 8, (2, 1, 2, "1f1b", 1, 2))
    assert name == "tp2 pp1 dp2 cp2 mbs2" and best is not None and best["cp"] == 2, why


# ---------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------

MOE = ["model=moe_tiny", "data=mock", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
       "cluster=slurm_h100"]


def test_expert_parallel_ranks_hold_their_experts_and_shard_them_over_dp_by_ep():
    """Under parallel.ep each rank holds E / ep experts of every layer (the router and the rest whole), and ZeRO
    shards the experts over the dp / ep ranks holding them, the rest over dp; the search's estimate of a stage's
    parameters agrees with the laid-out model."""
    from megalm.plan import compose, expert_params_per_layer, stage_params_estimate
    from megalm.plan.model_state import exact_model_state_bytes
    whole = _plan(*MOE, "parallel=dp4")["positions"][0]
    cfg, world = compose([*MOE, "parallel=dp4", "parallel.ep=2", "parallel.zero_stage=1"])
    got = _plan(*MOE, "parallel=dp4", "parallel.ep=2", "parallel.zero_stage=1")
    experts = expert_params_per_layer(cfg) * cfg.model.num_layers
    q = got["positions"][0]
    assert q["params"] == whole["params"] - experts // 2
    dense = q["params"] - experts // 2
    state = exact_model_state_bytes(cfg, world, 0, 0)
    assert state["optimizer"] == 8 * (dense / 4 + experts / 2 / 2)  # Adam's moments of its shards
    assert stage_params_estimate(cfg, world, 0) == q["params"]
    assert got["layout"]["ep"] == 2


def test_moe_collectives_and_step_time_by_hand():
    """dp4 x ep2 on one H100 node: every layer and micro-batch sends its tokens x k rows of h fp32 to the experts'
    ranks and back, forward and backward (and the E int64 counts first), all-to-alls over the ep group that
    the actions wait on; the experts' buckets reduce over the (dp / ep) x cp ranks holding them. Without ep there are
    none, and the step is shorter by those all-to-alls (the FLOPs are the same)."""
    from megalm.plan import compose
    from megalm.plan.collective_time import collective_seconds, link
    from megalm.plan.collectives import step_collectives
    cfg, world = compose([*MOE, "parallel=dp4", "parallel.ep=2"])
    m, b, s, h, k, E, L = 1, 2, 32, 32, 2, 4, 2
    rows = b * s * k * h * 4
    coll = step_collectives(cfg, world, 0, 0)
    assert coll["ep"] == {"all_to_all": {"calls": 5 * m * L, "bytes": 4 * m * L * rows + m * L * E * 8}}
    assert set(coll["edp"]) == {"all_reduce"} and coll["dp"]
    bw, lat = link(cfg.cluster, [0, 1])
    a2a = collective_seconds("all_to_all", 4 * m * L * rows + m * L * E * 8, 2, bw, lat, 5 * m * L)
    got = _plan(*MOE, "parallel=dp4", "parallel.ep=2")["estimate"]
    assert got["ep_seconds"][0] == pytest.approx(a2a)
    dense = _plan(*MOE, "parallel=dp4")["estimate"]
    without = step_collectives(*compose([*MOE, "parallel=dp4"]), 0, 0)
    assert not without["ep"] and not without["edp"]
    assert got["pipeline_seconds"] - dense["pipeline_seconds"] == pytest.approx(a2a, rel=1e-6)


def test_moe_traffic_and_flops_count_k_experts():
    """A mixture's layer: the FLOPs of k experts a token and the router (megalm.models.flops), and its bytes
    outside the matmuls counted on fake tensors as on real ones (the router's counts and the grouped matmul
    sized without values)."""
    from megalm.plan.flops import layer_and_head_flops_per_token
    from megalm.plan.traffic import count_traffic
    cfg = _compose(*MOE)
    layer, _ = layer_and_head_flops_per_token(cfg.model)
    dense, _ = layer_and_head_flops_per_token(dataclasses.replace(cfg.model, num_experts=0))
    h, f = cfg.model.hidden_size, cfg.model.ffn_size
    assert layer - dense == pytest.approx(6 * (h * f * 3 * (2 - 1) + h * 4))
    for overrides in ([], ["trainer.precision=bf16", "model.moe_router_score_function=sigmoid"]):
        c = _compose(*MOE, *overrides)
        assert count_traffic(c) == count_traffic(c, fake=False), overrides


def test_expert_tensor_parallel_collectives_and_step_time_by_hand():
    """tp2 with expert tp on one H100 node: every layer and micro-batch sends the rank's tokens x k rows of h fp32
    to both tp ranks and the partial outputs back, forward and backward, after gathering the E int64 counts over
    tp (directly, untracked); the experts are tp slices, out of the once-a-step sum over tp; the actions wait
    on all of it as on tp's collectives. A rank holds 1/tp of each expert (1/(ep tp) with ep), as the search's
    estimate says too. Under ep with ZeRO-3 the experts' buckets are sharded and gathered over the dp / ep
    ranks holding them, every micro-batch in forward and backward."""
    from megalm.plan import compose, expert_params_per_layer, format_table, stage_params_estimate
    from megalm.plan.collective_time import collective_seconds, link, wire_factor
    from megalm.plan.collectives import step_collectives, untracked_collectives
    cfg, world = compose([*MOE, "parallel=tp2", "parallel.expert_tp=2"])
    m, b, s, h, k, E, L, tp = 4, 2, 32, 32, 2, 4, 2, 2
    rows = b * s // tp * k * h * 4
    coll = step_collectives(cfg, world, 0, 0)
    assert coll["tp"]["all_to_all"] == {"calls": 4 * m * L, "bytes": 4 * m * L * tp * rows}
    assert untracked_collectives(cfg, world, 0, 0)["all_gather"] == {"calls": m * L, "bytes": m * L * E * 8}
    whole = step_collectives(*compose([*MOE, "parallel=tp2"]), 0, 0)
    experts = expert_params_per_layer(cfg) * L
    assert whole["tp"]["all_reduce"]["bytes"] - coll["tp"]["all_reduce"]["bytes"] == experts * 4
    bw, lat = link(cfg.cluster, [0, 1])
    waited = collective_seconds("all_to_all", 4 * m * L * tp * rows, 2, bw, lat, 4 * m * L) \
        + collective_seconds("all_gather", m * L * E * 8, 2, bw, lat, m * L) \
        - wire_factor("all_reduce", 2) * experts * 4 / bw  # the experts left out of the sum over tp
    got = _plan(*MOE, "parallel=tp2", "parallel.expert_tp=2")
    dense = _plan(*MOE, "parallel=tp2")
    assert got["estimate"]["tp_seconds"][0] - dense["estimate"]["tp_seconds"][0] == pytest.approx(waited)
    assert got["estimate"]["pipeline_seconds"] - dense["estimate"]["pipeline_seconds"] == \
        pytest.approx(waited, rel=1e-6)
    assert got["positions"][0]["params"] == dense["positions"][0]["params"] - experts // 2
    assert got["layout"]["expert_tp"] == 2
    both = [*MOE, "parallel=tp2", "parallel.dp=4", "parallel.ep=2", "parallel.expert_tp=2"]
    laid = _plan(*both)
    held = laid["positions"][0]["params"]
    assert held == dense["positions"][0]["params"] - experts * 3 // 4
    assert "tp2 pp1 dp4 ep2 expert_tp2 (8 ranks)" in format_table(laid)
    assert stage_params_estimate(*compose(both), 0) == held
    cfg, world = compose([*MOE, "parallel=dp4", "parallel.ep=2", "parallel.zero_stage=3"])
    m, shard = 1, expert_params_per_layer(cfg) // 2 // 2  # a layer's E / ep experts over dp / ep = 2 ranks
    edp = step_collectives(cfg, world, 0, 0)["edp"]
    assert edp == {"reduce_scatter": {"calls": L, "bytes": L * 2 * shard * 4},
                   "all_gather": {"calls": 2 * m * L, "bytes": 2 * m * L * shard * 4}}


@pytest.mark.parametrize("dp,cap", [(2, 40_000_000), (64, 64_000_000)])
def test_default_buckets_are_sized_by_parameter_count_as_megatron_sizes_them(dp, cap):
    """parallel.bucket_size_mb=null (the default): Megatron-Core's DDP buckets of max(40M, 1M x dp) parameters,
    read off GPT-3 1.3B's meta-device layout at ZeRO-1 (each weight under 17M but the tied embedding, which has
    a bucket of its own): no other bucket over the cap (padding to a multiple of dp aside), and as few as that
    allows (the greedy fill closes a bucket only when the next weight would overflow it, so two buckets in a
    row together hold more than the cap)."""
    from megalm.plan.layout import rank_layout
    cfg, world = plan_config(["model=gpt_1_3b", f"parallel.dp={dp}", "parallel.zero_stage=1",
                              f"trainer.global_batch_size={dp}", "trainer.micro_batch_size=1"])
    assert cfg.parallel.bucket_size_mb is None
    sizes = [size for size, _ in rank_layout(cfg, world, 0, 0).buckets]
    embedding = cfg.model.padded_vocab(1) * cfg.model.hidden_size
    rest = [size for size in sizes if size < embedding]
    assert len(rest) == len(sizes) - 1 and len(rest) > 1
    assert max(rest) <= cap + dp
    assert all(a + b > cap for a, b in zip(rest, rest[1:]))


def test_an_overlapped_parameter_gather_shows_only_beyond_the_first_forward():
    """parallel.overlap_param_gather: ZeRO-1's all-gather after the update is waited on bucket by bucket in the next
    forward, so the step time counts only what the rank's first forward does not cover, and never less than one
    bucket's gather (the first layers need theirs before anything runs); nothing else of the step changes. GPT-3
    1.3B at dp8 on H100s, bf16, micro-batches of 4 sequences (a forward longer than the whole gather), 64 MiB
    buckets (about 80 gathers, so one is a small part of them)."""
    over = ["model=gpt_1_3b", "parallel.dp=8", "parallel.zero_stage=1", "trainer.global_batch_size=64",
            "trainer.micro_batch_size=4", "trainer.precision=bf16", "cluster=slurm_h100", "parallel.bucket_size_mb=64"]
    waited = _plan(*over)["estimate"]
    overlapped = _plan(*over, "parallel.overlap_param_gather=true")["estimate"]
    whole, exposed = waited["after_backward"][0]["dp_gather"], overlapped["after_backward"][0]["dp_gather"]
    assert 0 < exposed < whole / 10  # about one of the buckets' gathers
    assert overlapped["step_seconds"] == pytest.approx(waited["step_seconds"] - (whole - exposed), rel=1e-12)
    assert overlapped["pipeline_seconds"] == waited["pipeline_seconds"]


def test_zero3_gathers_show_one_bucket_a_pass_when_compute_covers_the_rest():
    """ZeRO-3 gathers each unit while the unit before it computes in forward (the one after it in backward), so
    when the rank's compute is longer than all its gathers, what the step waits for is the first unit of each
    pass: one bucket's gather (their mean) for each micro-batch's forward and backward. GPT-3 1.3B at dp8 on
    H100s, bf16, two micro-batches of 4 sequences."""
    from megalm.plan.collective_time import group_seconds, link
    got = _plan("model=gpt_1_3b", "parallel.dp=8", "parallel.zero_stage=3", "trainer.global_batch_size=64",
                "trainer.micro_batch_size=4", "trainer.precision=bf16", "cluster=slurm_h100")
    cfg, _ = plan_config(["cluster=slurm_h100"])
    gathers = {"all_gather": got["positions"][0]["collectives"]["dp"]["all_gather"]}
    whole = group_seconds(gathers, 8, *link(cfg.cluster, range(8)))
    assert got["layout"]["micro_batches"] == 2 and gathers["all_gather"]["calls"] > 100
    exposed = got["estimate"]["after_backward"][0]["dp_gather"]
    assert exposed == pytest.approx(2 * 2 * whole / gathers["all_gather"]["calls"], rel=1e-12)
    assert exposed < got["estimate"]["pipeline_seconds"] / 100


@pytest.mark.parametrize("tp, rails", [(1, 8), (2, 4), (8, 1)])
def test_a_group_across_nodes_crosses_on_each_of_its_devices_network_share(tp, rails):
    """On slurm_h100 (8 devices a node, each with its own 50 GB/s adapter; NVLink 450 GB/s) the dp group of a
    16-device layout spans two nodes with 8 / tp of its ranks on each: its ring crosses between the nodes on that
    many adapters at once, at most NVLink's pace; a group with one rank a node, or spread unevenly, on one."""
    from megalm.plan.collective_time import group_ranks, link
    from megalm.distributed.mesh import ParallelDims
    cfg, world = plan_config(["model=gpt_1_3b", "cluster=slurm_h100", "cluster.nodes=2", f"parallel.tp={tp}",
                              f"parallel.dp={16 // tp}", "trainer.micro_batch_size=1", "trainer.global_batch_size=16"])
    dims = ParallelDims.from_config(cfg.parallel, world)
    ranks = group_ranks(dims, "dp", 0)
    assert len(ranks) == 16 // tp and len({r // 8 for r in ranks}) == 2
    bw, lat = link(cfg.cluster, ranks)
    assert bw == pytest.approx(min(rails * 50e9, 450e9) * cfg.cluster.comm_efficiency)
    assert lat == cfg.cluster.inter_node_latency
    assert link(cfg.cluster, [0, 1, 2, 8])[0] == pytest.approx(50e9 * cfg.cluster.comm_efficiency)
    assert link(cfg.cluster, [0, 1, 2])[0] == pytest.approx(450e9 * cfg.cluster.comm_efficiency)


def test_overlapped_tensor_parallel_collectives_show_one_piece_each_when_the_matmuls_cover_them():
    """parallel.tp_comm_overlap: sequence parallelism's all-gathers and reduce-scatters run beside the linears'
    matmuls in tp pieces, so when the matmuls take longer, the step waits on one piece of them (the first gather,
    the last reduce-scatter of each); the rest of tp's collectives (the sp parameters' and the loss's all-reduces)
    are waited on as before. GPT-3 1.3B at tp8 + sp on one H100 node, bf16."""
    from megalm.plan.collective_time import group_seconds, link
    over = ["model=gpt_175b", "model.num_layers=8", "parallel.tp=8", "parallel.sequence_parallel=true",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=1", "trainer.precision=bf16", "cluster=slurm_h100"]
    waited = _plan(*over)
    overlapped = _plan(*over, "parallel.tp_comm_overlap=true")
    cfg, _ = plan_config(["cluster=slurm_h100"])
    kinds = overlapped["positions"][0]["collectives"]["tp"]
    assert set(kinds) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert kinds["all_gather"]["bytes"] == waited["positions"][0]["collectives"]["tp"]["all_gather"]["bytes"]
    at = link(cfg.cluster, range(8))
    pieces = group_seconds({k: kinds[k] for k in ("all_gather", "reduce_scatter")}, 8, *at)
    rest = group_seconds({"all_reduce": kinds["all_reduce"]}, 8, *at)
    exposed = overlapped["estimate"]["tp_exposed_seconds"][0]
    assert exposed == pytest.approx(rest + pieces / 8, rel=1e-12)
    assert waited["estimate"]["tp_exposed_seconds"][0] == waited["estimate"]["tp_seconds"][0] > 2 * exposed
    assert overlapped["estimate"]["pipeline_seconds"] < waited["estimate"]["pipeline_seconds"]
