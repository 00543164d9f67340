"""GPT-NeoX's model schema (NeoXConfig) and its own config rules (`validate`, after the shared ones)."""

from __future__ import annotations

from dataclasses import dataclass

from megalm.config import ModelConfig
from megalm.errors import ConfigError

ACTIVATIONS = ("gelu_exact", "gelu", "relu")
"""The ungated MLPs a NeoX layer may have (Pythia: gelu_exact)."""


@dataclass
class NeoXConfig(ModelConfig):
    """GPT-NeoX's model schema (arXiv:2204.06745; the Pythia suite, arXiv:2304.01373): the shared
    transformer fields and its own."""
    arch: str = "neox"
    """neox (decoder-only; GPT-NeoX-20B and Pythia presets)."""
    activation: str = "gelu_exact"
    """gelu_exact (erf: Pythia's and NeoX-20B's "gelu") | gelu (tanh approximation) | relu."""
    rotary_pct: float = 0.25
    """Share of each head's channels that RoPE rotates (the first ones); the rest pass unrotated (Pythia: 0.25)."""
    rotary_emb_base: float = 10000.0
    """RoPE base frequency of the rotated channels."""
    use_parallel_residual: bool = True
    """x + attn(norm1(x)) + mlp(norm2(x)) from one residual (GPT-J / NeoX); false: attention, then the MLP."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head (NeoX and Pythia keep them apart)."""

    @property
    def rotary_dims(self) -> int:
        """Channels of each head that rotate: int(head_dim x rotary_pct), truncated as Hugging Face's."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def position_embedding(self) -> str:
        """Always "rope": NeoX has no position table (what the shared Embedding and the planner ask)."""
        return "rope"


def validate(cfg, world_size: int) -> None:
    m = cfg.model
    if cfg.data.source in ("classification", "qa"):
        raise ConfigError(f"data.source={cfg.data.source} fine-tunes a score or span head, which the neox family "
                          "does not have; fine-tune a NeoX model with data=sft, or use a gpt / bert preset")
    if m.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation={m.activation!r}: a NeoX MLP is ungated; allowed: {', '.join(ACTIVATIONS)}")
    if m.normalization != "layernorm":
        raise ConfigError(f"model.normalization={m.normalization!r}: NeoX's norms are LayerNorms; allowed: layernorm")
    if m.num_query_groups not in (None, m.num_attention_heads):
        raise ConfigError(f"model.num_query_groups={m.num_query_groups}: NeoX gives every head its own keys and values; "
                          f"allowed: null or {m.num_attention_heads} (= num_attention_heads)")
    if not 0 < m.rotary_pct <= 1:
        raise ConfigError(f"model.rotary_pct={m.rotary_pct} must be in (0, 1]: the share of each head that rotates")
    if m.rotary_dims < 2 or m.rotary_dims % 2:
        raise ConfigError(f"model.rotary_pct={m.rotary_pct} of a head of {m.head_dim} channels rotates "
                          f"{m.rotary_dims}: RoPE turns channel pairs, so it must be an even number, at least 2")
    if not m.rotary_emb_base > 1:
        raise ConfigError(f"model.rotary_emb_base={m.rotary_emb_base} must be above 1 (Pythia: 10000)")
