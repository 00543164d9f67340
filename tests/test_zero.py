"""Data parallelism with bucketed, overlapped reduction and ZeRO 1/2/3, on gloo ranks.

The loss curves at every zero stage and layout are checked against the single process in
test_parallel_model.py; here: when and what the buckets communicate, the memory each stage
holds against Megatron's formula, and checkpoints moving between zero stages and dp degrees.
"""

import pytest

from distributed import run_ranks
from configs import load
from layouts import BASE, GPT2, LLAMA, losses, run_layout, run_layouts
from megalm.validation import validate


def _build(world, zero_stage, bucket_mb, family=GPT2, param_dtype=None, overlap=False):
    import torch
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import build_data_parallel, materialize, parallelize
    from megalm.training.optim import build_optimizer
    cfg = load(*BASE, *family, f"parallel=dp{world}", f"parallel.zero_stage={zero_stage}")
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel)
    materialize(model, "cpu")
    init_weights(model, cfg.model, 0)
    dp = build_data_parallel(model, family_of(model.cfg.arch), mesh, layout, zero_stage, bucket_mb, param_dtype, overlap)
    opt = build_optimizer(cfg.optimizer, model, dp)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    batches = [torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1), generator=g) for _ in range(2)]
    return cfg, model, dp, opt, batches


def _comm_timeline(rank, world, zero_stage, param_dtype=None):
    """Three steps of two micro-batches; the collectives seen inside each backward and after it."""
    from megalm.distributed.comm import count_comm
    cfg, model, dp, opt, batches = _build(world, zero_stage, bucket_mb=0.02, param_dtype=param_dtype)
    steps = []
    for _ in range(3):
        seen = []
        for x in batches:
            with count_comm() as stats:
                (model(x[:, :-1], labels=x[:, 1:]) / len(batches)).backward()
            seen.append(dict(stats.bytes))
        with count_comm() as fin:
            dp.finish()
        with count_comm() as upd:
            opt.step()
        opt.zero_grad()
        steps.append((seen, dict(fin.bytes), dict(upd.bytes)))
    return steps, [b.size for b in dp.buckets], dp.dp


def _overlapped_gathers(rank, world):
    """ZeRO-1 with overlap_param_gather beside a run without it, from the same weights on the same batches: per
    step, the buckets still gathering when the update returns, the modules that began their forward while a
    bucket holding their weights was still gathering, and whether both models' weights are then equal."""
    import torch
    plain, overlapped = (_build(world, 1, bucket_mb=0.02, overlap=o) for o in (False, True))
    _, model, dp, opt, batches = overlapped
    early = []
    for module in model.modules():  # registered after the DataParallel's own hooks, so these run after them
        held = [p for p in module.parameters(recurse=False) if p in dp.where]
        if held:
            module.register_forward_pre_hook(lambda m, args, held=held: early.extend(
                m for p in held if dp.where[p][0].gather_work is not None))
    steps = []
    for _ in range(2):
        for _, m, d, o, _ in (plain, overlapped):
            for x in batches:
                (m(x[:, :-1], labels=x[:, 1:]) / len(batches)).backward()
            d.finish()
            o.step()
            o.zero_grad()
        pending = sum(b.gather_work is not None for b in dp.buckets)
        early.clear()
        with torch.no_grad():
            model(batches[0][:, :-1])
        steps.append((pending, len(dp.buckets), len(early),
                      all(torch.equal(a, b) for a, b in zip(plain[1].parameters(), model.parameters()))))
    return steps


def _zero3_timeline(rank, world):
    """ZeRO-3 over two steps: collectives per forward and backward, and the weights held meanwhile."""
    from megalm.distributed.comm import count_comm
    cfg, model, dp, opt, batches = _build(world, 3, bucket_mb=0.02)
    held = []  # bytes of weights on this rank in every unit's forward and as each gradient is computed
    for unit in dp.units:
        unit.register_forward_pre_hook(lambda m, a: held.append(dp.weight_bytes()))
    for p in model.parameters():
        p.register_hook(lambda g: held.append(dp.weight_bytes()))
    ready = []  # per backward: each unit (by forward index) as its backward begins, and whether its weights were
    pre_backward = dp._pre_backward  # already gathered or gathering then (a later call for the same unit is skipped)

    def record(unit, grad):
        i = dp.units.index(unit)
        if all(i != j for j, _ in ready[-1]):
            ready[-1].append((i, all(b.gathered for b in dp.unit_buckets[unit])))
        return pre_backward(unit, grad)
    dp._pre_backward = record  # the output hooks look the method up on the instance as they are registered
    steps = []
    for _ in range(2):
        seen = []
        for x in batches:
            with count_comm() as fwd:
                loss = model(x[:, :-1], labels=x[:, 1:]) / len(batches)
            ready.append([])
            with count_comm() as bwd:
                loss.backward()
            seen.append((dict(fwd.bytes), dict(bwd.bytes)))
        with count_comm() as fin:
            dp.finish()
        at_rest = dp.weight_bytes()
        with count_comm() as upd:
            opt.step()
        opt.zero_grad()
        steps.append((seen, dict(fin.bytes), dict(upd.bytes), at_rest))
    total = sum(b.size for b in dp.buckets)
    tied = sum(b.size for b in dp.unit_buckets[model.head])  # the head's weight is the embedding's
    largest = max(sum(b.size for b in dp.unit_buckets[u]) for u in dp.units)
    return steps, total, tied, largest, held, dp.dp, ready, len(dp.units)


def _dp2_measurements(rank, world):
    """Every measurement below on one set of ranks (starting processes costs more than these)."""
    import torch
    return {"comm": {z: _comm_timeline(rank, world, z) for z in (0, 1, 2)},
            "main_comm": {z: _comm_timeline(rank, world, z, torch.bfloat16) for z in (0, 1, 2)},
            "state": {z: _state_bytes(rank, world, z) for z in (0, 1, 2, 3)},
            "main_state": {z: _state_bytes(rank, world, z, torch.bfloat16) for z in (0, 1, 2, 3)},
            "zero3": _zero3_timeline(rank, world), "overlap": _overlapped_gathers(rank, world)}


@pytest.fixture(scope="module")
def dp2():
    return run_ranks(2, _dp2_measurements)


def test_zero3_gathers_each_layer_when_used_and_holds_a_shard_at_rest(dp2):
    """Each micro-batch all-gathers every unit once in forward (the tied embedding twice: for the
    embedding and again for the head) and once in backward; gradients reduce-scatter as in ZeRO-2;
    the update moves nothing. Between steps a rank holds 1/dp of the weights, and while computing
    never more than a few layers beyond that."""
    steps, total, tied, largest, held, dp, _, _ = dp2[0]["zero3"]
    assert tied > 0 and largest < total / 3
    shard_bytes = 4 * total // dp
    for i, (seen, fin, upd, at_rest) in enumerate(steps):
        for j, (fwd, bwd) in enumerate(seen):
            assert fwd == {"all_gather": 4 * (total + tied) // dp}
            last_backward = j == len(seen) - 1 and i > 0  # step 1 reduces after backward (see above)
            assert bwd == ({"all_gather": shard_bytes, "reduce_scatter": 4 * total} if last_backward
                           else {"all_gather": shard_bytes})
        assert fin == ({"reduce_scatter": 4 * total} if i == 0 else {})
        assert upd == {}
        assert at_rest == shard_bytes
    # The unit computing, the one prefetched and the tied embedding (used by the head) at most.
    assert max(held) <= shard_bytes + 4 * (2 * largest + tied)
    assert min(held) > shard_bytes  # something was gathered whenever a unit ran


def test_zero3_backward_gathers_the_next_unit_while_the_current_one_computes(dp2):
    """Backward runs the units last to first; when each begins, its weights were already gathered (or gathering),
    started when the unit after it began, except the first, freed at the end of the forward."""
    for rank in dp2:
        *_, ready, units = rank["zero3"]
        assert len(ready) == 4  # two steps of two micro-batches
        for order in ready:
            assert [i for i, _ in order] == list(reversed(range(units)))
            assert [g for _, g in order] == [False] + [True] * (units - 1)


@pytest.mark.parametrize("main", [False, True], ids=["fp32", "main_params"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_buckets_communicate_only_in_the_last_backward_and_move_the_analytic_volume(dp2, zero_stage, main):
    """main_params: the fp32 main gradients reduce as fp32 gradients do; the all-gather after the update moves
    the bf16 weights, half the bytes."""
    steps, sizes, dp = dp2[0]["main_comm" if main else "comm"][zero_stage]
    assert len(sizes) > 3  # several buckets, so there is something to overlap
    total = 4 * sum(sizes)  # fp32 bytes of every bucket (padded to a multiple of dp)
    assert all(s % dp == 0 for s in sizes)
    dp_kind = "all_reduce" if zero_stage == 0 else "reduce_scatter"
    for i, (seen, fin, upd) in enumerate(steps):
        assert seen[0] == {}, "the first micro-batch's backward must not communicate"
        if i == 0:  # the first step learns how many accumulations a step makes: all after backward
            assert seen[1] == {} and fin == {dp_kind: total}
        else:  # later steps launch every bucket inside the last backward, as its gradients complete
            assert seen[1] == {dp_kind: total} and fin == {}
        # ZeRO: the update ends with each rank's 1/dp of every bucket all-gathered.
        assert upd == ({} if zero_stage == 0 else {"all_gather": total // dp // (2 if main else 1)})
    # Ring cost: all-reduce 2(p-1)/p N; reduce-scatter (p-1)/p N + all-gather (p-1) N/p: the same.
    ring = {"all_reduce": 2 * (dp - 1) / dp, "reduce_scatter": (dp - 1) / dp, "all_gather": dp - 1}
    _, fin, upd = steps[0]
    cost = sum(ring[k] * v * (2 if main and k == "all_gather" else 1) for part in (fin, upd) for k, v in part.items())
    assert cost == pytest.approx(2 * (dp - 1) / dp * total)


def _state_bytes(rank, world, zero_stage, param_dtype=None):
    from megalm.training.memory import measured_model_state_bytes
    cfg, model, dp, opt, batches = _build(world, zero_stage, bucket_mb=0.02, param_dtype=param_dtype)
    for x in batches:
        model(x[:, :-1], labels=x[:, 1:]).backward()
    dp.finish()
    opt.step()
    return measured_model_state_bytes(model, opt, dp), sum(b.size - sum(p.numel() for p in b.params)
                                                             for b in dp.buckets)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_model_state_memory_per_rank_matches_the_formula(dp2, zero_stage):
    """fp32 weights (their own master copy), fp32 gradients, Adam's two moments: 16 bytes a
    parameter unsharded; ZeRO-1 divides the moments by dp, ZeRO-2 the gradients too, ZeRO-3
    the weights as well."""
    from megalm.training.memory import expected_bytes_per_param
    world = 2
    for got, padding in (ranks["state"][zero_stage] for ranks in dp2):
        n = got["params"]
        expected = expected_bytes_per_param(zero_stage=zero_stage, dp=world) * n
        measured = got["weights"] + got["grads"] + got["optimizer"]
        # Buckets pad to a multiple of dp: at most dp - 1 elements each, in every sharded tensor.
        assert abs(measured - expected) <= 4 * 4 * padding + 1e-9
        assert got["optimizer"] == pytest.approx(8 * n / (world if zero_stage else 1), abs=8 * padding)
        assert got["grads"] == pytest.approx(4 * n / (world if zero_stage >= 2 else 1), abs=4 * padding)
        assert got["weights"] == pytest.approx(4 * n / (world if zero_stage == 3 else 1), abs=4 * padding)


def test_overlapped_gathers_are_waited_on_where_the_forward_first_uses_them(dp2):
    """parallel.overlap_param_gather: the update returns with every bucket's all-gather still running; each is
    waited on before any module using its weights runs; the weights are those of the run that waits at once."""
    for rank in dp2:
        for pending, buckets, early, equal in rank["overlap"]:
            assert buckets > 3 and pending == buckets and early == 0 and equal


def test_overlapped_gathers_train_as_waiting_at_once(tmp_path):
    common = [*BASE, *LLAMA, "parallel=dp2", "checkpoint.save=true"]
    runs = {(z, o): tmp_path / f"z{z}_{o}" for z in (1, 2) for o in ("true", "false")}
    run_layouts(2, [([*common, f"parallel.zero_stage={z}", f"parallel.overlap_param_gather={o}"], str(d))
                    for (z, o), d in runs.items()])
    for z in (1, 2):
        assert losses(runs[z, "true"]) == losses(runs[z, "false"])  # exactly: the same sums, waited on later


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_overlap_param_gather_needs_zero_1_or_2(zero_stage):
    with pytest.raises(ValueError, match=f"parallel.zero_stage={zero_stage} has"):
        validate(load(*BASE, *GPT2, "parallel=dp2", f"parallel.zero_stage={zero_stage}",
                      "parallel.overlap_param_gather=true"), 2)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_main_params_model_state_per_rank_is_megatrons(dp2, zero_stage):
    """trainer.mixed_precision=main_params: bf16 weights (2 bytes), fp32 main gradients (4), fp32 main
    parameters and Adam's moments (12): Megatron's 18 bytes a parameter at ZeRO-0 and 6 + 12/dp under
    its distributed optimizer (ZeRO-1); ZeRO-2 shards the main gradients, ZeRO-3 the weights too."""
    world = 2
    for got, padding in (ranks["main_state"][zero_stage] for ranks in dp2):
        n = got["params"]
        assert got["weights"] == pytest.approx(2 * n / (world if zero_stage == 3 else 1), abs=2 * padding)
        assert got["grads"] == pytest.approx(4 * n / (world if zero_stage >= 2 else 1), abs=4 * padding)
        assert got["optimizer"] == pytest.approx(12 * n / (world if zero_stage else 1), abs=12 * padding)
    if zero_stage == 1:
        assert (got["weights"] + got["grads"] + got["optimizer"]) / n == pytest.approx(2 + 4 + 12 / world, rel=1e-3)


def test_checkpoint_moves_between_zero_stages_and_dp_degrees(tmp_path):
    """Saved at dp2 zero-3 after step 2; continued at dp2 zero-1 and zero-3, at dp4 zero-2 and in
    one process, every continuation equals the uninterrupted dp2 zero-3 run."""
    from megalm.train import run
    common = [*BASE, *LLAMA, "checkpoint.save=true", "checkpoint.interval=2", "optimizer.decay_steps=4"]
    straight = tmp_path / "straight"
    saved = straight / "checkpoints" / "step_00000002"
    loads = {"dp2_zero1": ["parallel=dp2", "parallel.zero_stage=1"], "dp2_zero3": ["parallel=dp2", "parallel.zero_stage=3"],
             "dp4_zero2": ["parallel=dp4", "parallel.zero_stage=2"]}
    jobs = {name: ([*common, *layout, f"checkpoint.load={saved}"], str(tmp_path / name)) for name, layout in loads.items()}
    # One set of ranks per world size; the straight run comes first, so its checkpoint exists.
    run_layouts(2, [([*common, "parallel=dp2", "parallel.zero_stage=3"], str(straight)),
                    jobs["dp2_zero1"], jobs["dp2_zero3"]])
    run_layouts(4, [jobs["dp4_zero2"]])
    ref, _ = losses(straight)
    for name in loads:
        assert losses(tmp_path / name)[0] == pytest.approx(ref[2:], rel=1e-5), name
    single = tmp_path / "single"
    run(load(*common, f"checkpoint.load={saved}"), single, 1)
    assert losses(single)[0] == pytest.approx(ref[2:], rel=1e-5)


@pytest.mark.parametrize("override,message", [
    ("parallel.bucket_size_mb=0", "parallel.bucket_size_mb=0"),
    ("parallel.zero_stage=4", "parallel.zero_stage=4 is not one of 0, 1, 2, 3"),
])
def test_bad_data_parallel_settings(override, message):
    cfg = load(*BASE, *GPT2, "parallel=dp2", override)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        validate(cfg, 2)


def test_finetune_takes_the_weights_only(tmp_path):
    """checkpoint.finetune: the saved weights (its evaluation before step 1 equals the source
    run's last one), but step 0, a fresh optimizer and the data from the start, at another layout."""
    import json
    from megalm.train import run
    source = tmp_path / "source"
    run(load(*BASE, *GPT2, "checkpoint.save=true", "trainer.max_steps=2"), source, 1)
    _, source_val = losses(source)
    tuned = tmp_path / "tuned"
    run_layout(2, [*BASE, *GPT2, "parallel=dp2", "parallel.zero_stage=3", "checkpoint.finetune=true",
                   f"checkpoint.load={source / 'checkpoints'}"], str(tuned))
    records = [json.loads(line) for line in (tuned / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["consumed_samples"] == 8  # one global batch: the data started again
    assert records[0]["val_loss"] == pytest.approx(source_val[-1], rel=1e-5)


def test_finetune_needs_a_checkpoint():
    with pytest.raises(ValueError, match="checkpoint.finetune=true takes the weights of checkpoint.load"):
        validate(load(*BASE, *GPT2, "checkpoint.finetune=true"), 1)
