"""The parallel core, the trainer and checkpoints reach a model only through its family.

tests/toy_family.py declares a family whose modules, layer container and batch keys share no
name with GPT (`inp` / `stack` / `out` tied to `inp` / `crit`; batches of `ids` and `targets`).
Trained by megalm's Trainer at tp2, pp2 (its tied output split across the stages, 1F1B and
interleaved), dp2 with ZeRO-3 and tp2 x pp2, its losses equal the single process's within
relative 1e-5 after every step, and each layout's checkpoint loads into a single process with
the single process's weights. A generic path that still named GPT's attributes would fail here.
"""

import math
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from configs import load

STEPS = 3
BASE = ["model=gpt_tiny", "data=mock", "logging.curves=false", "model.num_layers=4", "model.vocab_size=256", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
        f"trainer.max_steps={STEPS}", "trainer.grad_clip=1.0", "optimizer=sgd", "optimizer.lr=0.5", "optimizer.warmup_steps=1",
        "trainer.num_threads=1", "cluster.peak_flops=1e12", "parallel.bucket_size_mb=0.005"]
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.pipeline_schedule=1f1b"]),
    "pp2_interleaved": (2, ["parallel.pp=2", "parallel.pipeline_schedule=interleaved_1f1b",
                            "parallel.virtual_pipeline_size=2"]),
    "dp2_zero3": (2, ["parallel.dp=2", "parallel.zero_stage=3"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
}


def _train(world, overrides, out_dir):
    """STEPS trainer steps of the toy family at the layout of `overrides`; the losses, and the
    checkpoint written at the end."""
    import toy_family
    from megalm.data import DataBundle
    from megalm.data.tokenizers.base import NullTokenizer
    from megalm.distributed.mesh import ParallelDims, build_mesh
    from megalm.models import build_model, family_of, init_weights
    from megalm.parallel import build_data_parallel, materialize, parallelize
    from megalm.parallel.pipeline import build_pipeline
    from megalm.config import CheckpointConfig
    from megalm.training.checkpoint import Checkpointer
    from megalm.training.metrics import Throughput
    from megalm.training.optim import LRSchedule, build_optimizer
    from megalm.training.trainer import Trainer
    from megalm.validation import validate
    toy_family.register()
    cfg = load(*BASE, "model.arch=stacked", *overrides)
    validate(cfg, world)
    t = cfg.trainer
    torch.manual_seed(t.seed)
    dims = ParallelDims.from_config(cfg.parallel, world)
    mesh = build_mesh(dims, "cpu") if world > 1 else None  # the single process: no mesh at all
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel, seed=t.seed)
    materialize(model, "cpu")
    init_weights(model, cfg.model, t.seed)
    pipeline = None
    if dims.pp > 1:
        pipeline = build_pipeline(model, family_of(model.cfg.arch), layout, mesh["pp"].get_group(), cfg.parallel,
                                  t.global_batch_size // (t.micro_batch_size * dims.dp), "cpu")
    dp = build_data_parallel(model, family_of(model.cfg.arch), mesh, layout, cfg.parallel.zero_stage, cfg.parallel.bucket_size_mb)
    samples = toy_family.Samples(cfg.model.vocab_size, cfg.model.seq_length)
    data = DataBundle(NullTokenizer(cfg.model.vocab_size), samples, samples)
    checkpointer = Checkpointer(CheckpointConfig(dir=str(out_dir)), Path(out_dir),
                                mesh["tp"].get_group() if mesh is not None else None)
    trainer = Trainer(t, model=model, family=family_of(model.cfg.arch), optimizer=build_optimizer(cfg.optimizer, model, dp),
                      schedule=LRSchedule(cfg.optimizer, t.max_steps), data=data, checkpointer=checkpointer,
                      throughput=Throughput(1.0, 1e12, world), device=torch.device("cpu"), mesh=mesh,
                      layout=layout, pipeline=pipeline, data_parallel=dp)
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    checkpointer.save(STEPS, model, trainer.optimizer, trainer.state(), dp, layout)
    return losses


def _layout_runs(rank, world, jobs):
    return [_train(world, overrides, out) for overrides, out in jobs]


def _single(rank, world, out, checkpoints):
    """The single-process run, then each layout's checkpoint loaded into a fresh single model:
    (losses, max relative difference of the loaded weights from the trained ones, per layout)."""
    import toy_family
    from megalm.models import build_model
    from megalm.training.checkpoint import load_model_weights
    losses = _train(1, [], out)
    toy_family.register()
    cfg = load(*BASE, "model.arch=stacked")
    mine = build_model(cfg.model)
    load_model_weights(Path(out) / f"step_{STEPS:08d}", mine)
    diffs = {}
    for name, path in checkpoints.items():
        other = build_model(cfg.model)
        load_model_weights(Path(path) / f"step_{STEPS:08d}", other)
        diffs[name] = max(((a - b).norm() / a.norm()).item()
                          for a, b in zip(mine.state_dict().values(), other.state_dict().values()))
    return losses, diffs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_layouts")
    out = {name: root / name for name in LAYOUTS}
    results = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        got = run_ranks(world, _layout_runs, [(LAYOUTS[n][1], str(out[n])) for n in names], timeout=600)
        results.update(zip(names, got[0]))
    single, diffs = run_ranks(1, _single, str(root / "single"), {n: str(p) for n, p in out.items()}, timeout=600)[0]
    return single, results, diffs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_toy_family_trains_at_every_layout_as_the_single_process(runs, layout):
    single, results, diffs = runs
    assert all(math.isfinite(x) for x in single) and single[-1] < 0.9 * single[0]  # it trains
    assert results[layout] == pytest.approx(single, rel=1e-5)
    assert diffs[layout] < 1e-5  # its checkpoint holds the single process's weights
