"""The tensor-parallel plan for GPT: which module becomes which sharded layer.

Megatron's layout (arXiv:1909.08053, sec. 3): in each block, the fused QKV and the MLP's first
linear are column-parallel (each rank holds whole heads and a slice of the ffn), the attention
output and the MLP's second linear are row-parallel, so a block needs one all-reduce forward
and one backward per sub-layer. The embedding and the head are vocab-parallel, and the loss is
computed from vocabulary shards without gathering the logits.

With sequence parallelism (arXiv:2205.05198) the activations between sub-layers are split along
the sequence: the all-reduce becomes a reduce-scatter after the row-parallel linear and an
all-gather before the column-parallel one (the same bytes), and norms and dropout run on
1/tp of the tokens. Their weights then see partial gradients: marked `sequence_parallel` so
finalize_grads sums them over the tp group.

Applied on the meta device, before any weight exists; init_weights then fills each shard from
the full tensor of the same global name, so weights do not depend on tp.
"""

from __future__ import annotations

from torch import nn

from megalm.distributed.comm import scatter_seq
from megalm.models.gpt import GPT
from megalm.models.losses import IGNORE, masked_mean
from megalm.parallel.random import TPRNG
from megalm.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                    vocab_parallel_cross_entropy)


class ForkRNG(nn.Module):
    """Run a parameter-free module (dropout, attention core) under one of the tp RNG streams."""

    def __init__(self, inner: nn.Module, rng: TPRNG, stream: str):
        super().__init__()
        self.inner, self.stream = inner, stream
        self._rng = rng  # not a submodule: it holds no parameters or buffers

    def forward(self, *args, **kwargs):
        with self._rng.fork(self.stream):
            return self.inner(*args, **kwargs)


class VocabParallelLMLoss(nn.Module):
    """LMLoss from vocabulary shards of the logits: the same value, no full-vocab tensor."""

    def __init__(self, group, vocab_start: int, vocab_size: int, label_smoothing: float = 0.0):
        super().__init__()
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.label_smoothing = label_smoothing

    def forward(self, logits, labels, loss_mask=None):
        losses = vocab_parallel_cross_entropy(logits, labels, self.group, vocab_start=self.vocab_start,
                                              vocab_size=self.vocab_size, label_smoothing=self.label_smoothing,
                                              ignore_index=IGNORE)
        return masked_mean(losses, loss_mask if loss_mask is not None else labels != IGNORE)


def _mark_sequence_parallel(module: nn.Module) -> None:
    """Replicated parameters applied on sequence shards: their gradients are partial over tp."""
    for p in module.parameters(recurse=False):
        if getattr(p, "tp_shard", None) is None:
            p.sequence_parallel = True


def apply_tensor_parallel(model: GPT, group, *, sequence_parallel: bool, seed: int, rng_device) -> None:
    """Swap model's layers for tensor-parallel ones over `group`, in place."""
    cfg = model.cfg
    tp, rank = group.size(), group.rank()
    sp = sequence_parallel
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.kv_heads * hd
    device = next(model.parameters()).device
    rng = TPRNG(seed, rank, rng_device)  # the device training will run on; `device` is meta here
    model.tp_rng = rng  # recomputation replays this stream (megalm.parallel.recompute)
    dense = dict(group=group, sequence_parallel=sp, device=device)

    if model.embed is not None:
        emb = model.embed
        if sp and emb.pos is None:
            # No position table to add after the lookup: reduce-scatter the partial sums straight
            # into sequence shards (half the bytes of an all-reduce) and drop out on the shard.
            emb.tok = VocabParallelEmbedding(model.padded_vocab, h, group=group, reduce="reduce_scatter",
                                             device=device)
            emb.drop = ForkRNG(emb.drop, rng, "tp")
        else:
            emb.tok = VocabParallelEmbedding(model.padded_vocab, h, group=group, reduce="all_reduce",
                                             device=device)
            if sp:  # positions and dropout on the full (replicated) sequence, then keep this rank's part
                emb.register_forward_hook(lambda module, args, out: scatter_seq(out, group))

    for block in model.blocks.values():
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear(h, q + 2 * kv, bias=cfg.bias, segments=(q, kv, kv), **dense)
        attn.proj = RowParallelLinear(q, h, bias=cfg.bias, **dense)
        attn.core = ForkRNG(attn.core, rng, "tp")  # attention dropout over this rank's heads
        gated = cfg.activation == "swiglu"
        f = cfg.ffn_size
        mlp.fc1 = ColumnParallelLinear(h, 2 * f if gated else f, bias=cfg.bias,
                                       segments=(f, f) if gated else None, **dense)
        mlp.fc2 = RowParallelLinear(f, h, bias=cfg.bias, **dense)
        if sp:
            attn.dropout = ForkRNG(attn.dropout, rng, "tp")
            mlp.dropout = ForkRNG(mlp.dropout, rng, "tp")
            for module in (block.norm1, block.norm2, attn.proj, mlp.fc2):
                _mark_sequence_parallel(module)  # row-parallel biases are added on the shard too

    if model.norm is not None and sp:
        _mark_sequence_parallel(model.norm)
    if model.head is not None:
        model.head = ColumnParallelLinear(h, model.padded_vocab, bias=False, **dense)
        model.loss = VocabParallelLMLoss(group, model.head.out_features * rank, cfg.vocab_size)
    model.tie_weights()
