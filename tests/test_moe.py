"""Mixture of experts (model.num_experts): the layer against a token-by-token reference, the
auxiliary losses' gradients against autograd of the summed loss, and training at data and pipeline
layouts against the single process (fp32, relative 1e-5 on every step's loss and aux loss)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from megalm.errors import ConfigError
from configs import load
from layouts import parallel_model, run_layouts
from megalm.ops.routing import routing_step


def _cfg(**kw):
    from megalm.models.gpt.config import GPTConfig
    fields = dict(name="m", num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64,
                  ffn_hidden_size=24, activation="swiglu", num_experts=4, moe_router_topk=2,
                  moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    fields.update(kw)
    return GPTConfig(**fields)


def _layer(cfg, seed=0):
    from megalm.models.moe import MoE
    torch.manual_seed(seed)
    layer = MoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def _reference(layer, x, capacity=None):
    """Token by token: the router's top-k experts, each expert's MLP as plain matrices, the weighted
    sum; with a capacity, each expert keeps its `capacity` highest-scored assignments."""
    cfg_topk, E = layer.topk, layer.num_experts
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.T
    if layer.score_function == "softmax":
        scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
    scores = scores.detach()
    chosen = [sorted(range(E), key=lambda e: -float(scores[t, e]))[:cfg_topk] for t in range(len(tokens))]
    weight = {}
    for t, experts in enumerate(chosen):
        total = sum(float(scores[t, e]) for e in experts)
        for e in experts:
            weight[t, e] = scores[t, e] / total if (layer.score_function == "softmax" or cfg_topk > 1) else scores[t, e]
    if capacity is not None:
        for e in range(E):
            mine = sorted([t for t in range(len(tokens)) if (t, e) in weight], key=lambda t: (-float(weight[t, e]), t))
            for t in mine[capacity:]:
                del weight[t, e]
    out = torch.zeros_like(tokens)
    w1, w2 = layer.experts.fc1.weight, layer.experts.fc2.weight
    for (t, e), w in weight.items():
        gate, up = (tokens[t] @ w1[e]).chunk(2)
        out[t] += w * ((F.silu(gate) * up) @ w2[e])
    return out.view_as(x), len(chosen) * cfg_topk - len(weight)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_the_layer_is_its_token_by_token_reference(score, capacity_factor):
    cfg = _cfg(moe_router_score_function=score, moe_capacity_factor=capacity_factor)
    layer = _layer(cfg).train()
    x = torch.randn(3, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    capacity = None if capacity_factor is None else math.ceil(capacity_factor * 24 * 2 / 4)
    want, dropped = _reference(layer, x, capacity)
    with routing_step(1.0) as record:  # as the trainer opens it around a step
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    report = record.values(1, 4)
    assert report[2] == dropped and report[3] == 48
    assert report[5:].sum() == 48 - dropped  # the assignments each expert kept
    assert (dropped > 0) == (capacity_factor is not None)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_and_z_losses_add_their_gradients_where_the_router_made_them(scale):
    """The layer's output carries the load-balancing and z losses' gradients (not its value): the
    router's and the input's gradients are those of output . g + s (aux + z), both written out here, with s the
    step's gradient scale (the trainer's 1 / micro-batches: 0.25 for four; a scale left at 1 fails that case)."""
    cfg = _cfg()
    layer = _layer(cfg).train()
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with routing_step(scale):
        (layer(x) * g).sum().backward()
    got = layer.router.weight.grad.clone(), x.grad.clone()
    layer.zero_grad()
    x.grad = None
    layer.eval()  # the same routing, without the hooked losses
    tokens = x.reshape(-1, cfg.hidden_size)
    logits = tokens @ layer.router.weight.T
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(logits.topk(2, -1).indices.reshape(-1), minlength=4).float()
    aux = 1e-2 * 4 * (probs.mean(0) * counts / (16 * 2)).sum()  # Switch Transformer's, Megatron's coefficients
    z = 1e-3 * torch.logsumexp(logits, -1).square().mean()
    ((layer(x) * g).sum() + scale * (aux + z)).backward()
    torch.testing.assert_close(got[0], layer.router.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], x.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[0], layer.router.weight.grad * 0)


STEPS = 4
BASE = ["model=moe_tiny", "model.num_layers=4", "data=mock", "logging.curves=false", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.eval_steps=1", "trainer.eval_interval=2",
        "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.num_threads=1", "optimizer.warmup_steps=1",
        "optimizer.lr=1e-2", "cluster.peak_flops=1e12", "trainer.grad_clip=1.0", "parallel.bucket_size_mb=0.02",
        "model.moe_aux_loss_coeff=0.1", "model.moe_z_loss_coeff=0.01"]
LAYOUTS = [
    (["parallel=dp2"], 2),
    (["parallel=pp2"], 2),
    (["parallel.recompute=full", "model.moe_capacity_factor=1.0"], 1),
    (["parallel=dp2", "parallel.zero_stage=3", "model.moe_capacity_factor=1.0"], 2),
    (["parallel=pp2_dp2", "parallel.zero_stage=1", "model.moe_router_score_function=sigmoid"], 4),
    # Expert parallelism: the experts split over ep of the dp ranks, tokens sent to them and back.
    (["parallel=dp2", "parallel.ep=2"], 2),
    (["parallel=dp2", "parallel.ep=2", "parallel.zero_stage=1", "model.moe_capacity_factor=1.0"], 2),
    (["parallel=dp4", "parallel.ep=2", "parallel.zero_stage=2"], 4),
    (["parallel=pp2_dp2", "parallel.ep=2", "model.moe_router_score_function=sigmoid"], 4),
    # Under tp and cp each rank routes its own tokens (experts replicated there), the aux losses over all.
    (["parallel=tp2"], 2),
    (["parallel=tp2", "parallel.sequence_parallel=true"], 2),
    (["parallel.cp=2"], 2),
    (["parallel=tp2_dp2", "parallel.ep=2", "parallel.sequence_parallel=true"], 4),
    # ep x cp: the experts' gradients reduced over (dp / ep) x cp, the ranks holding the same experts, and
    # ZeRO-3 sharding and gathering them there.
    (["parallel=dp2", "parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=3"], 4),
    # Expert tensor parallelism: each expert split over tp, every tp rank's rows through every slice.
    (["parallel=tp2", "parallel.expert_tp=2", "parallel.zero_stage=1"], 2),
    (["parallel=tp2_dp2", "parallel.ep=2", "parallel.expert_tp=2", "parallel.sequence_parallel=true"], 4),
    (["parallel=tp2_pp2", "parallel.expert_tp=2", "parallel.sequence_parallel=true"], 4),
]


def _records(run_dir: Path):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "moe_aux_loss", "moe_z_loss", "moe_dropped", "grad_norm", "moe_tokens_per_expert")
    return {k: [r[k] for r in recs if "loss" in r] for k in keys}, [r["val_loss"] for r in recs if "val_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single runs (one per router setting a layout uses) and every layout's."""
    from megalm.train import run
    out, single = {}, {}
    for i, (overrides, world) in enumerate(LAYOUTS):
        model = tuple(o for o in overrides if o.startswith("model."))
        if model not in single:
            single[model] = tmp_path_factory.mktemp("moe_single")
            run(load(*BASE, *model), single[model], 1)
    for world in sorted({w for _, w in LAYOUTS}):
        mine = [i for i, (_, w) in enumerate(LAYOUTS) if w == world]
        dirs = {i: tmp_path_factory.mktemp(f"moe{i}") for i in mine}
        jobs = [([*BASE, *LAYOUTS[i][0]], str(dirs[i])) for i in mine]
        if world == 1:
            for i in mine:
                run(load(*jobs[mine.index(i)][0]), dirs[i], 1)
        else:
            run_layouts(world, jobs, timeout=300.0 * len(jobs))
        out.update(dirs)
    return single, out


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["-".join(o) for o, _ in LAYOUTS])
def test_a_mixture_trains_at_a_layout_as_the_single_process(runs, index):
    single, layouts = runs
    overrides, _ = LAYOUTS[index]
    ref, ref_val = _records(single[tuple(o for o in overrides if o.startswith("model."))])
    got, val = _records(layouts[index])
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # The aux losses: step 1 at 1e-5 (the same weights); later steps 1e-4, as for the gradient norm below (the
    # z-loss squares logsumexp, so it moves most with weights that differ in their last bits).
    for key in ("moe_aux_loss", "moe_z_loss"):
        assert got[key][0] == pytest.approx(ref[key][0], rel=1e-5), key
        assert got[key] == pytest.approx(ref[key], rel=1e-4), key
    assert got["moe_dropped"] == pytest.approx(ref["moe_dropped"], abs=1e-9)
    # Every expert's assignments over the step (4 layers x 8 samples x 32 tokens x 2 experts, less any dropped).
    assert got["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
    assert [sum(c) for c in ref["moe_tokens_per_expert"]] == [round(4 * 8 * 32 * 2 * (1 - d)) for d in ref["moe_dropped"]]
    # The global gradient norm: experts split over ep or tp counted once (step 1: the same weights; later
    # steps 5e-4, as Adam turns float-level gradient differences into weight differences: at step 4, where
    # the norm doubles, tp2 alone is 8e-5 off and expert tp, which sums fc2's partial rows, 1.6e-4).
    assert got["grad_norm"][0] == pytest.approx(ref["grad_norm"][0], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-4)
    assert val == pytest.approx(ref_val, rel=1e-5) and ref_val[-1] != ref_val[0]
    assert all(a > 0 for a in ref["moe_aux_loss"])
    if "model.moe_capacity_factor=1.0" in overrides:
        assert max(ref["moe_dropped"]) > 0  # the capacity did drop assignments


CKPT = ["checkpoint.save=true", "checkpoint.interval=2", "optimizer.decay_steps=4"]


def test_an_expert_parallel_checkpoint_continues_the_curve_in_one_process(tmp_path):
    """Saved at step 2 at tp2 x dp2 x ep2 with expert tp and ZeRO-3 (each rank holding half of each of 2 of a
    layer's 4 experts, and of its weights and their Adam state a flat shard), loaded into one process for
    steps 3 and 4: the single process's curve."""
    from megalm.train import run
    run(load(*BASE, *CKPT), tmp_path / "single", 1)
    ref, _ = _records(tmp_path / "single")
    run_layouts(4, [([*BASE, *CKPT, "parallel=tp2_dp2", "parallel.ep=2", "parallel.expert_tp=2",
                      "parallel.zero_stage=3", "trainer.max_steps=2"], str(tmp_path / "ep"))])
    run(load(*BASE, *CKPT, f"checkpoint.load={tmp_path / 'ep' / 'checkpoints' / 'step_00000002'}"),
        tmp_path / "after", 1)
    assert _records(tmp_path / "ep")[0]["loss"] == pytest.approx(ref["loss"][:2], rel=1e-5)
    assert _records(tmp_path / "after")[0]["loss"] == pytest.approx(ref["loss"][2:], rel=1e-5)


def _expert_split(rank, world, overrides):
    """Each rank's expert weights, and the bytes its layers' all-to-alls sent in one forward."""
    from megalm.data import build_data, collate
    from megalm.distributed.comm import count_comm
    cfg = load(*BASE, *overrides)
    _, model, _ = parallel_model(cfg, world)
    data = build_data(cfg.data, seq_length=cfg.model.seq_length, seed=0)
    batch = data.batch(collate([data.train[i] for i in range(2 * rank, 2 * rank + 2)]))
    with count_comm() as stats:
        model(batch["tokens"])
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
    return weights, stats.bytes.get("all_to_all", 0)


@pytest.mark.parametrize("overrides,ep,tp", [(["parallel=dp2", "parallel.ep=2"], 2, 1),
                                             (["parallel=tp2", "parallel.expert_tp=2"], 1, 2),
                                             (["parallel=tp2_dp2", "parallel.ep=2", "parallel.expert_tp=2"], 2, 2)])
def test_expert_parallel_ranks_hold_their_share_of_the_experts_and_exchange_tokens(overrides, ep, tp):
    """Each rank holds its slice of the full stack of a layer's 4 experts the single process initialises:
    4 / ep of them (ep), and of each its share of fc1's gate and up columns and of fc2's rows (expert tp);
    and each forward sends rows out and back."""
    from megalm.models import build_model, init_weights
    cfg = load(*BASE)
    full = build_model(cfg.model)
    init_weights(full, cfg.model, 0)
    whole = dict(full.named_parameters())
    E, f = 4 // ep, cfg.model.ffn_size // tp
    for rank, (weights, sent) in enumerate(run_ranks(ep * tp, _expert_split, overrides)):
        e, t = rank // tp % ep, rank % tp  # (dp, tp) ranks, tp fastest; ep ranks are dp ranks
        assert weights
        for name, w in weights.items():
            mine = whole[name].detach()[e * E:(e + 1) * E]
            if name.endswith("fc1.weight"):  # [gate | up] columns
                mine = torch.cat([mine[:, :, t * f:(t + 1) * f],
                                  mine[:, :, cfg.model.ffn_size + t * f:cfg.model.ffn_size + (t + 1) * f]], 2)
            else:
                mine = mine[:, t * f:(t + 1) * f]
            assert torch.equal(w, mine), name
        assert sent > 0


def _inference_logits(rank, world, overrides):
    cfg = load(*BASE, *overrides)
    _, model, _ = parallel_model(cfg, world)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("overrides", [["parallel=tp2"], ["parallel=tp2", "parallel.expert_tp=2"]])
def test_a_mixture_at_tp_infers_a_prompt_that_tp_does_not_divide(overrides):
    """Generation and evaluation run prompts of any length (and decode one token at a time): at tp2 without
    SP, 5 tokens a row still give the single process's logits (each rank's vocabulary shard)."""
    cfg = load(*BASE)
    want = _inference_logits(0, 1, [])  # one process
    got = torch.cat(run_ranks(2, _inference_logits, overrides), dim=-1)
    torch.testing.assert_close(got[..., :cfg.model.vocab_size], want[..., :cfg.model.vocab_size], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("override,message", [
    ("model.moe_router_topk=5", r"model.moe_router_topk=5 must be in 1..model.num_experts=4"),
    ("model.moe_router_score_function=relu", r"'relu' is not one of softmax, sigmoid"),
    ("model.moe_capacity_factor=0", r"model.moe_capacity_factor=0.0 must be positive"),
    ("model.num_experts=1", r"model.num_experts=1: a mixture needs at least 2 experts"),
    ("parallel=tp2 model.moe_capacity_factor=1.0", r"capacity is chosen over a micro-batch's tokens, which tp splits"),
    ("parallel.ep=3", r"parallel.ep=3 must divide model.num_experts=4"),
    ("parallel=tp2 parallel.expert_tp=3", r"parallel.expert_tp=3 must be 1 .* or parallel.tp=2"),
    ("parallel=tp2 model.num_experts=0 parallel.expert_tp=2", r"parallel.expert_tp=2 splits the experts .* none"),
])
def test_bad_mixture_settings_are_refused(override, message):
    from megalm.validation import validate
    cfg = load(*BASE, *override.split())
    with pytest.raises(ConfigError, match=message):
        validate(cfg, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp * max(cfg.parallel.dp, 1))
