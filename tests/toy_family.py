"""A second model family for tests, sharing no attribute name or batch key with GPT.

Its model keeps an input embedding `inp`, residual MLP layers in `stack`, an output `out` tied to
`inp`, and a loss module `crit`; its batches carry `ids` and `targets`. The parallel core, the
trainer and checkpoints must run it at every layout from its declarations alone
(tests/test_family_layouts.py): any GPT name left in them fails there.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.models.registry import FAMILY_MODULES
from megalm.family import Family, Parts
from megalm.models.losses import LMLoss


class Layer(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up, self.down = nn.Linear(h, f), nn.Linear(f, h)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class Stacked(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        V, h = cfg.padded_vocab_size, cfg.hidden_size
        self.inp = nn.Embedding(V, h)
        self.stack = nn.ModuleDict({str(i): Layer(h, cfg.ffn_size) for i in range(cfg.num_layers)})
        self.out = nn.Linear(h, V, bias=False)
        self.out.weight = self.inp.weight
        self.crit = LMLoss(cfg.vocab_size)

    def forward(self, ids, part=None):
        first, last = part is None or part.first, part is None or part.last
        x = self.inp(ids) if first else ids
        for key in (self.stack if part is None else [str(i) for i in part.layers]):
            x = self.stack[key](x)
        return self.out(x) if last else x

    def loss(self, logits, batch):
        return self.crit(logits, batch["targets"])


def init(model, cfg, seed):
    """Every parameter drawn whole from (seed, name) and cut to this rank's shard (as GPT's)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = getattr(p, "tied_copy_of", name)
            digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            shard = getattr(p, "tp_shard", None)
            shape = list(p.shape)
            if shard is not None:
                shape[shard.dim] *= shard.world
            full = torch.randn(shape, generator=g) * (0.3 if p.ndim > 1 else 0.1) + (1.0 if "norm.weight" in key else 0.0)
            p.copy_(shard.local(full) if shard is not None else full)


def tp_plan(cfg, tp, sp):
    from megalm.parallel.styles import ColumnParallel, RowParallel, VocabParallel, VocabParallelLoss
    rows = cfg.padded_vocab(tp)
    return [("inp", VocabParallel(rows)), ("stack.*.up", ColumnParallel()), ("stack.*.down", RowParallel()),
            ("out", ColumnParallel(rows=rows)), ("crit", VocabParallelLoss(rows))]


FAMILY = Family(name="stacked", config=ModelConfig, build=Stacked, init_weights=init, flops_per_token=lambda cfg, seq=None: 1.0,
                tp_plan=tp_plan, inputs=("ids",), parts=Parts(layers="stack", first=("inp",), last=("out", "crit")),
                vocab_params=("inp.weight", "out.weight"), tied=(("out.weight", "inp.weight"),))


def register() -> None:
    FAMILY_MODULES.setdefault("stacked", __name__)


class Samples:
    """Dict samples of the family's own keys: sample i depends on i alone."""

    def __init__(self, vocab: int, seq: int, n: int = 512, name: str = "train"):
        self.vocab, self.seq, self.n, self.name = vocab, seq, n, name

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng([7, int(i)])
        start, stride = rng.integers(0, self.vocab), rng.integers(1, 7)
        x = (start + stride * np.arange(self.seq + 1, dtype=np.int64)) % self.vocab
        return {"ids": x[:-1], "targets": x[1:]}
