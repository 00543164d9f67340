"""BERT's model schema (BertConfig) and its own config rules (`validate`, after the shared ones)."""

from __future__ import annotations

from dataclasses import dataclass

from megalm.config import ModelConfig
from megalm.errors import ConfigError

NORM_POSITIONS = ("pre", "post")


@dataclass
class BertConfig(ModelConfig):
    """BERT's model schema: the shared transformer fields and its own."""
    arch: str = "bert"
    """bert (bidirectional encoder, masked-LM pretraining)."""
    activation: str = "gelu_exact"
    """gelu_exact (erf, as Megatron's and Hugging Face's BERT) | gelu (tanh approximation) | swiglu."""
    num_tokentypes: int = 2
    """Token-type (segment) embeddings: 2 for sentence pairs, 0 for none."""
    binary_head: bool = True
    """The sentence-order prediction head and loss (Megatron's --bert-binary-head; samples then hold two segments)."""
    norm_position: str = "pre"
    """pre (Megatron: norm before each sub-layer, a final norm) | post (original BERT / Hugging Face)."""
    num_labels: int = 0
    """0: pretraining heads (MLM, sentence order); N >= 2: a classifier over N classes, 1: a regressor (fine-tuning)."""
    num_choices: int = 0
    """0: not multiple choice; N >= 2: each example is N (context, choice) sequences, one score each from the
    pooled output, softmax over the N (Megatron's RACE model; fine-tuning)."""
    span_head: bool = False
    """Extractive QA (fine-tuning): start and end logits on every token (SQuAD), in place of the pretraining heads."""

    @property
    def fine_tuning_head(self) -> bool:
        """A classifier, a multiple-choice scorer or a span head replaces the pretraining heads."""
        return bool(self.num_labels or self.num_choices or self.span_head)


def validate(cfg, world_size: int) -> None:
    m = cfg.model
    if cfg.data.source == "sft":
        raise ConfigError("data.source=sft fine-tunes decoder models on responses; BERT (model.arch=bert) "
                          "does not generate")
    if cfg.data.source == "stdlib":
        raise ConfigError("data.source=stdlib is Python code, not sentences: BERT trains on sentence-split text; use "
                          "data=stdlib_prose (the stdlib's docstrings), data=indexed with a corpus from "
                          "preprocess_data.py --split-sentences, or data=mock")
    if cfg.data.source != "mock" and not 1 <= cfg.trainer.seed < 2**31:
        raise ConfigError(f"trainer.seed={cfg.trainer.seed}: BERT's sample index (megatron-core's build_mapping) "
                          "takes a seed in [1, 2**31)")
    if m.norm_position not in NORM_POSITIONS:
        raise ConfigError(f"model.norm_position={m.norm_position!r} is not one of {', '.join(NORM_POSITIONS)}")
    if m.num_tokentypes < 0:
        raise ConfigError(f"model.num_tokentypes={m.num_tokentypes} must not be negative")
    if m.binary_head and m.num_tokentypes < 2:
        raise ConfigError(f"model.binary_head=true reads sentence pairs, which need model.num_tokentypes >= 2 "
                          f"(it is {m.num_tokentypes}); set model.binary_head=false or model.num_tokentypes=2")
