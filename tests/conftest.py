import os

import pytest

# Tests never touch the network: wandb stays offline even if a test turns it on.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def tiny_model_cfg():
    from megalm.models.gpt import GPTConfig
    return GPTConfig(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=100, make_vocab_size_divisible_by=8)
