"""T5, the encoder-decoder family, trained at every layout gives the single-process losses.

Each layout runs `megalm.train.run` (model=t5_tiny: 2 encoder and 2 decoder layers, mock
span-corruption samples with padding on both sides) on real gloo ranks and is compared with the
single-process run of the same config: fp32, relative 1e-5 on the training loss after every one of
several optimizer steps and on the validation losses. Learned absolute positions (Megatron's
default) and T5's relative position buckets both run. The pipeline layouts put a stage boundary
between the stacks (pp2), inside the encoder ([1, 3]) and inside both (zbv: a layer a stage), so
the encoder's output, its padding mask, the decoder's embedded input and the relative bias cross
boundaries both ways; the tied head sits on another stage than the embedding. The checkpoint
every layout writes loads into one process with the single process's weights, and the tp2 x pp2
run's checkpoint after step 2 continues at pp2 (zbv) and dp2 (ZeRO-3) as the single process does.
"""

import json
from pathlib import Path

import pytest

from distributed import run_ranks
from configs import load
from layouts import run_layouts

STEPS = 4
BASE = ["model=t5_tiny", "data=mock", "logging.curves=false", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.eval_steps=1",
        "trainer.eval_interval=0", "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1",
        "optimizer.warmup_steps=1", "optimizer.lr=1e-2", "cluster.peak_flops=1e12", "trainer.grad_clip=1.0",
        "parallel.bucket_size_mb=0.02", "checkpoint.interval=2", "optimizer.decay_steps=4"]
POSITIONS = {"learned": [], "relative": ["model.position_embedding=relative"]}
RESHARD_FROM = ["parallel=tp2_pp2", "parallel.sequence_parallel=true"]
RESHARD_TO = {"pp2_zbv": ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"],
              "dp2_zero3": ["parallel=dp2", "parallel.zero_stage=3"]}
LAYOUTS = [
    ("learned", ["parallel.recompute=full"], 1),
    ("relative", ["parallel.recompute=selective"], 1),
    ("learned", ["parallel=tp2"], 2),
    ("relative", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("learned", ["parallel=pp2", "parallel.pipeline_schedule=1f1b"], 2),
    ("relative", ["parallel=pp2", "parallel.layers_per_stage=[1,3]"], 2),
    ("relative", ["parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"], 2),
    ("learned", ["parallel=dp2", "parallel.zero_stage=1"], 2),
    ("relative", ["parallel=dp2", "parallel.zero_stage=3"], 2),
    ("relative", ["parallel=tp2_pp2", "parallel.sequence_parallel=true"], 4),
    ("learned", ["parallel=pp2_dp2", "parallel.zero_stage=2"], 4),
]


def _records(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r], [r["val_loss"] for r in recs if "val_loss" in r]


def _reload(rank, world, runs):
    """Each run's final checkpoint loaded into a one-process T5: {dir: (weights by name, its
    validation loss on the batch the trainer evaluates)}."""
    import torch
    from megalm.data import build_data, collate
    from megalm.models import build_model, family_of
    from megalm.training.checkpoint import load_model_weights
    out = {}
    for d, positions in runs:
        cfg = load(*BASE, *POSITIONS[positions])
        model = build_model(cfg.model)
        load_model_weights(Path(d) / "checkpoints" / f"step_{STEPS:08d}", model)
        model.eval()
        t = cfg.trainer
        family = family_of("t5")
        valid = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed,
                           samples=family.samples(cfg.model)).valid
        with torch.no_grad():
            losses = []
            for start in range(0, t.global_batch_size, t.micro_batch_size):
                batch = collate([valid[i] for i in range(start, start + t.micro_batch_size)])
                losses.append(model.loss(model(*(batch[k] for k in family.inputs)), batch))
        out[d] = ({k: v.clone() for k, v in model.state_dict().items()}, torch.stack(losses).mean().item())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single runs (learned, relative) and every layout's, one set of ranks per world size."""
    jobs = {f"single-{p}": (p, [], 1) for p in POSITIONS}
    jobs.update({f"{p}-{'-'.join(o)}": (p, o, w) for p, o, w in LAYOUTS})
    dirs = {name: tmp_path_factory.mktemp("t5") for name in jobs}
    results = {}
    for world in sorted({w for _, _, w in jobs.values()}):
        names = [name for name, (_, _, w) in jobs.items() if w == world]
        work = [([*BASE, *POSITIONS[jobs[n][0]], *jobs[n][1]], str(dirs[n])) for n in names]
        per_rank = run_layouts(world, work, timeout=300.0 * len(work))
        for k, name in enumerate(names):
            results[name] = [r[k] for r in per_rank]
    reloaded = run_ranks(1, _reload, [(str(dirs[n]), jobs[n][0]) for n in jobs], timeout=300)[0]
    out = {name: (dirs[name], results[name], reloaded[str(dirs[name])]) for name in jobs}
    # Resharding: the tp2 x pp2 (sp) run's step-2 checkpoint continues at other layouts.
    saved = dirs[f"relative-{'-'.join(RESHARD_FROM)}"] / "checkpoints" / "step_00000002"
    resumed = {name: tmp_path_factory.mktemp("t5_resumed") for name in RESHARD_TO}
    run_layouts(2, [([*BASE, *POSITIONS["relative"], *layout, f"checkpoint.load={saved}"], str(resumed[name]))
                    for name, layout in RESHARD_TO.items()], timeout=600)
    out.update({f"resumed-{name}": (d, None, None) for name, d in resumed.items()})
    return out


def test_single_t5_trains(runs):
    for positions in POSITIONS:
        run_dir, _, _ = runs[f"single-{positions}"]
        train, val = _records(run_dir)
        assert len(train) == STEPS
        assert val[-1] < val[0]  # the steps lowered the (fixed) validation loss
    # The two position schemes are different models: their losses differ.
    assert _records(runs["single-learned"][0])[0] != pytest.approx(_records(runs["single-relative"][0])[0], rel=1e-3)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{p}-{'-'.join(o)}" for p, o, _ in LAYOUTS])
def test_t5_layout_matches_single_process(runs, index):
    positions, overrides, _ = LAYOUTS[index]
    ref_dir, _, (ref_weights, _) = runs[f"single-{positions}"]
    run_dir, results, (weights, reloaded_loss) = runs[f"{positions}-{'-'.join(overrides)}"]
    train, val = _records(run_dir)
    ref_train, ref_val = _records(ref_dir)
    assert train == pytest.approx(ref_train, rel=1e-5)
    assert val == pytest.approx(ref_val, rel=1e-5)
    assert all(r == pytest.approx(ref_val[-1], rel=1e-5) for r in results)  # every rank returns it
    # The layout's checkpoint, loaded into one process, holds the weights it ended with.
    assert reloaded_loss == pytest.approx(val[-1], rel=1e-5)
    # And they are the single process's (to what Adam makes of float-level gradient differences,
    # as in the BERT layout test).
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        ref = ref_weights[name]
        assert (w - ref).norm() <= 1e-3 * ref.norm() + 1e-6, name


@pytest.mark.parametrize("name", list(RESHARD_TO))
def test_t5_checkpoint_continues_at_another_layout(runs, name):
    """The tp2 x pp2 run's checkpoint after step 2 (each rank a quarter of the model: a tp shard of one
    stack's stage) continues at another layout with the single process's steps 3 and 4."""
    train, _ = _records(runs[f"resumed-{name}"][0])
    ref_train, _ = _records(runs["single-relative"][0])
    assert len(train) == 2 and train == pytest.approx(ref_train[2:], rel=1e-5)
