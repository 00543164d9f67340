"""T5 as Megatron-Core builds it (arXiv:1910.10683; Megatron-LM's T5Model), single-device code.

One embedding (tokens, and learned absolute positions by default) feeds both stacks: the encoder
(bidirectional self-attention over the keys the encoder's padding mask keeps) and the decoder
(causal self-attention, then cross-attention over the encoder's output with the same key mask).
Pre-LN layers; the encoder's final norm ends its last layer, the decoder's is the model's `norm`.
The LM head is tied to the embedding (model.tie_embeddings) and has a bias (model.head_bias);
the loss is the masked mean of the cross-entropy over the decoder's targets.
`position_embedding=relative` replaces the learned positions by T5's relative position buckets:
a (buckets x heads) table for each stack, whose bias every layer of the stack adds to its
self-attention scores (as the original T5 and Hugging Face's do; they keep the table in the
stack's first layer, megalm beside the embedding, `enc_bias` and `dec_bias`).

Pipeline stages. The layers are one ModuleDict keyed by global index: the encoder's
`encoder_num_layers` first, then the decoder's, so a pipeline splits them anywhere, the split
landing inside the encoder, between the stacks or inside the decoder. The embedding (of the
encoder's and the decoder's tokens) runs on the first stage, the final norm, head and loss on the
last, and every stage boundary carries the same tensors: (encoder hidden states, encoder padding
mask, decoder hidden states), plus, with relative positions, both stacks' biases, which the
first stage computes. An encoder layer updates the first, a decoder layer the third, reading the
first as its memory; so the decoder's embedded input rides along the encoder's stages and the
encoder's output along the decoder's, and their gradients flow back the same way. Only one weight
is shared across stages, the embedding and the head, as in GPT. (The biases are made on the first
stage because the zero-bubble schedules of torch.distributed.pipelining compute a stage's weight
gradients through its inputs: a stage output that depends on weights alone would lose its
gradient there.)
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from megalm.data.samples.t5 import T5Samples
from megalm.family import Part
from megalm.models.init import init_by_name
from megalm.models.layers import MLP, Attention, AttentionCore, Encoded, TableEmbedding, build_norm
from megalm.models.losses import LMLoss
from megalm.models.t5.config import T5Config

VOCAB_PARAMS = ("embed.tok.weight", "head.weight", "head.bias")  # rows = padded vocabulary


def relative_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query): half the buckets for exact small
    distances, the rest logarithmically spaced up to max_distance; a bidirectional stack keeps
    separate halves for keys after and before the query, a causal one only looks back."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    far = exact + (torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativeBias(nn.Module):
    """The additive attention bias of relative positions: (1, heads, queries, keys) from a
    (buckets x heads) table. Under tensor parallelism each rank adds the bias of its own heads
    (`heads`, set by the plan)."""

    def __init__(self, cfg: T5Config, bidirectional: bool):
        super().__init__()
        self.table = TableEmbedding(cfg.relative_attention_num_buckets, cfg.num_attention_heads)
        self.bidirectional, self.max_distance = bidirectional, cfg.relative_attention_max_distance
        self.heads: Optional[Tuple[int, int]] = None

    def forward(self, queries: int, keys: int) -> torch.Tensor:
        device = self.table.weight.device
        relative = torch.arange(keys, device=device)[None, :] - torch.arange(queries, device=device)[:, None]
        buckets = relative_buckets(relative, self.bidirectional, self.table.num_embeddings, self.max_distance)
        weight = self.table.weight if self.heads is None else self.table.weight[:, self.heads[0]:self.heads[1]]
        return nn.functional.embedding(buckets, weight).permute(2, 0, 1)[None].contiguous()  # (1, heads, q, k)


class T5Embedding(nn.Module):
    """Token embedding plus learned positions (from 0 in each stack), then dropout."""

    def __init__(self, cfg: T5Config, vocab_rows: int):
        super().__init__()
        self.tok = TableEmbedding(vocab_rows, cfg.hidden_size)
        self.pos = TableEmbedding(cfg.max_positions, cfg.hidden_size) if cfg.position_embedding == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, start: int = 0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`positions`: (B, T) each token's own position (rows of a batch at different points); None:
        start, start + 1, ... for every row."""
        x = self.tok(tokens)
        if self.pos is not None:
            end = start + tokens.shape[1] if positions is None else int(positions.max()) + 1
            if end > self.pos.num_embeddings:
                raise ValueError(f"position {end} exceeds the {self.pos.num_embeddings} positions of the model "
                                 "(max of model.seq_length and model.decoder_seq_length)")
            x = x + self.pos(torch.arange(start, end, device=tokens.device) if positions is None else positions)
        return self.drop(x)


class CrossAttention(nn.Module):
    """Attention of the decoder's queries over the encoder's output (keys and values from it, one
    fused linear [k | v]), masked by the encoder's padding."""

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.head_dim, self.kv_heads, self.num_heads = cfg.head_dim, cfg.kv_heads, cfg.num_attention_heads
        self.q = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=cfg.bias)
        self.kv = nn.Linear(cfg.hidden_size, 2 * cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.core = AttentionCore(cfg.attention_dropout, False, cfg.attention_backend)
        self.proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor,
                kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """`kv`: the keys and values of `memory`, when computed once already (generation)."""
        q = self.q(x)
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        k, v = kv if kv is not None else self.memory_kv(memory)
        y = self.core(q, k, v, 0, mask).transpose(1, 2).reshape(B, T, -1)
        return self.dropout(self.proj(y))

    def memory_kv(self, memory: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv(memory)
        B, S, _ = kv.shape
        k, v = kv.view(B, S, -1, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        return k, v


class EncoderLayer(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); the encoder's last layer ends with its final norm
    (`norm_out`)."""

    def __init__(self, cfg: T5Config, layer_idx: int):
        super().__init__()
        self.norm1, self.norm2 = build_norm(cfg), build_norm(cfg)
        self.attn = Attention(cfg, layer_idx, causal=False)
        self.mlp = MLP(cfg)
        self.norm_out = build_norm(cfg) if layer_idx == cfg.encoder_layers - 1 else None

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """`bias`: the relative-position bias (1, heads, Te, Te), or None."""
        mask = key_mask if bias is None else torch.where(key_mask, bias, float("-inf"))
        x = x + self.attn(self.norm1(x), None, None, 0, mask)
        x = x + self.mlp(self.norm2(x))
        return self.norm_out(x) if self.norm_out is not None else x


class DecoderLayer(nn.Module):
    """x + self_attn(norm1(x)) (causal), x + cross(norm2(x), encoder output), x + mlp(norm3(x))."""

    def __init__(self, cfg: T5Config, layer_idx: int):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = build_norm(cfg), build_norm(cfg), build_norm(cfg)
        self.attn = Attention(cfg, layer_idx, causal=True)
        self.cross = CrossAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, memory: Optional[torch.Tensor], key_mask: torch.Tensor,
                bias: Optional[torch.Tensor], cache=None, start: int = 0, cross_kv=None,
                self_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`bias`: the relative-position bias of this chunk's queries (1, heads, T, start + T), or None.
        `self_mask`: the self-attention's mask when the caller made it (rows at their own positions),
        bias included; then `bias` is not read. `memory` may be None when `cross_kv` is given."""
        if self_mask is None and bias is not None:
            T, S = bias.shape[-2:]
            causal = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
            self_mask = torch.where(causal, bias, float("-inf"))
        x = x + self.attn(self.norm1(x), None, cache, start, self_mask)
        x = x + self.cross(self.norm2(x), memory, key_mask, cross_kv)
        return x + self.mlp(self.norm3(x))


class T5(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.cfg = cfg
        V = cfg.padded_vocab_size  # tp_plan pads further for tensor parallelism
        self.embed: Optional[T5Embedding] = T5Embedding(cfg, V)
        Le = cfg.encoder_layers
        self.blocks = nn.ModuleDict({str(i): (EncoderLayer(cfg, i) if i < Le else DecoderLayer(cfg, i))
                                     for i in range(cfg.num_layers)})
        relative = cfg.position_embedding == "relative"
        self.enc_bias: Optional[RelativeBias] = RelativeBias(cfg, bidirectional=True) if relative else None
        self.dec_bias: Optional[RelativeBias] = RelativeBias(cfg, bidirectional=False) if relative else None
        self.norm: Optional[nn.Module] = build_norm(cfg)
        self.head: Optional[nn.Linear] = nn.Linear(cfg.hidden_size, V, bias=cfg.head_bias)
        self.criterion: Optional[nn.Module] = LMLoss(cfg.vocab_size)
        self.metric_names: Tuple[str, ...] = ()
        self.new_heads: Tuple[str, ...] = ()
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.tok.weight

    def forward(self, *inputs: torch.Tensor, part: Optional[Part] = None):
        """(tokens (B, Te), padding_mask (B, Te), decoder_tokens (B, Td)) → logits (B, Td, V) (this
        rank's vocabulary shard under tensor parallelism).

        With `part` (a pipeline stage) only its layers run: a stage after the first takes, and one
        before the last returns, (encoder hidden, padding_mask, decoder hidden[, encoder bias,
        decoder bias]).
        """
        first, last = part is None or part.first, part is None or part.last
        biases: Tuple[torch.Tensor, ...] = ()
        if first:
            tokens, padding_mask, decoder_tokens = inputs
            enc, dec = self.embed(tokens), self.embed(decoder_tokens)
            if self.enc_bias is not None:  # over whole sequences (a shard of them under sequence parallelism)
                Te, Td = tokens.shape[1], decoder_tokens.shape[1]
                biases = (self.enc_bias(Te, Te), self.dec_bias(Td, Td))
        else:
            enc, padding_mask, dec, *rest = inputs
            biases = tuple(rest)
        enc_bias, dec_bias = biases if biases else (None, None)
        key_mask = padding_mask.bool()[:, None, None, :]  # (B, 1, 1, Te): the encoder's real tokens, as keys
        Le = self.cfg.encoder_layers
        for i in (range(self.cfg.num_layers) if part is None else part.layers):
            block = self.blocks[str(i)]
            if i < Le:
                enc = block(enc, key_mask, enc_bias)
            else:
                dec = block(dec, enc, key_mask, dec_bias)
        if not last:
            return (enc, padding_mask, dec, *biases)
        return self.head(self.norm(dec))

    def loss(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The masked mean of the cross-entropy over the decoder's targets (batch labels, loss_mask)."""
        return self.criterion(output, batch["labels"], batch["loss_mask"])

    # -- generation (one process): the encoder once, the decoder a chunk at a time with a KV cache ----
    def encode(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> "Encoded":
        """The encoder's output for (B, Te) tokens, with every decoder layer's cross-attention keys and
        values computed from it once."""
        enc = self.embed(tokens)
        key_mask = padding_mask.bool()[:, None, None, :]
        Te, Le = tokens.shape[1], self.cfg.encoder_layers
        bias = self.enc_bias(Te, Te) if self.enc_bias is not None else None
        for i in range(Le):
            enc = self.blocks[str(i)](enc, key_mask, bias)
        cross = [self.blocks[str(i)].cross.memory_kv(enc) for i in range(Le, self.cfg.num_layers)]
        return Encoded(enc, key_mask, cross)

    def decode(self, decoder_tokens: torch.Tensor, encoded: "Encoded", cache=None, start: int = 0,
               positions: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, V) of decoder tokens at positions start.. over an encoded source; `cache` (a
        megalm.models.KVCache of num_layers layers) holds the self-attention keys and values of the
        positions before `start`.

        A batch whose rows stand at different points (the server's slots) gives `positions` (B, T), each
        token's position, and `attention_mask` (B, 1, T, keys) bool, the cached keys each query sees;
        its `cache` then writes each row at its own positions."""
        T, Le = decoder_tokens.shape[1], self.cfg.encoder_layers
        end = start + T if positions is None else int(positions.max()) + 1
        if end > self.cfg.decoder_seq_length:
            raise ValueError(f"decoder position {end} exceeds model.decoder_seq_length={self.cfg.decoder_seq_length}")
        dec = self.embed(decoder_tokens, start, positions)
        bias, self_mask = None, attention_mask
        if self.dec_bias is not None:
            table = self.dec_bias(end, end)  # (1, heads, queries, keys) over every position so far
            if positions is None:
                bias = table[:, :, start:]  # this chunk's queries
            else:  # each row's queries at their own positions
                rows = table[0][:, positions].transpose(0, 1)  # (B, heads, T, keys)
                self_mask = torch.where(attention_mask, rows, float("-inf"))
        for j, i in enumerate(range(Le, self.cfg.num_layers)):
            dec = self.blocks[str(i)](dec, encoded.memory, encoded.key_mask, bias, cache, start, encoded.cross_kv[j],
                                      self_mask)
        return self.head(self.norm(dec))


def init_weights(model: nn.Module, cfg: T5Config, seed: int) -> None:
    """Every parameter from (seed, global name) (megalm.models.init): N(0, init_std), residual output
    projections (self- and cross-attention, the MLP's second linear) init_std / sqrt(2 * num_layers),
    norms 1, biases 0."""
    init_by_name(model, cfg, seed, VOCAB_PARAMS, scaled=("attn.proj.weight", "cross.proj.weight", "mlp.fc2.weight"))


def _layer_matmul_params(cfg: T5Config) -> Tuple[int, int, int]:
    """Weights multiplying each token of a layer: (self-attention + MLP, the cross-attention's q and
    output, the cross-attention's k and v: those multiply encoder tokens)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * hd + cfg.num_attention_heads * hd * h
    mlp = h * cfg.ffn_size * (3 if cfg.activation == "swiglu" else 2)
    return attn + mlp, 2 * h * cfg.num_attention_heads * hd, 2 * h * cfg.kv_heads * hd


def flops_per_token(cfg: T5Config, seq_length: Optional[int] = None) -> float:
    """Training FLOPs per encoder token (tokens/s counts the encoder's): megalm.models.flops's
    definition over a whole sample, divided by the encoder length. The encoder's layers act on
    Te tokens, the decoder's on Td (their cross-attention's k / v on the Te encoder tokens), the
    head on Td; attention costs 12·s·h_attn a token and layer (self: over s = Te or Td keys;
    cross: Td queries over Te keys)."""
    Te, Td = seq_length or cfg.seq_length, cfg.decoder_seq_length
    h_attn = cfg.num_attention_heads * cfg.head_dim
    layer, cross_q, cross_kv = _layer_matmul_params(cfg)
    Le, Ld = cfg.encoder_layers, cfg.decoder_layers
    matmul = Le * layer * Te + Ld * ((layer + cross_q) * Td + cross_kv * Te) + cfg.hidden_size * cfg.padded_vocab_size * Td
    attention = 12.0 * h_attn * (Le * Te * Te + Ld * (Td * Td + Td * Te))
    return (6.0 * matmul + attention) / Te


def samples(cfg: T5Config):
    """How T5's training samples are made (megalm.data.samples.t5)."""
    return T5Samples(cfg)


