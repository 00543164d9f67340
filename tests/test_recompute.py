"""Activation recomputation: the same loss and gradients, fewer saved activations."""

import dataclasses

import pytest
import torch

from megalm.config import ParallelConfig
from megalm.models import build_model, family_of, init_weights
from megalm.parallel import materialize, parallelize

from layouts import BASE, LLAMA, losses, run_layouts


def _grads_and_saved_bytes(model_cfg, recompute, num_layers=None):
    model = build_model(model_cfg, "meta")
    parallelize(model, family_of(model.cfg.arch), None, ParallelConfig(recompute=recompute, recompute_num_layers=num_layers))
    materialize(model, "cpu")
    init_weights(model, model_cfg, 0)
    x = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(7)  # the same dropout masks in every variant
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x[:, :-1], labels=x[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("recompute,num_layers", [("selective", None), ("full", None), ("full", 1)])
def test_recompute_gives_the_same_loss_and_gradients(tiny_model_cfg, recompute, num_layers):
    cfg = dataclasses.replace(tiny_model_cfg, num_layers=3, dropout=0.1, attention_dropout=0.1)
    ref_loss, ref_grads, ref_saved = _grads_and_saved_bytes(cfg, "none")
    loss, grads, saved = _grads_and_saved_bytes(cfg, recompute, num_layers)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()  # parameter names are unchanged
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    assert saved < ref_saved  # fewer activations kept for backward
    if recompute == "full" and num_layers is None:
        assert saved < 0.5 * ref_saved


def test_recompute_under_tp_and_a_zero_bubble_pipeline_keeps_the_losses(tmp_path):
    """Full recomputation under tp2 + sp replays the tp dropout stream; parallel.recompute_activation refills fc2's
    input there (a row-parallel fc2) and under zbv, whose weight pass runs after the input pass that refilled it."""
    common = [*BASE, *LLAMA, "model.dropout=0.1", "model.attention_dropout=0.1", "parallel=tp2",
              "parallel.sequence_parallel=true"]
    zbv = [*BASE, *LLAMA, "parallel=pp2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_size=2"]
    act = ["parallel.recompute_activation=true"]
    runs = {"plain": common, "full": [*common, "parallel.recompute=full"],
            "act": [*common, *act, "parallel.recompute=selective"], "zbv": zbv, "zbv_act": [*zbv, *act]}
    run_layouts(2, [(o, str(tmp_path / name)) for name, o in runs.items()])  # one set of ranks for all
    got = {name: losses(tmp_path / name)[0] for name in runs}
    assert got["full"] == pytest.approx(got["plain"], rel=1e-6)
    assert got["act"] == pytest.approx(got["plain"], rel=1e-6)
    assert got["zbv_act"] == got["zbv"]  # the same kernels on the same inputs


def _saved_after_forward(model_cfg, recompute_activation):
    """Loss, gradients, and the bytes of the storages autograd holds for backward once the forward is done."""
    model = build_model(model_cfg, "meta")
    parallelize(model, family_of(model.cfg.arch), None, ParallelConfig(recompute_activation=recompute_activation))
    materialize(model, "cpu")
    init_weights(model, model_cfg, 0)
    x = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in weights:
            held[storage._cdata] = storage
        return t

    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x[:, :-1], labels=x[:, 1:])
    saved = sum(s.nbytes() for s in held.values())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("activation,freed", [("gelu", 1), ("swiglu", 1), ("relu", 0)])
def test_recompute_activation_frees_fc2_input_and_changes_no_bit(tiny_model_cfg, activation, freed):
    """parallel.recompute_activation: after the forward each layer's fc2 input (the activation's output: f values a
    token) holds no memory, and backward computes it again from fc1's output, the same kernel on the same input, so
    the loss and every gradient are the same bits. ReLU keeps its output for its own backward: nothing changes."""
    cfg = dataclasses.replace(tiny_model_cfg, num_layers=3, dropout=0.1, activation=activation)
    ref_loss, ref_grads, ref_saved = _saved_after_forward(cfg, False)
    loss, grads, saved = _saved_after_forward(cfg, True)
    assert loss == ref_loss
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    tokens = 2 * cfg.seq_length
    assert ref_saved - saved == freed * cfg.num_layers * tokens * cfg.ffn_size * 4  # fp32
