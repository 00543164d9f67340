"""A checkpoint written at one layout continues training at any other (resharding).

One save, at tp2_pp2_dp2 with ZeRO-1 after step 2 of 4, is loaded at single, tp4, pp4, dp4
with ZeRO-2, dp2 with ZeRO-3 and pp2 with two virtual stages per rank; each continuation's steps 3-4 must equal an uninterrupted
single-process run (fp32, relative 1e-5). GPT-2 style ties the embedding and head, which under
pp are two copies on two stages: the hard case for a checkpoint that must look the same at
every layout. The data position travels as consumed samples, so every layout starts step 3 on
sample 16. Runs of one world size share one set of ranks (layouts.run_layouts).
"""

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from megalm.train import run
from configs import load
from layouts import BASE, GPT2, losses, run_layout, run_layouts

# 250 tokens: the embedding is padded to 256 rows at every tp here, and the checkpoint holds the 250 real ones.
COMMON = [*BASE, *GPT2, "model.vocab_size=250", "checkpoint.save=true", "checkpoint.interval=2",
          "optimizer.decay_steps=4"]
SAVE_AT = ["parallel=tp2_pp2_dp2", "parallel.zero_stage=1"]
STEP2 = Path("checkpoints") / "step_00000002"
LOADS = [("tp4", ["parallel=tp4"]), ("pp4", ["parallel=pp4"]),
         ("dp4_zero2", ["parallel=dp4", "parallel.zero_stage=2"])]
DROPOUT_TP2 = [*COMMON, "model.dropout=0.1", "parallel=tp2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted single-process run (saving at step 2 too), the tp2_pp2_dp2 run stopped
    after its step-2 save (resuming must not need steps the saving run never took), and every
    continuation from those checkpoints."""
    d = {name: tmp_path_factory.mktemp(name) for name in
         ("single", "saved", *[n for n, _ in LOADS], "at_single", "dp2_zero3", "pp2_vpp2", "pp2_from_single",
          "dropout_straight", "dropout_resumed")}
    run(load(*COMMON), d["single"], 1)
    run_layout(8, [*COMMON, *SAVE_AT, "trainer.max_steps=2"], str(d["saved"]))
    step2, single_step2 = d["saved"] / STEP2, d["single"] / STEP2
    run(load(*COMMON, f"checkpoint.load={step2}"), d["at_single"], 1)
    run_layouts(4, [([*COMMON, *layout, f"checkpoint.load={step2}"], str(d[name]))
                    for name, layout in LOADS])
    run_layouts(2, [
        ([*COMMON, "parallel=dp2", "parallel.zero_stage=3", f"checkpoint.load={step2}"], str(d["dp2_zero3"])),
        ([*COMMON, "parallel=pp2", "parallel.virtual_pipeline_size=2",
          "parallel.pipeline_schedule=interleaved_1f1b", f"checkpoint.load={step2}"], str(d["pp2_vpp2"])),
        ([*COMMON, "parallel=pp2", f"checkpoint.load={single_step2}"], str(d["pp2_from_single"])),
        (DROPOUT_TP2, str(d["dropout_straight"])),  # jobs run in order: its checkpoint exists for the next
        ([*DROPOUT_TP2, f"checkpoint.load={d['dropout_straight'] / STEP2}"], str(d["dropout_resumed"])),
    ])
    return d


def test_the_saving_run_matches_the_single_process_run(runs):
    assert losses(runs["saved"])[0] == pytest.approx(losses(runs["single"])[0][:2], rel=1e-5)


@pytest.mark.parametrize("name", ["at_single", *[n for n, _ in LOADS], "dp2_zero3", "pp2_vpp2"])
def test_checkpoint_continues_at_another_layout(runs, name):
    assert losses(runs[name])[0] == pytest.approx(losses(runs["single"])[0][2:], rel=1e-5)


def test_single_checkpoint_continues_under_pipeline(runs):
    """A single-process checkpoint of a tied model holds one optimizer state for the shared
    matrix, under the embedding's name; the last stage's head copy must take that state."""
    assert losses(runs["pp2_from_single"])[0] == pytest.approx(losses(runs["single"])[0][2:], rel=1e-5)


def test_resume_with_dropout_replays_the_same_masks(runs):
    """Inside tp regions dropout draws from each tp rank's own stream (Layout.tp_rng): a resume at
    the same layout restores it with the default generator, so steps 3-4 repeat bit for bit."""
    assert losses(runs["dropout_resumed"])[0] == losses(runs["dropout_straight"])[0][2:]


def _metadata(step_dir):
    return dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata


def _stored(step_dir):
    return {k: tuple(getattr(v, "size", ())) for k, v in _metadata(step_dir).items()
            if not k.startswith(("rng.", "rng_ranks."))}


def test_every_layout_writes_the_same_keys_and_shapes(runs):
    """Full shapes, real vocabulary rows, and for the tied matrix the weight under both names
    but one optimizer state, under the embedding's: what a single process writes."""
    step2, single_step2 = runs["saved"] / STEP2, runs["single"] / STEP2
    keys = _stored(step2)
    assert keys == _stored(single_step2)
    vocab = load(*COMMON).model.vocab_size
    assert keys["model.head.weight"][0] == keys["optim.state.embed.tok.weight.exp_avg"][0] == vocab
    assert not any(k.startswith(("optim.state.head.", "optim.param_groups.head.")) for k in keys)
    # Each of the 8 ranks keeps its own random streams, tagged with the part of the model it ran.
    assert {k.split(".")[1] for k in _metadata(step2) if k.startswith("rng_ranks.")} == {str(r) for r in range(8)}
