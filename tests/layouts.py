"""The layout-run harness: a config trained by megalm.train.run on N gloo ranks (tests/distributed.py),
the losses and gradient norms read back from its metrics.jsonl, a rank's parallel model built as
training builds it, and the overrides the layout tests start from (BASE, and the two model families).

Runs of one world size share one set of ranks (run_layouts): starting the processes costs more
than a tiny run.
"""

import json
from pathlib import Path

from configs import load
from distributed import run_ranks
from megalm.distributed.mesh import ParallelDims, build_mesh
from megalm.models import build_model, family_of, init_weights
from megalm.parallel import materialize, parallelize
from megalm.train import run
from megalm.validation import validate

STEPS = 4
BASE = ["model=gpt_tiny", "model.num_layers=4", "data=mock", "logging.curves=false", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
        f"trainer.max_steps={STEPS}", "trainer.eval_steps=1", "trainer.eval_interval=0", "trainer.log_interval=1",
        "trainer.progress_bar=false", "trainer.num_threads=1", "optimizer.warmup_steps=1", "optimizer.lr=1e-2",
        "cluster.peak_flops=1e12", "checkpoint.save=false", "trainer.grad_clip=0.3",
        "parallel.bucket_size_mb=0.02"]  # ~5k-element buckets: a dozen for the dp runs to overlap
# Two model families: GPT-2 style (learned positions, LayerNorm with bias, GELU, tied head) and
# Llama style (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head).
GPT2 = ["model.dropout=0.0"]
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.bias=false", "model.tie_embeddings=false", "model.num_query_groups=2", "model.vocab_size=200"]  # padded to 200 / 208 / 224 at tp 1 / 2 / 4


def losses(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r], [r["val_loss"] for r in recs if "val_loss" in r]


def grad_norms(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in recs if "loss" in r]


def _rank_run(rank, world, cfg, run_dir):
    """One run on this rank of `cfg`: a Config, or a list of overrides to compose here."""
    if isinstance(cfg, (list, tuple)):
        cfg = load(*cfg)
    validate(cfg, world)
    return run(cfg, Path(run_dir), world)


def rank_runs(rank, world, jobs):
    """Several runs, one after another, on one set of ranks: (config, run_dir) each. Starting
    the processes (torch's import) costs more than a tiny run, so layouts of one world size share
    them; every run builds its own mesh, groups, model and data from the config."""
    return [_rank_run(rank, world, cfg, run_dir) for cfg, run_dir in jobs]


def composed(jobs):
    """(overrides, run_dir) jobs with each config composed here once, not again on every rank."""
    return [(load(*overrides), run_dir) for overrides, run_dir in jobs]


def run_layouts(world, jobs, **kwargs):
    """rank_runs of (overrides, run_dir) jobs on `world` ranks, composed here: each rank's results."""
    return run_ranks(world, rank_runs, composed(jobs), **kwargs)


def run_layout(world, overrides, run_dir, **kwargs):
    """One run of these overrides on `world` ranks, composed here: each rank's result."""
    return run_ranks(world, _rank_run, load(*overrides), run_dir, **kwargs)


def parallel_model(cfg, world: int):
    """On a rank: (mesh, this rank's model at cfg.parallel, its layout), initialised as training does."""
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel, world), "cpu")
    model = build_model(cfg.model, "meta")
    layout = parallelize(model, family_of(model.cfg.arch), mesh, cfg.parallel)
    materialize(model, "cpu")
    init_weights(model, cfg.model, 0)
    return mesh, model, layout
