"""GPT's numbers, pinned before the model-family refactor, so that it can be shown not to move them.

tests/data/gpt_golden.json holds the per-step losses, gradient norms and final validation loss of
four fixed GPT runs (single with dropout, tp2 + sequence parallel Llama-style, pp2 interleaved,
dp2 ZeRO-3), recorded by `python tests/test_gpt_golden.py --record` from the code before the
refactor. They are the code's own output on purpose: the claim under test is "unchanged", not
"right" (the layout tests prove right). The comparison is bit for bit with MEGALM_GOLDEN_EXACT=1,
on the kind of machine that recorded them; by default relative 1e-6 on losses and 1e-5 on gradient
norms, because another CPU's matmul kernels may round differently (an AMD EPYC moved the tp2 Llama
run's last gradient norm by 6.1e-6 and every loss by under 1e-7), while a refactor that changes the
math moves these runs by far more.
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import run_ranks  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "data" / "gpt_golden.json"
BASE = ["model=gpt_tiny", "model.num_layers=4", "data=mock", "logging.curves=false", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
        "trainer.max_steps=4", "trainer.eval_steps=1", "trainer.eval_interval=0", "trainer.log_interval=1",
        "trainer.progress_bar=false", "trainer.num_threads=1", "optimizer.warmup_steps=1", "optimizer.lr=1e-2",
        "cluster.peak_flops=1e12", "checkpoint.save=false", "trainer.grad_clip=0.3"]
RUNS = {
    "single": (1, ["model.dropout=0.1", "model.attention_dropout=0.1"]),
    "tp2_sp_llama": (2, ["parallel=tp2", "parallel.sequence_parallel=true", "model.position_embedding=rope",
                         "model.normalization=rmsnorm", "model.activation=swiglu", "model.bias=false",
                         "model.tie_embeddings=false", "model.num_query_groups=2", "model.dropout=0.1"]),
    "pp2_interleaved": (2, ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b",
                            "parallel.virtual_pipeline_size=2"]),
    "dp2_zero3": (2, ["parallel=dp2", "parallel.zero_stage=3"]),
}


def _load(overrides, world):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.validation import validate
    register_configs()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=list(overrides)))
    validate(cfg, world)
    return cfg


def _numbers(run_dir: Path) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in recs if "loss" in r], "grad_norm": [r["grad_norm"] for r in recs if "loss" in r],
            "val_loss": [r["val_loss"] for r in recs if "val_loss" in r]}


def _two_rank_runs(rank, world, out):
    from megalm.train import run
    for name, (size, extra) in RUNS.items():
        if size == 2:
            run(_load([*BASE, *extra], world), Path(out) / name, world)


def measure(out: Path) -> dict:
    from megalm.train import run
    run(_load([*BASE, *RUNS["single"][1]], 1), out / "single", 1)
    run_ranks(2, _two_rank_runs, str(out))
    return {name: _numbers(out / name) for name in RUNS}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return measure(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("name", RUNS)
def test_gpt_runs_are_where_they_were(measured, name):
    golden = json.loads(GOLDEN.read_text())[name]
    got = measured[name]
    assert {k: len(v) for k, v in got.items()} == {k: len(v) for k, v in golden.items()}
    exact = os.environ.get("MEGALM_GOLDEN_EXACT") == "1"
    for key, values in golden.items():
        for step, (want, have) in enumerate(zip(values, got[key]), 1):
            tol = 1e-5 if key == "grad_norm" else 1e-6
            assert math.isfinite(have) and (have == want if exact else
                                            math.isclose(have, want, rel_tol=tol)), (name, key, step, have, want)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/test_gpt_golden.py --record   (rewrites tests/data/gpt_golden.json)")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        numbers = measure(Path(tmp))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(numbers, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
