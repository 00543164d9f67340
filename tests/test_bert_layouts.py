"""BERT, the second model family, trained at every layout gives the single-process losses.

Each layout runs `megalm.train.run` (model=bert_tiny, mock BERT samples with padding, masking
and sentence-order targets) on real gloo ranks and is compared with the single-process run of
the same config: fp32, relative 1e-5 on the training loss after every one of several optimizer
steps, on its MLM and sentence-order parts, and on the final validation loss. Pre-LN (Megatron's
default) and post-LN (Hugging Face's) both run. The pipeline layouts carry the padding mask
across a stage boundary and split the tied MLM output from the word embedding; the checkpoint
every layout writes loads into one process with the single process's weights.
"""

import json
from pathlib import Path

import pytest

from distributed import run_ranks
from configs import load
from layouts import run_layouts

STEPS = 4
BASE = ["model=bert_tiny", "model.num_layers=4", "data=mock", "logging.curves=false", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.eval_steps=1",
        "trainer.eval_interval=0", "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1",
        "optimizer.warmup_steps=1", "optimizer.lr=1e-2", "cluster.peak_flops=1e12", "trainer.grad_clip=1.0",
        "parallel.bucket_size_mb=0.02"]
NORMS = {"pre": [], "post": ["model.norm_position=post"]}
LAYOUTS = [
    ("pre", ["parallel=tp2"], 2),
    ("pre", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("post", ["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    ("pre", ["parallel=pp2", "parallel.pipeline_schedule=1f1b"], 2),
    ("post", ["parallel=pp2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2"], 2),
    ("post", ["parallel=dp2", "parallel.zero_stage=3"], 2),  # ZeRO-1 / 2's flat buffers know no family: GPT's tests
    ("pre", ["parallel.recompute=full"], 1),
    ("post", ["parallel.recompute=selective"], 1),
    ("pre", ["parallel=tp2_pp2_dp2", "parallel.sequence_parallel=true", "parallel.zero_stage=1"], 8),
]
LOSSES = ("loss", "lm_loss", "sop_loss")


def _records(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {k: [r[k] for r in recs if "loss" in r] for k in (*LOSSES, "mlm_acc", "sop_acc")}
    val = [r for r in recs if "val_loss" in r]
    return train, val


def _reload(rank, world, runs):
    """Each run's final checkpoint loaded into a one-process BERT: {dir: (weights by name, its
    validation loss on the batch the trainer evaluates)}."""
    import torch
    from megalm.data import build_data, collate
    from megalm.models import build_model, family_of
    from megalm.training.checkpoint import load_model_weights
    out = {}
    for d, norm in runs:
        cfg = load(*BASE, *NORMS[norm])
        model = build_model(cfg.model)
        load_model_weights(Path(d) / "checkpoints" / f"step_{STEPS:08d}", model)
        model.eval()
        t = cfg.trainer
        valid = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=t.seed,
                           samples=family_of("bert").samples(cfg.model)).valid
        with torch.no_grad():
            losses = []
            for start in range(0, t.global_batch_size, t.micro_batch_size):
                batch = collate([valid[i] for i in range(start, start + t.micro_batch_size)])
                inputs = (batch[k] for k in family_of("bert").inputs)
                losses.append(model.loss(model(*inputs), batch))
        out[d] = ({k: v.clone() for k, v in model.state_dict().items()}, torch.stack(losses).mean().item())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single runs (pre-LN, post-LN) and every layout's, one set of ranks per world size."""
    jobs = {f"single-{n}": (n, [], 1) for n in NORMS}
    jobs.update({f"{n}-{'-'.join(o)}": (n, o, w) for n, o, w in LAYOUTS})
    dirs = {name: tmp_path_factory.mktemp("bert") for name in jobs}
    results = {}
    for world in sorted({w for _, _, w in jobs.values()}):
        names = [name for name, (_, _, w) in jobs.items() if w == world]
        work = [([*BASE, *NORMS[jobs[n][0]], *jobs[n][1]], str(dirs[n])) for n in names]
        per_rank = run_layouts(world, work, timeout=300.0 * len(work))
        for k, name in enumerate(names):
            results[name] = [r[k] for r in per_rank]
    reloaded = run_ranks(1, _reload, [(str(dirs[n]), jobs[n][0]) for n in jobs], timeout=300)[0]
    return {name: (dirs[name], results[name], reloaded[str(dirs[name])]) for name in jobs}


def test_single_bert_trains(runs):
    for norm in NORMS:
        run_dir, _, _ = runs[f"single-{norm}"]
        train, val = _records(run_dir)
        assert len(train["loss"]) == STEPS
        # The loss is the MLM loss plus the sentence-order loss, each step.
        assert train["loss"] == pytest.approx([a + b for a, b in zip(train["lm_loss"], train["sop_loss"])], rel=1e-6)
        assert all(0.0 <= a <= 1.0 for a in train["mlm_acc"] + train["sop_acc"])
        assert val[-1]["val_loss"] < val[0]["val_loss"]  # the steps lowered the (fixed) validation loss


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{n}-{'-'.join(o)}" for n, o, _ in LAYOUTS])
def test_bert_layout_matches_single_process(runs, index):
    norm, overrides, _ = LAYOUTS[index]
    ref_dir, _, (ref_weights, _) = runs[f"single-{norm}"]
    run_dir, results, (weights, reloaded_loss) = runs[f"{norm}-{'-'.join(overrides)}"]
    train, val = _records(run_dir)
    ref_train, ref_val = _records(ref_dir)
    for key in LOSSES:
        assert train[key] == pytest.approx(ref_train[key], rel=1e-5), key
    assert [r["val_loss"] for r in val] == pytest.approx([r["val_loss"] for r in ref_val], rel=1e-5)
    assert [r["val_lm_loss"] for r in val] == pytest.approx([r["val_lm_loss"] for r in ref_val], rel=1e-5)
    assert all(r == pytest.approx(ref_val[-1]["val_loss"], rel=1e-5) for r in results)  # every rank returns it
    # The layout's checkpoint, loaded into one process, holds the weights it ended with: the
    # loss they give on the validation batch is the layout's own final validation loss.
    assert reloaded_loss == pytest.approx(val[-1]["val_loss"], rel=1e-5)
    # And they are the single process's, to what Adam makes of float-level gradient differences:
    # an entry whose gradient is all rounding noise (the key bias's: softmax ignores a shift of
    # every key) still moves by up to lr a step, so weights agree to 1e-3 of each tensor's norm
    # (a misplaced shard would be off by the order of the tensor itself).
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        ref = ref_weights[name]
        assert (w - ref).norm() <= 1e-3 * ref.norm() + 1e-6, name
