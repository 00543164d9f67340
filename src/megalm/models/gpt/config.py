"""GPT's model schema (GPTConfig) and its own config rules (`validate`, after the shared ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalm.config import ModelConfig
from megalm.errors import ConfigError, did_you_mean

POSITION_EMBEDDINGS = ("learned", "rope")


@dataclass
class GPTConfig(ModelConfig):
    """GPT's model schema: the shared transformer fields and its own."""
    arch: str = "gpt"
    """gpt (decoder-only; GPT-2/3 and Llama-style presets)."""
    position_embedding: str = "learned"
    """learned | rope."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    num_labels: int = 0
    """0: the language-model head; N >= 2: a classifier over N classes, 1: a regressor, read at the last real
    token (fine-tuning; data=classification)."""
    num_choices: int = 0
    """0: not multiple choice; N >= 2: each example is N (context, choice) sequences, one score each at its
    last token, softmax over the N (fine-tuning)."""
    fused_loss: bool = False
    """Training computes the head and cross-entropy together, loss_chunk_tokens tokens at a time, never holding the
    whole logits (megalm.ops.fused_loss); the same loss and gradients. Off by default: docs/PERFORMANCE.md."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the fused loss: its logits, (chunk, vocabulary / tp) in fp32, are the most it holds."""
    fused_loss_backward: str = "in_forward"
    """in_forward | recompute: the fused loss makes its gradients in forward (three matmuls, as unfused; keeps the
    input gradient and an fp32 weight gradient until backward) or recomputes each chunk's logits in backward (four;
    keeps the head input alone: the smaller store when many micro-batches await backward at a large vocabulary)."""
    num_experts: int = 0
    """0: a dense MLP in every layer; E >= 2: a mixture of E experts of ffn_size each (megalm.models.moe)."""
    moe_router_topk: int = 2
    """Experts each token runs (Mixtral: 2)."""
    moe_router_score_function: str = "softmax"
    """softmax | sigmoid: how router logits become scores (the k chosen are renormalised to sum to 1)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient (Megatron's --moe-aux-loss-coeff; 1e-2 is usual, 0: off)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient (Megatron's --moe-z-loss-coeff; 1e-3 is usual, 0: off)."""
    moe_capacity_factor: Optional[float] = None
    """None: dropless (every assignment runs); f > 0: each expert takes ceil(f x tokens x k / E) assignments, its
    highest-scored, and drops the rest."""

    @property
    def fine_tuning_head(self) -> bool:
        """A classifier or a multiple-choice scorer replaces the language-model head."""
        return bool(self.num_labels or self.num_choices)


def validate(cfg, world_size: int) -> None:
    m = cfg.model
    if cfg.data.source == "qa":
        raise ConfigError("data.source=qa trains BERT's span head (model=bert_* model.span_head=true); fine-tune GPT "
                          "for question answering with data=sft")
    if m.position_embedding not in POSITION_EMBEDDINGS:
        raise ConfigError(f"model.position_embedding={m.position_embedding!r} is not one of "
                          f"{', '.join(POSITION_EMBEDDINGS)}{did_you_mean(str(m.position_embedding), POSITION_EMBEDDINGS)}")
    if m.head_dim % 2 and m.position_embedding == "rope":
        raise ConfigError(f"rope needs an even head dim; hidden_size / heads = {m.head_dim}")
    if m.num_experts:
        _validate_moe(cfg)


MOE_SCORES = ("softmax", "sigmoid")


def _validate_moe(cfg) -> None:
    m, p = cfg.model, cfg.parallel
    if m.num_experts < 2:
        raise ConfigError(f"model.num_experts={m.num_experts}: a mixture needs at least 2 experts (0: a dense MLP)")
    if not 1 <= m.moe_router_topk <= m.num_experts:
        raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must be in 1..model.num_experts={m.num_experts}")
    if m.moe_router_score_function not in MOE_SCORES:
        raise ConfigError(f"model.moe_router_score_function={m.moe_router_score_function!r} is not one of "
                          f"{', '.join(MOE_SCORES)}")
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must not be negative")
    if m.moe_capacity_factor is not None and not m.moe_capacity_factor > 0:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} must be positive (or null: dropless)")
    if getattr(m, "fine_tuning_head", False):
        raise ConfigError("model.num_experts with a fine-tuning head is not supported; fine-tune a mixture of "
                          "experts with its language-model head (data=sft)")
    if p.tp > 1 and m.seq_length % (p.tp * p.cp):
        raise ConfigError(f"model.num_experts={m.num_experts} with parallel.tp={p.tp}: each tp rank routes its share "
                          f"of the sequence, which model.seq_length={m.seq_length} (per cp rank: / {p.cp}) must "
                          "divide into")
    for key, value in (("tp", p.tp), ("cp", p.cp)):
        if value > 1 and m.moe_capacity_factor is not None:
            raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} with parallel.{key}={value}: an "
                              f"expert's capacity is chosen over a micro-batch's tokens, which {key} splits over "
                              "ranks; use dropless routing (model.moe_capacity_factor=null)")
