"""A tiny T5 config (tiny, with any field overridden) and a batch for it: encoder tokens with
padding in two rows, and decoder tokens (batch). The T5 and attention tests share them."""

import torch

from megalm.models.t5.config import T5Config


def tiny(**kw) -> T5Config:
    fields = dict(name="t", num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=200,
                  make_vocab_size_divisible_by=8, decoder_seq_length=12)
    fields.update(kw)
    return T5Config(**fields)


def batch(cfg: T5Config, B: int = 3):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 90, (B, cfg.seq_length), generator=g)
    padding = torch.ones(B, cfg.seq_length, dtype=torch.long)
    padding[0, 15:] = 0
    padding[1, 7:] = 0
    decoder = torch.randint(3, 90, (B, cfg.decoder_seq_length), generator=g)
    return tokens, padding, decoder
