"""T5's model schema (T5Config) and its own config rules (`validate`, after the shared ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalm.config import ModelConfig
from megalm.errors import ConfigError

POSITION_EMBEDDINGS = ("learned", "relative")


@dataclass
class T5Config(ModelConfig):
    """T5's model schema: the shared transformer fields and its own. `num_layers` counts both stacks'
    layers, `seq_length` is the encoder's length."""
    arch: str = "t5"
    """t5 (encoder-decoder, span-corruption pretraining)."""
    activation: str = "gelu_exact"
    """gelu_exact (Megatron's T5) | gelu | relu (the original T5) | swiglu."""
    encoder_num_layers: Optional[int] = None
    """Layers of the encoder (the first ones); the decoder has the rest. None: half of num_layers."""
    decoder_seq_length: int = 128
    """Tokens of the decoder's input and targets (Megatron's --decoder-seq-length)."""
    position_embedding: str = "learned"
    """learned (absolute, one table for both stacks: Megatron's default) | relative (T5's buckets)."""
    relative_attention_num_buckets: int = 32
    """Buckets of relative positions (position_embedding=relative)."""
    relative_attention_max_distance: int = 128
    """Distance from which all relative positions share the last bucket."""
    tie_embeddings: bool = True
    """The LM head's weight is the embedding's."""
    head_bias: bool = True
    """A bias on the LM head's logits (Megatron's T5 has one; Hugging Face's has none)."""
    kv_channels: Optional[int] = None
    """Channels of each attention head; None: hidden_size / num_attention_heads (T5 3B and 11B: 128)."""

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def encoder_layers(self) -> int:
        return self.encoder_num_layers if self.encoder_num_layers is not None else self.num_layers // 2

    @property
    def decoder_layers(self) -> int:
        return self.num_layers - self.encoder_layers

    @property
    def max_positions(self) -> int:
        return max(self.seq_length, self.decoder_seq_length)


def validate(cfg, world_size: int) -> None:
    m = cfg.model
    if m.position_embedding not in POSITION_EMBEDDINGS:
        raise ConfigError(f"model.position_embedding={m.position_embedding!r} is not one of "
                          f"{', '.join(POSITION_EMBEDDINGS)} (T5)")
    if not 1 <= m.encoder_layers < m.num_layers:
        raise ConfigError(f"model.encoder_num_layers={m.encoder_num_layers} must leave both stacks a layer: "
                          f"between 1 and model.num_layers - 1 = {m.num_layers - 1}")
    if m.decoder_seq_length < 2:
        raise ConfigError(f"model.decoder_seq_length={m.decoder_seq_length} must be at least 2")
    if m.position_embedding == "relative":
        if m.relative_attention_num_buckets < 4:
            raise ConfigError(f"model.relative_attention_num_buckets={m.relative_attention_num_buckets} must be "
                              "at least 4")
        if m.relative_attention_max_distance <= m.relative_attention_num_buckets // 4:
            raise ConfigError(f"model.relative_attention_max_distance={m.relative_attention_max_distance} must be "
                              f"above a quarter of the buckets ({m.relative_attention_num_buckets // 4})")
    if cfg.data.source not in ("mock", "indexed", "stdlib_prose", "sft"):
        raise ConfigError(f"data.source={cfg.data.source!r}: T5 trains on span corruption of sentence-split text "
                          "(data=stdlib_prose_t5, data=indexed with a corpus from preprocess_data.py --split-sentences, "
                          "data=mock) or on source / target pairs (data=sft)")
    if cfg.data.source == "sft" and cfg.data.packing:
        raise ConfigError("data.packing=true packs examples for decoder models; T5 reads one pair a sample: "
                          "set data.packing=false")
