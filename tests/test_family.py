"""The model-family registry: model.arch chooses the family, and code outside models/ reaches a
model only through what its family declares."""

import dataclasses
import sys
import types

import pytest
import torch
from torch import nn

from megalm.errors import ConfigError
from megalm.models import build_model, family_of, flops_per_token, init_weights
from megalm.family import Family
from megalm.models.gpt.config import GPTConfig
from megalm.models.registry import FAMILY_MODULES
from megalm.training.checkpoint.sharded_state import model_entries


class Toy(nn.Module):
    """A family's model with a 16-row padded vocabulary matrix and a plain 16-row one."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.vocab = nn.Parameter(torch.empty(16, 4))
        self.other = nn.Parameter(torch.empty(16, 4))


def _toy_init(model, cfg, seed):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(seed))


@pytest.fixture
def toy_family(monkeypatch):
    module = types.ModuleType("toy_family")
    module.FAMILY = Family(name="toy", config=GPTConfig, build=Toy, init_weights=_toy_init,
                           flops_per_token=lambda cfg, seq=None: 123.0, vocab_params=("vocab",))
    monkeypatch.setitem(sys.modules, "toy_family", module)
    monkeypatch.setitem(FAMILY_MODULES, "toy", "toy_family")
    return module.FAMILY


def test_unknown_arch_names_the_families(tiny_model_cfg):
    with pytest.raises(ConfigError, match=r"model.arch='bert2'.*gpt"):
        family_of("bert2")
    with pytest.raises(ConfigError, match="gpt"):
        build_model(dataclasses.replace(tiny_model_cfg, arch="bert2"))


def test_validation_refuses_an_unknown_arch(tiny_model_cfg):
    from megalm.config import Config
    from megalm.validation import validate
    cfg = Config(model=dataclasses.replace(tiny_model_cfg, arch="bert2"))
    with pytest.raises(ConfigError, match=r"model.arch.*bert2.*gpt"):
        validate(cfg, 1)


def test_build_init_and_flops_dispatch_on_arch(tiny_model_cfg, toy_family):
    cfg = dataclasses.replace(tiny_model_cfg, arch="toy")
    model = build_model(cfg, device="meta")
    assert isinstance(model, Toy) and model.vocab.is_meta
    model = build_model(cfg)
    init_weights(model, cfg, 7)
    assert torch.equal(model.other, torch.full((16, 4), 7.0))
    assert flops_per_token(cfg) == 123.0


def test_checkpoint_entries_keep_the_real_rows_of_the_declared_vocabulary_params(tiny_model_cfg, toy_family):
    cfg = dataclasses.replace(tiny_model_cfg, arch="toy", vocab_size=10)
    entries = model_entries(build_model(cfg))
    assert tuple(entries["vocab"].shape) == (10, 4)   # declared: the real vocabulary rows only
    assert tuple(entries["other"].shape) == (16, 4)   # not declared: every row


def test_gpt_declarations_name_real_parameters(tiny_model_cfg):
    gpt = family_of("gpt")
    untied = build_model(dataclasses.replace(tiny_model_cfg, tie_embeddings=False), device="meta")
    names = {n for n, _ in untied.named_parameters()}
    assert set(gpt.vocab_params) <= names
    for copy, source in gpt.tied:
        assert {copy, source} <= names
    tied = build_model(tiny_model_cfg, device="meta")
    params = dict(tied.named_parameters(remove_duplicate=False))
    for copy, source in gpt.tied:
        assert params[copy] is params[source]
