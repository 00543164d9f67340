"""Optimizer groups, LR schedules, clipping, gradient accumulation, sampling."""

import dataclasses
import json
import math

import pytest
import torch

from megalm.config import OptimizerConfig
from megalm.generate import generate_ids, sample_next
from megalm.models import build_model, init_weights
from megalm.parallel.grads import clip_grads
from megalm.training.optim import LRSchedule, build_optimizer, param_groups


def test_no_weight_decay_on_norms_and_biases(tiny_model_cfg):
    model = build_model(tiny_model_cfg)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "blocks.0.norm1.weight" in no_decay_names and "blocks.0.attn.qkv.bias" in no_decay_names
    assert "norm.weight" in no_decay_names
    # The tied embedding/head matrix is one parameter, counted once.
    total = len(decay["params"]) + len(no_decay["params"])
    assert total == len(list(model.parameters()))


def test_decoupled_weight_decay_leaves_norms_alone(tiny_model_cfg):
    model = build_model(tiny_model_cfg)
    init_weights(model, tiny_model_cfg, 0)
    opt = build_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5), model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: only weight decay can move a weight
    before_norm = model.blocks["0"].norm1.weight.clone()
    before_w = model.blocks["0"].mlp.fc1.weight.clone()
    opt.step()
    torch.testing.assert_close(model.blocks["0"].norm1.weight, before_norm, rtol=0, atol=0)
    torch.testing.assert_close(model.blocks["0"].mlp.fc1.weight, before_w * (1 - 0.1 * 0.5))


def _adamw_by_hand(params, grads_per_step, lr, betas, eps, weight_decay):
    """AdamW (arXiv:1711.05101, algorithm 2 with bias correction), written out: the reference every kernel must meet."""
    b1, b2 = betas
    params = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            p.mul_(1 - lr * weight_decay[i])
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            p.sub_(lr * (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** t)).sqrt() + eps))
    return params


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for_loop"])
def test_every_optimizer_kernel_computes_adamw(tiny_model_cfg, implementation):
    model = build_model(tiny_model_cfg)
    init_weights(model, tiny_model_cfg, 0)
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1, implementation=implementation)
    opt = build_optimizer(cfg, model)
    expected_kernel = {"fused": ("fused", True), "foreach": ("foreach", True), "for_loop": ("foreach", False)}
    key, value = expected_kernel[implementation]
    assert opt.defaults[key] is value
    params = [p for g in opt.param_groups for p in g["params"]]
    decay = [g["weight_decay"] for g in opt.param_groups for _ in g["params"]]
    gen = torch.Generator().manual_seed(0)
    steps = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(4)]
    want = _adamw_by_hand(params, steps, cfg.lr, cfg.betas, cfg.eps, decay)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)


def test_bad_optimizer_implementation_is_refused(tiny_model_cfg):
    from megalm.errors import ConfigError
    with pytest.raises(ConfigError, match="optimizer.implementation='apex' is not one of fused, foreach, for_loop"):
        build_optimizer(OptimizerConfig(implementation="apex"), build_model(tiny_model_cfg))


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_lr_schedule_shape(decay):
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay=decay)
    lr = LRSchedule(cfg, max_steps=110)
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)  # linear warmup to the peak
    assert lr(10) == pytest.approx(1.0)
    end = 1.0 if decay == "constant" else 0.1
    assert lr(110) == pytest.approx(end) and lr(500) == pytest.approx(end)
    mid = {"cosine": 0.1 + 0.9 * 0.5, "linear": 0.1 + 0.9 * 0.5, "constant": 1.0}[decay]
    assert lr(60) == pytest.approx(mid)
    if decay == "cosine":  # cosine stays above linear in the first half
        assert lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_decay_steps_decouple_the_schedule_from_max_steps():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear", decay_steps=100)
    assert LRSchedule(cfg, max_steps=10)(50) == pytest.approx(0.5)


def test_clipping_uses_the_global_norm():
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    expected = math.sqrt(3 * 9 + 4 * 16)
    norm, finite = clip_grads([a, b], max_norm=1.0)
    assert finite and norm.item() == pytest.approx(expected)
    clipped = math.sqrt(a.grad.pow(2).sum() + b.grad.pow(2).sum())
    assert clipped == pytest.approx(1.0, rel=1e-5)
    b.grad[0] = float("inf")
    assert clip_grads([a, b], 1.0)[1] is False


def test_gradient_accumulation_matches_one_big_batch(tiny_model_cfg):
    torch.manual_seed(0)
    batch = torch.randint(0, tiny_model_cfg.vocab_size, (8, tiny_model_cfg.seq_length + 1))
    grads = []
    for micro in (8, 2):
        model = build_model(tiny_model_cfg)
        init_weights(model, tiny_model_cfg, 0)
        n = 8 // micro
        for mb in batch.split(micro):
            (model(mb[:, :-1], labels=mb[:, 1:]) / n).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_top_k_and_top_p_sampling():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0.0, 0, 1.0).item() == 0                      # greedy
    draws = {sample_next(logits, 1.0, 2, 1.0, g).item() for _ in range(200)}
    assert draws == {0, 1}                                                   # top-k keeps 2
    probs = logits.softmax(-1)[0]
    p = float(probs[0] + probs[1]) - 1e-4          # needs the top two, not the third
    draws = {sample_next(logits, 1.0, 0, p, g).item() for _ in range(300)}
    assert draws == {0, 1}
    assert {sample_next(logits, 1.0, 0, 0.01, g).item() for _ in range(50)} == {0}


def test_kv_cached_generation_equals_uncached(tiny_model_cfg):
    cfg = dataclasses.replace(tiny_model_cfg, position_embedding="rope", num_query_groups=2)
    model = build_model(cfg)
    init_weights(model, cfg, 0)
    prompt = [5, 6, 7]
    kw = dict(max_new_tokens=10, temperature=0.0, vocab_size=cfg.vocab_size)
    cached = list(generate_ids(model, prompt, use_cache=True, **kw))
    plain = list(generate_ids(model, prompt, use_cache=False, **kw))
    assert cached == plain and len(cached) == 10
    assert all(t < cfg.vocab_size for t in cached)  # padded vocabulary rows are never sampled


def test_mfu_peak_follows_the_precision(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    import megalm.training.metrics as metrics
    from megalm.config import conf_dir
    from megalm.models.registry import register_configs
    from megalm.errors import ConfigError
    from megalm.validation import validate
    register_configs()

    def cfg(*overrides):
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            return OmegaConf.to_object(compose("config", overrides=["model=gpt_tiny", "data=mock", *overrides]))

    cpu = torch.device("cpu")
    a100 = cfg("cluster=slurm_a100").cluster  # NVIDIA's dense figures: fp32 (no TF32) 19.5 T, bf16 312 T
    assert metrics.peak_flops_for(a100, "fp32", cpu) == 19.5e12 and metrics.peak_flops_for(a100, "bf16", cpu) == 312e12
    assert metrics.peak_flops_for(cfg("cluster=slurm_a100", "cluster.peak_flops=1e15").cluster, "bf16", cpu) == 1e15
    measured = []
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda device, dtype: measured.append(dtype) or 2e12)
    local = cfg().cluster
    assert metrics.peak_flops_for(local, "bf16", cpu) == 2e12 and metrics.peak_flops_for(local, "fp32", cpu) == 2e12
    assert measured == [torch.bfloat16, torch.float32]  # measured in the run's precision
    from megalm.train import run
    run_cfg = cfg("trainer.precision=bf16", "trainer.max_steps=1", "trainer.eval_steps=0", "trainer.num_threads=1",
                  "trainer.micro_batch_size=4", "trainer.global_batch_size=4", "trainer.progress_bar=false")
    validate(run_cfg, 1)
    run(run_cfg, tmp_path)
    assert measured[-1] is torch.bfloat16
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][0]
    assert rec["mfu"] == pytest.approx(rec["tflops_per_device"] * 1e12 / 2e12)
    with pytest.raises(ConfigError, match="cluster.peak_flops_per_dtype.fp64=1.0: keys are fp32, bf16, fp16, fp8"):
        validate(cfg("+cluster.peak_flops_per_dtype.fp64=1.0"), 1)
