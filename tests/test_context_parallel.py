"""Context parallelism (parallel.cp): each sequence split over cp ranks, attention around a ring.

Each layout runs `megalm.train.run` on real gloo ranks and is compared with the single process of
the same config (fp32, relative 1e-5 on the loss after every one of several optimizer steps and on
the validation losses), at cp alone, with tp + sp, with pp (1F1B and the zero-bubble ZBV, whose
split backward runs the ring's gradient exchange in its input half) and dp and ZeRO, and with full
recomputation (which replays the ring in the backward). The ring's bytes are counted against
their analytic volume, and a checkpoint written at cp2 with ZeRO continues the curve in one process.
"""

import pytest

from distributed import run_ranks
from megalm.errors import ConfigError
from configs import load
from layouts import BASE as PLAIN, GPT2, LLAMA, grad_norms, losses, parallel_model, run_layouts

# The loss left off at end-of-document inputs: the chunks of a micro-batch hold unequal shares of
# the tokens learned, which the ranks' loss weights must account for.
BASE = [*PLAIN, "data.eod_mask_loss=true"]

LAYOUTS = [
    ("gpt2", ["parallel.cp=2"], 2),
    ("llama", ["parallel.cp=2", "parallel.recompute=full"], 2),
    ("llama", ["parallel.cp=4", "parallel.zero_stage=3"], 4),
    ("llama", ["parallel=tp2", "parallel.cp=2", "parallel.sequence_parallel=true"], 4),
    ("gpt2", ["parallel=pp2_dp2", "parallel.cp=2", "parallel.zero_stage=1"], 8),
    ("llama", ["parallel=pp2", "parallel.cp=2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"],
     4),
]
FAMILIES = {"gpt2": GPT2, "llama": LLAMA}
CKPT = ["checkpoint.save=true", "checkpoint.interval=2", "optimizer.decay_steps=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single runs and every layout's, one set of ranks per world size; at world 2 also a run saved
    at step 2 of 4 at cp2 with ZeRO-1 (its optimizer state sharded over the 2 cp ranks)."""
    from megalm.train import run
    single = {}
    for name, family in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"single_{name}")
        run(load(*BASE, *family, *CKPT), d, 1)
        single[name] = d
    out = {}
    for world in sorted({w for _, _, w in LAYOUTS}):
        mine = [i for i, (_, _, w) in enumerate(LAYOUTS) if w == world]
        dirs = {i: tmp_path_factory.mktemp(f"cp{i}") for i in mine}
        jobs = [([*BASE, *FAMILIES[LAYOUTS[i][0]], *LAYOUTS[i][1]], str(dirs[i])) for i in mine]
        if world == 2:
            saved = tmp_path_factory.mktemp("cp_saved")
            jobs.append(([*BASE, *LLAMA, *CKPT, "parallel.cp=2", "parallel.zero_stage=1", "trainer.max_steps=2"],
                         str(saved)))
            out["saved"] = saved
        per_rank = run_layouts(world, jobs, timeout=300.0 * len(jobs))
        for k, i in enumerate(mine):
            out[i] = (dirs[i], [r[k] for r in per_rank])
    return single, out


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{f}-{'-'.join(o)}" for f, o, _ in LAYOUTS])
def test_context_parallel_layout_matches_single_process(runs, index):
    single, layouts = runs
    family = LAYOUTS[index][0]
    run_dir, results = layouts[index]
    train, val = losses(run_dir)
    ref_train, ref_val = losses(single[family])
    assert len(train) == len(ref_train) > 1
    assert train == pytest.approx(ref_train, rel=1e-5)
    assert val == pytest.approx(ref_val, rel=1e-5)
    assert all(r == pytest.approx(ref_val[-1], rel=1e-5) for r in results)  # every rank returns it
    assert grad_norms(run_dir)[0] == pytest.approx(grad_norms(single[family])[0], rel=1e-5)
    assert ref_val[-1] != ref_val[0]


def test_a_cp_checkpoint_continues_the_curve_in_one_process(runs, tmp_path):
    """Saved at step 2 at cp2 (ZeRO-1: Adam's state in two shards over the cp ranks), loaded into one
    process for steps 3 and 4: the single process's curve."""
    from megalm.train import run
    single, layouts = runs
    ref, _ = losses(single["llama"])
    saved, _ = losses(layouts["saved"])
    assert saved == pytest.approx(ref[:2], rel=1e-5)
    run(load(*BASE, *LLAMA, *CKPT, f"checkpoint.load={layouts['saved'] / 'checkpoints' / 'step_00000002'}"),
        tmp_path, 1)
    assert losses(tmp_path)[0] == pytest.approx(ref[2:], rel=1e-5)


def _ring_volume(rank, world, tp):
    """One forward and backward at cp = world / tp: the bytes each rank sent around the ring."""
    from megalm.data import build_data, collate
    from megalm.distributed.comm import count_comm
    from megalm.parallel.context import weighted_loss
    cp = world // tp
    cfg = load(*BASE, *LLAMA, f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.sequence_parallel={tp > 1}")
    _, model, layout = parallel_model(cfg, world)
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=0)
    batch = layout.context.split(data.batch(collate([data.train[i] for i in range(2)])))
    with count_comm() as stats:
        weighted_loss(model.loss(model(batch["tokens"]), batch), batch).backward()
    return stats.bytes.get("ring", 0), cfg.model.num_layers, cfg.model.kv_heads, cfg.model.head_dim


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_the_ring_moves_its_analytic_volume(world, tp):
    """Per layer and micro-batch each rank sends cp - 1 (k, v) blocks of its own heads forward and
    cp - 1 of their gradients back (megalm.parallel.context.ring_bytes)."""
    from megalm.parallel.context import ring_bytes
    cp = world // tp
    for sent, layers, kv_heads, head_dim in run_ranks(world, _ring_volume, tp):
        block = 2 * 2 * (kv_heads // tp) * (32 // cp) * head_dim * 4  # (k, v) x batch 2 x heads x tokens x fp32
        assert sent == layers * 2 * (cp - 1) * block == layers * ring_bytes(2, 32 // cp, kv_heads // tp, head_dim,
                                                                             cp, 4)


@pytest.mark.parametrize("overrides,message", [
    (["model=bert_tiny", "parallel.cp=2"], r"parallel.cp=2 splits the sequences of a decoder language model"),
    (["model.seq_length=30", "parallel.cp=2"], r"2 x cp = 4 chunks .* model.seq_length=30 does not divide"),
    (["model=gpt_tiny", "data=sft", "data.paths=[x.jsonl]", "data.tokenizer.type='null'", "data.packing=true",
      "parallel.cp=2"], r"data.packing=true keeps attention inside each packed example"),
    (["parallel.cp=0"], r"parallel.cp=0 must be at least 1"),
])
def test_layouts_context_parallelism_cannot_run_are_refused(overrides, message):
    from megalm.validation import validate
    cfg = load(*BASE, *overrides)
    world = cfg.parallel.tp * cfg.parallel.pp * max(cfg.parallel.cp, 1)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world)
