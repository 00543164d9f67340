"""Expected bytes per parameter (Megatron's formula) against what a rank really holds."""

import dataclasses

import pytest
import torch

from megalm.config import OptimizerConfig
from megalm.models import build_model, init_weights
from megalm.training.memory import expected_bytes_per_param, measured_model_state_bytes
from megalm.training.optim import build_optimizer


def test_megatron_numbers():
    # bf16 weights, fp32 grads, fp32 master + Adam: 18 bytes; with the distributed optimizer 6 + 12/dp.
    mixed = dict(weight_bytes=2, grad_bytes=4, master_weights=True)
    assert expected_bytes_per_param(**mixed) == 18
    for dp in (2, 8, 64):
        assert expected_bytes_per_param(**mixed, zero_stage=1, dp=dp) == pytest.approx(6 + 12 / dp)
    assert expected_bytes_per_param(**mixed, zero_stage=3, dp=4) == pytest.approx(18 / 4)


@pytest.mark.parametrize("tie", [True, False])
def test_measured_model_state_matches_the_formula(tiny_model_cfg, tie):
    cfg = dataclasses.replace(tiny_model_cfg, tie_embeddings=tie)
    model = build_model(cfg)
    init_weights(model, cfg, 0)
    opt = build_optimizer(OptimizerConfig(), model)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    model(x[:, :-1], labels=x[:, 1:]).backward()
    opt.step()
    got = measured_model_state_bytes(model, opt)
    n = got["params"]
    assert n == sum(p.numel() for p in model.parameters())
    total = got["weights"] + got["grads"] + got["optimizer"]
    assert got["optimizer"] == 8 * n                      # Adam's two fp32 moments, for every parameter
    assert total == expected_bytes_per_param() * n        # 16 bytes: fp32 weights, grads, moments
