"""GPT-NeoX (arXiv:2204.06745) as the Pythia suite (arXiv:2304.01373) uses it, single-device code.

A token embedding with no position table; in each layer RoPE (arXiv:2104.09864) rotates only the
first `rotary_dims` channels of every query and key head, and attention and the MLP both read the
same residual through their own LayerNorm (`use_parallel_residual`, as GPT-J: x + attn(norm1 x) +
mlp(norm2 x)) or run one after the other; a final LayerNorm and an output head of its own (untied).

Parameter names are the shared layers' (blocks.{i}.attn.qkv with rows [q | k | v], attn.proj,
mlp.fc1 / fc2, norm1 / norm2), so megalm's init, tensor-parallel styles and recomputation apply
unchanged; models/neox/hf.py maps them to GPTNeoXForCausalLM's. Layers live in a ModuleDict keyed
by global index, and the embedding, final norm and head may be absent on a pipeline stage, so
names are the same at every layout.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from megalm.family import Part
from megalm.models.flops import flops_per_token
from megalm.models.init import init_by_name
from megalm.models.layers import MLP, Attention, Embedding, KVCache, LMHead, apply_rope, build_norm, rope_tables
from megalm.models.losses import LMLoss
from megalm.models.neox.config import NeoXConfig

VOCAB_PARAMS = ("embed.tok.weight", "head.weight")  # rows = padded vocabulary

__all__ = ["NeoX", "VOCAB_PARAMS", "flops_per_token", "init_weights"]


class PartialRotaryAttention(Attention):
    """The shared Attention (fused [q | k | v] projection with bias, core, output projection, dropout)
    with RoPE on the first `rotary_dims` channels of each head only; the shared forward rotates whole heads."""

    def __init__(self, cfg: NeoXConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.rotary_dims = cfg.rotary_dims

    def forward(self, x: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor], cache: Optional[KVCache] = None,
                start: int = 0, mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h). `rope`: cos, sin (max_len, rotary_dims / 2); `positions` (B, T) each
        token's position (packed examples, serving slots, context parallelism), None: start, start + 1, ...;
        `mask` as the shared Attention takes it."""
        qkv = self.qkv(x)  # (B, T, 3 nh hd): T is the whole sequence even when x is a sequence shard
        B, T, _ = qkv.shape
        # Heads from the width, so a tensor-parallel shard [q_r | k_r | v_r] of this rank's heads works unchanged.
        q, k, v = qkv.view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hd)
        cos, sin = (rope[0][positions], rope[1][positions]) if positions is not None else \
            (rope[0][start:start + T], rope[1][start:start + T])  # (B, T, r/2) or (T, r/2)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, start, k, v)
        y = self.core(q, k, v, start, mask) if mask is not None else self.core(q, k, v, start)  # (B, nh, T, hd)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Channels [0, r) of each head turned in pairs (i, i + r/2) (rotate-half, as apply_rope); [r, hd) as they are."""
        r = self.rotary_dims
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class NeoXLayer(nn.Module):
    """Pre-norm layer: x + attn(norm1(x)) + mlp(norm2(x)) (parallel residual), or x' = x + attn(norm1(x)),
    then x' + mlp(norm2(x')); the shared Block has the sequential form only."""

    def __init__(self, cfg: NeoXConfig, layer_idx: int):
        super().__init__()
        self.parallel_residual = cfg.use_parallel_residual
        self.norm1 = build_norm(cfg)
        self.attn = PartialRotaryAttention(cfg, layer_idx)
        self.norm2 = build_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache=None, start=0, mask=None, positions=None):
        attn = self.attn(self.norm1(x), rope, cache, start, mask, positions)
        if self.parallel_residual:
            return x + attn + self.mlp(self.norm2(x))
        x = x + attn
        return x + self.mlp(self.norm2(x))


class NeoX(nn.Module):
    def __init__(self, cfg: NeoXConfig):
        super().__init__()
        self.cfg = cfg
        V = cfg.padded_vocab_size  # Megatron's padding; the plan pads further for tp, the loss masks it
        self.embed: Optional[Embedding] = Embedding(cfg, V)  # token table and dropout (no position table)
        self.blocks = nn.ModuleDict({str(i): NeoXLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm: Optional[nn.Module] = build_norm(cfg)
        self.head: Optional[LMHead] = LMHead(cfg.hidden_size, V, bias=False)
        self.criterion: Optional[LMLoss] = LMLoss(cfg.vocab_size)
        self.metric_names: Tuple[str, ...] = ()
        """What `loss_and_metrics` would report beside the loss: nothing (a language model's loss only)."""
        self.new_heads: Tuple[str, ...] = ()
        """Modules a fine-tuning start initialises afresh: none (NeoX fine-tunes its language-model head)."""
        if cfg.tie_embeddings:  # megalm.parallel.materialize keeps the shared weight shared
            self.head.weight = self.embed.tok.weight
        self._rope: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, length: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, rotary_dims / 2): computed, not stored as buffers, so a meta-device build needs no fix-up."""
        if torch.compiler.is_compiling():  # traced into the graph: a cache filled on the first call fails its guards
            return rope_tables(self.cfg.rotary_dims, length, self.cfg.rotary_emb_base, device)
        key = (device, length)
        if key not in self._rope:
            self._rope = {key: rope_tables(self.cfg.rotary_dims, length, self.cfg.rotary_emb_base, device)}
        return self._rope[key]

    def forward(self, tokens: torch.Tensor, *packed: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None, start: int = 0,
                part: Optional[Part] = None, positions: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        """tokens (B, T) ids -> logits (B, T, V) (this rank's vocabulary shard under tp); with labels (B, T) ->
        the mean cross-entropy. The decoder protocol GPT's forward speaks:

        `packed` = (position_ids, segment_ids), each (B, T): packed examples, positions restarting and
        attention kept inside each one. `cache` and `start`: a KVCache written from position `start`
        (megalm.generate). `positions` (B, T) and `attention_mask` (B, 1, T, S) bool: rows at their own
        positions (the serving engine's slots). With `part` (a pipeline stage) only its layers run: a
        stage after the first takes the hidden states (B, T, h) in place of tokens (then `packed`), and
        one before the last returns them (with `packed`).
        """
        if packed and len(packed) != 2:
            raise TypeError(f"NeoX.forward got {len(packed) + 1} positional inputs: after tokens it takes "
                            "(position_ids, segment_ids) of packed examples; pass labels and loss_mask by keyword")
        first, last = part is None or part.first, part is None or part.last
        positions, segments = packed if packed else (positions, None)
        x = self.embed(tokens) if first else tokens  # (B, T, h), or a sequence shard under sp
        rope = self.rope(max(self.cfg.seq_length, start + (tokens.shape[1] if first else 0)), x.device)
        mask = same_example_mask(segments) if segments is not None else attention_mask
        layers = self.blocks.values() if part is None else [self.blocks[str(i)] for i in part.layers]
        for layer in layers:
            x = layer(x, rope, cache, start, mask, positions)
        if not last:
            return (x, *packed) if packed else x
        logits = self.head(self.norm(x))
        return logits if labels is None else self.criterion(logits, labels, loss_mask)

    def loss(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of the last stage's logits on a batch (megalm.data's GPT batch keys)."""
        return self.criterion(output, batch["labels"], batch.get("loss_mask"))


def same_example_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) example ids -> (B, 1, T, T) bool: query t sees keys s <= t of its own example."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, :, None] == segments[:, None, :])[:, None] & causal


def init_weights(model: nn.Module, cfg: NeoXConfig, seed: int) -> None:
    """Every parameter from (seed, global name) (megalm.models.init): N(0, init_std), the residual output
    projections (attn.proj, mlp.fc2) init_std / sqrt(2 x num_layers), norms 1, biases 0."""
    init_by_name(model, cfg, seed, VOCAB_PARAMS)
