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


def test_full_recompute_under_tp_replays_the_tp_dropout_stream(tmp_path):
    common = [*BASE, *LLAMA, "model.dropout=0.1", "model.attention_dropout=0.1", "parallel=tp2",
              "parallel.sequence_parallel=true"]
    run_layouts(2, [(common, str(tmp_path / "plain")),  # one set of ranks for both runs
                    ([*common, "parallel.recompute=full"], str(tmp_path / "full"))])
    a, b = losses(tmp_path / "plain")[0], losses(tmp_path / "full")[0]
    assert b == pytest.approx(a, rel=1e-6)
