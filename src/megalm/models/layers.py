"""Transformer building blocks in plain single-device PyTorch.

No parallel code lives here: tensor parallelism swaps these modules' linears from outside
(megalm.parallel), so the projections are kept as separate, named nn.Linear modules with the
fused layouts a TP plan knows how to split (QKV stacked as [q | k | v], SwiGLU as [gate | up]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.ops.attention import Uniform, attention_backend, unfused_attention
from megalm.ops.embedding import lookup


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)


def _in_weight_dtype(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     weight: Optional[torch.Tensor]) -> torch.Tensor:
    """A norm over a half-precision input with weights of that dtype (trainer.mixed_precision=main_params) runs in
    that dtype with autocast off: CUDA's autocast would cast input and weights to fp32 and keep the fp32 copy of the
    input for backward, twice the bytes; the kernels accumulate the statistics in fp32 either way. As Megatron's
    fused norms do, the input is kept in the compute dtype. Any other input (fp32, or half precision against fp32
    weights under trainer.mixed_precision=autocast) runs as autocast decides, unchanged."""
    if weight is None or x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16) \
            or not torch.is_autocast_enabled(x.device.type):
        return forward(x)
    with torch.autocast(x.device.type, enabled=False):
        return forward(x)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm, kept in the compute dtype under low-precision weights (`_in_weight_dtype`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_weight_dtype(super().forward, x, self.weight)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm, kept in the compute dtype under low-precision weights (`_in_weight_dtype`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_weight_dtype(super().forward, x, self.weight)


def rope_tables(head_dim: int, max_len: int, theta: float, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of RoFormer's rotation angles (arXiv:2104.09864), each (max_len, head_dim / 2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of x (B, nh, T, hd) by the angles of its positions: (T, hd/2),
    or (B, T, hd/2) when each row has positions of its own (packed examples)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos[None, None], sin[None, None])
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class KVCache:
    """Keys and values of past positions for incremental decoding, one pair per layer."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device=None, dtype=torch.float32):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked for {end}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


@dataclass
class Encoded:
    """A source run through an encoder-decoder's encoder (its `encode`; its `decode` reads it): its output,
    its key mask and each decoder layer's cross-attention keys and values."""
    memory: Optional[torch.Tensor]
    """None where only the keys and values are kept (the server's slots)."""
    key_mask: torch.Tensor
    cross_kv: List[Tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    """Self-attention with grouped-query heads (arXiv:2305.13245) on SDPA: causal (decoders), or
    bidirectional over the keys a padding mask keeps (encoders: `causal=False`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, causal: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.num_heads + 2 * self.kv_heads) * self.head_dim, bias=cfg.bias)
        self.core = AttentionCore(cfg.attention_dropout, causal, cfg.attention_backend)
        self.proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                cache: Optional[KVCache] = None, start: int = 0, mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`mask`: (B, 1, 1, T) bool, the keys each query may attend to (bidirectional attention), or
        (B, 1, T, T) with the causal mask in it (packed examples). `positions`: (B, T) each token's
        position for RoPE (packed examples restart at 0); None: start, start + 1, ..."""
        qkv = self.qkv(x)  # (B, T, (nh + 2 nkv) hd); T is the full sequence even when x is a shard
        B, T, width = qkv.shape
        # Head counts come from the width, so a tensor-parallel shard of qkv works unchanged.
        q_size = width * self.num_heads // (self.num_heads + 2 * self.kv_heads)
        kv_size = (width - q_size) // 2
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if rope is not None and positions is not None:
            cos, sin = rope[0][positions], rope[1][positions]  # (B, T, hd/2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif rope is not None:
            cos, sin = rope[0][start:start + T], rope[1][start:start + T]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, start, k, v)
        y = self.core(q, k, v, start, mask) if mask is not None else self.core(q, k, v, start)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.dropout(self.proj(y))


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(hd)) v with the causal mask, or (causal=False) a key mask; no parameters.
    On SDPA, or with `backend` (model.attention_backend; see `attention_backend`) as separate ops.

    A module of its own so the parallel code can wrap it (dropout RNG stream, recomputation).
    """

    def __init__(self, attention_dropout: float, causal: bool = True, backend: str = "auto"):
        super().__init__()
        self.attention_dropout, self.causal, self.backend = attention_dropout, causal, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
                mask: Optional[torch.Tensor] = None, uniform: Optional[Uniform] = None) -> torch.Tensor:
        """`uniform`: where the attention dropout's random numbers come from (`dropout_with`), given by
        the parallel code for a tp stream inside a compiled graph; the unfused ops run then, since
        SDPA draws its own."""
        T, S = q.shape[2], k.shape[2]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout = self.attention_dropout if self.training else 0.0
        causal = self.causal and mask is None and T > 1
        if (uniform is not None and dropout > 0) or \
                attention_backend(self.backend, q.device.type, q.dtype, torch.compiler.is_compiling()) == "unfused":
            return unfused_attention(q, k, v, mask, causal, dropout, uniform)
        if not causal:  # a key mask, a causal one per packed example, or one query
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        if S != T:
            # A chunk after a cached prefix: query t sees every cached key and the chunk up to itself.
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)


class MLP(nn.Module):
    """GELU MLP (GPT-2), ReLU (the original T5) or SwiGLU (arXiv:2002.05202) with gate and up stacked in one linear."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        width = cfg.ffn_size * (2 if cfg.activation == "swiglu" else 1)
        self.fc1 = nn.Linear(cfg.hidden_size, width, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.recompute_activation = False  # set by megalm.parallel.recompute (parallel.recompute_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        # (ReLU keeps its output for its own backward, and would keep fc1's output here instead: nothing to save)
        if self.recompute_activation and self.activation != "relu" and torch.is_grad_enabled() \
                and not torch.compiler.is_compiling():
            return self.dropout(_linear_recomputing_input(self.fc2, h, self.activation))
        return self.dropout(self.fc2(activate(h, self.activation)))


def _linear_recomputing_input(linear: nn.Module, h: torch.Tensor, activation: str) -> torch.Tensor:
    """linear(activate(h)), the activation's output freed once linear's forward has saved it, and computed again
    from h into the same storage when backward reaches linear's output (a pre-hook on its node, which runs before
    any of linear's own backward, including a zero-bubble schedule's later weight pass). h is kept anyway by the
    activation's backward; the recomputation is the same kernel on the same input, so the same bits. As Megatron's
    activation recomputation of its experts (--recompute-modules moe_act, checkpointing without the output)."""
    a = activate(h, activation)
    y = linear(a)
    if y.grad_fn is None:
        return y
    storage, nbytes, source = a.untyped_storage(), a.untyped_storage().nbytes(), h.detach()

    def refill(grad_outputs):
        if storage.nbytes() == 0:
            with torch.no_grad():
                again = activate(source, activation)
            storage.resize_(nbytes)
            storage.copy_(again.untyped_storage())

    y.grad_fn.register_prehook(refill)
    storage.resize_(0)
    return y


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """An MLP's nonlinearity on fc1's output: swiglu (h = [gate | up]), relu, gelu_exact, or gelu (tanh)."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "relu":
        return F.relu(h)
    return gelu(h, exact=activation == "gelu_exact")


_GELU_TANH_SCALE = 2 * math.sqrt(2 / math.pi)


def gelu(h: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """GELU: exact (erf) or its tanh approximation 0.5 h (1 + tanh(u)), u = sqrt(2 / pi) (h + 0.044715 h^3).

    Inside a compiled graph the approximation is written as h * sigmoid(2 u), the same function:
    inductor's generated code pays about three exps' time for a tanh on CPU, and the sigmoid form
    measured 2.0-2.2x faster forward + backward there (docs/PERFORMANCE.md). Eagerly aten's one gelu
    kernel beats the several ops the sigmoid form would be.
    """
    if exact:
        return F.gelu(h)
    if torch.compiler.is_compiling():
        return h * torch.sigmoid(_GELU_TANH_SCALE * h * (1 + 0.044715 * h * h))
    return F.gelu(h, approximate="tanh")


class TableEmbedding(nn.Embedding):
    """nn.Embedding (its parameters and options) looked up by `lookup` when none of its options is set."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.padding_idx is None and self.max_norm is None and not self.scale_grad_by_freq and not self.sparse:
            return lookup(ids, self.weight)
        return super().forward(ids)


class Embedding(nn.Module):
    """Token embedding, plus learned positions when the model has them, then dropout."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int):
        super().__init__()
        self.tok = TableEmbedding(padded_vocab, cfg.hidden_size)
        self.pos = TableEmbedding(cfg.seq_length, cfg.hidden_size) if cfg.position_embedding == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, start: int = 0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`positions`: (B, T) each token's position (packed examples restart at 0); None: from `start` on."""
        x = self.tok(tokens)  # (B, T, h)
        if self.pos is not None and positions is not None:
            x = x + self.pos(positions)
        elif self.pos is not None:
            T = tokens.shape[1]
            if start + T > self.pos.num_embeddings:
                raise ValueError(f"position {start + T} exceeds model.seq_length={self.pos.num_embeddings}")
            x = x + self.pos(torch.arange(start, start + T, device=tokens.device))
        return self.drop(x)


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm1 = build_norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        self.norm2 = build_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope=None, cache=None, start=0, mask=None, positions=None):
        x = x + self.attn(self.norm1(x), rope, cache, start, mask, positions)
        return x + self.mlp(self.norm2(x))


class LMHead(nn.Linear):
    """The output head: an nn.Linear whose call can hand its input and weight to a consumer that fuses
    the matmul into itself (`fuse(x, weight)`, the chunked loss). Going through the module's call keeps
    hooks on it working (ZeRO-3 gathers the weight in one); ColumnParallelLinear takes `fuse` too."""

    def forward(self, x: torch.Tensor, fuse: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
                ) -> torch.Tensor:
        if fuse is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            raise ValueError("a fused head + loss takes a head without a bias")
        return fuse(x, self.weight)


def output_init_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init of residual output projections: std / sqrt(2 * layers)."""
    return cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
