"""Decoder-only GPT / Llama-style language model, single-device code.

Blocks live in a ModuleDict keyed by their *global* layer index, and the embedding, final
norm and head may be absent (a pipeline stage holds only some of them), so parameter names
are the same at every parallel layout: `blocks.7.attn.qkv.weight` is layer 7 everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import functools

import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.errors import ConfigError, did_you_mean
from megalm.models.family import Family, Part, Parts
from megalm.models.flops import flops_per_token as transformer_flops
from megalm.models.fused_loss import LMHead
from megalm.models.losses import LMLoss, classification_loss, fold_choices
from megalm.models.init import init_by_name
from megalm.models.layers import Block, Embedding, KVCache, build_norm, rope_tables


VOCAB_PARAMS = ("embed.tok.weight", "head.weight")  # rows = padded vocabulary
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
    whole logits (megalm.models.fused_loss); the same loss and gradients. Off by default: docs/PERFORMANCE.md."""
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


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Padded as Megatron pads (tp_plan pads further for tensor parallelism); the padding is
        # masked in the loss and never sampled, so results do not depend on it.
        V = cfg.padded_vocab_size
        h = cfg.hidden_size
        self.embed: Optional[Embedding] = Embedding(cfg, V)
        self.moe_stats = None
        if getattr(cfg, "num_experts", 0):
            from megalm.models.moe import MoE, MoEStats
            self.moe_stats = MoEStats()  # what the layers' routers report, and their aux losses' gradient scale
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        if self.moe_stats is not None:
            for i, block in self.blocks.items():
                block.mlp = MoE(cfg, self.moe_stats, int(i))
        self.norm: Optional[nn.Module] = build_norm(cfg)
        self.head: Optional[nn.Linear] = LMHead(h, V, bias=False)
        self.criterion: Optional[nn.Module] = LMLoss(cfg.vocab_size)
        self.score: Optional[nn.Linear] = None
        self.metric_names: Tuple[str, ...] = ()
        """What `loss_and_metrics` reports beside the loss (the trainer logs them)."""
        self.new_heads: Tuple[str, ...] = ()
        """Modules a fine-tuning start initialises afresh: a pretrained checkpoint does not hold them."""
        if getattr(cfg, "fine_tuning_head", False):  # the score head at the last real token replaces the LM head
            self.head = self.criterion = None
            self.score = nn.Linear(h, cfg.num_labels or 1, bias=False)
            self.metric_names, self.new_heads = (() if cfg.num_labels == 1 else ("acc",)), ("score",)
        self.fused_loss = bool(getattr(cfg, "fused_loss", False)) and self.head is not None
        """model.fused_loss: in training the last stage returns the final-normed hidden states and `loss`
        runs the head fused with the cross-entropy; in eval mode the forward still returns logits."""
        self.tie_weights()
        self._rope: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.context = None  # context parallelism (megalm.parallel.context): this rank's place in the sequence

    def tie_weights(self) -> None:
        """Share embedding and head weights (megalm.parallel.materialize keeps shared weights shared)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.tok.weight

    def rope(self, length: int, device: torch.device):
        if self.cfg.position_embedding != "rope":
            return None
        if torch.compiler.is_compiling():
            # Traced into the graph: a cache filled on the first call would fail the compiled graph's guards on
            # the second and compile the whole forward again.
            return rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device)
        key = (device, length)
        if key not in self._rope:
            # Tables are recomputed rather than stored as buffers so meta-device init needs no fix-up.
            self._rope = {key: rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device)}
        return self._rope[key]

    def forward(self, tokens: torch.Tensor, *packed: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                start: int = 0, part: Optional[Part] = None, positions: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        """tokens (B, T) ids → logits (B, T, V); with labels (B, T) → mean cross-entropy loss. With a
        fine-tuning head, the score head's (B, T, num_labels or 1) at every position (`predictions`
        reads the last real token's); multiple choice takes tokens (B, C, T).

        `packed` = (position_ids, segment_ids), each (B, T), for sequences of several packed
        examples: positions restart and attention stays inside each example (segment), as
        Megatron's --reset-position-ids and --reset-attention-mask do.
        `positions` (B, T) and `attention_mask` (B, 1, T, S) bool: each row's own positions and the keys
        its queries see, for a batch whose rows stand at different points of their sequences (the
        serving engine's cache slots: megalm.serve.engine).
        With `part` (a pipeline stage) only its layers run: a stage after the first takes the
        hidden states (B, T, h) in place of tokens (and `packed` after them), and one before the
        last returns them (with `packed`).
        With model.fused_loss, in training mode and without labels the last stage returns the
        final-normed hidden states (B, T, h) (a sequence shard under SP), which `loss` turns into
        the loss without making the logits whole; in eval mode (generation, evaluation) logits.
        """
        if packed and len(packed) != 2:
            raise TypeError(f"GPT.forward got {len(packed) + 1} positional inputs: after tokens it takes "
                            "(position_ids, segment_ids) of packed examples; pass labels and loss_mask by keyword")
        first, last = part is None or part.first, part is None or part.last
        if first and self.cfg.num_choices:
            tokens, = fold_choices((tokens,), self.cfg.num_choices)
        positions, segments = packed if packed else (positions, None)
        if first:
            # Context parallelism: this rank's tokens are two chunks of the sequence, at their own positions.
            where = positions if positions is not None or self.context is None else \
                self.context.positions(tokens.shape[1], tokens.device)
            x = self.embed(tokens, start, where)  # (B, T, h), or a sequence shard under SP
        else:
            x = tokens
        rope = self.rope(max(self.cfg.seq_length, start + (tokens.shape[1] if first else 0)), x.device)
        mask = packed_attention_mask(segments) if segments is not None else attention_mask
        blocks = self.blocks.values() if part is None else [self.blocks[str(i)] for i in part.layers]
        for block in blocks:
            x = block(x, rope, cache, start, mask, positions) if positions is not None else block(x, rope, cache, start)
        if not last:
            return (x, *packed) if packed else x
        if self.score is not None:
            return self.score(self.norm(x))
        x = self.norm(x)
        if labels is not None:
            return self._lm_loss(x if self.fused_loss else self.head(x), labels, loss_mask, hidden=self.fused_loss)
        if self.fused_loss and self.training:
            return x  # `loss` applies the head
        return self.head(x)  # (B, T, V), or this rank's vocabulary shard under TP

    def loss(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of the last stage's output (logits; with model.fused_loss in training, the
        final-normed hidden states) on a batch (megalm.data.gpt_batch's keys)."""
        if self.score is not None:
            return self.loss_and_metrics(output, batch)[0]
        return self._lm_loss(output, batch["labels"], batch.get("loss_mask"), hidden=self.fused_loss and self.training)

    def _lm_loss(self, output: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                 hidden: bool) -> torch.Tensor:
        """The criterion on logits, or (hidden) on the head's input through the head's own call, so that
        hooks on the head (ZeRO-3's gather) fire around the fused matmuls."""
        if not hidden:
            return self.criterion(output, labels, loss_mask)
        fuse = functools.partial(self.criterion.from_hidden, labels=labels, loss_mask=loss_mask,
                                 chunk_tokens=self.cfg.loss_chunk_tokens,
                                 backward=self.cfg.fused_loss_backward)
        return self.head(output, fuse=fuse)

    def loss_and_metrics(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]):
        """A fine-tuning head's loss (cross-entropy, or MSE for a regression) and accuracy."""
        return classification_loss(self.predictions(output, batch), batch["label"], regression=self.cfg.num_labels == 1)

    def predictions(self, output: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The score head's output at each sequence's last real token (batch["last"]): (B, num_labels),
        or (B, C) scores of multiple choice."""
        last = batch["last"].reshape(-1)
        scores = output[torch.arange(len(last), device=output.device), last]
        return scores.view(-1, self.cfg.num_choices) if self.cfg.num_choices else scores


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) example ids → (B, 1, T, T) bool: query t sees keys s <= t of its own example."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, :, None] == segments[:, None, :])[:, None] & causal


def flops_per_token(cfg: ModelConfig, seq_length: Optional[int] = None) -> float:
    """megalm.models.flops's definition; a fine-tuning head's h x (num_labels or 1) score in place of the LM head."""
    if getattr(cfg, "fine_tuning_head", False):
        return transformer_flops(cfg, seq_length) - 6.0 * cfg.hidden_size * (cfg.padded_vocab_size - (cfg.num_labels or 1))
    return transformer_flops(cfg, seq_length)


def samples(cfg: ModelConfig):
    """GPT's samples: packed token sequences, or classification examples (megalm.data.loader.GPTSamples)."""
    from megalm.data.loader import GPTSamples
    return GPTSamples(cfg)


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every parameter from (seed, global name) (megalm.models.init): N(0, init_std), residual
    output projections (attn.proj, mlp.fc2) init_std / sqrt(2 * num_layers), norms 1, biases 0."""
    init_by_name(model, cfg, seed, VOCAB_PARAMS)


def tp_plan(cfg: ModelConfig, tp: int, sp: bool) -> List[Tuple[str, object]]:
    """Megatron's tensor-parallel layout of GPT (arXiv:1909.08053, sec. 3; sequence parallel:
    arXiv:2205.05198): in each block the fused QKV and the MLP's first linear are column-parallel
    (whole heads, a slice of the ffn), the attention output and the second linear row-parallel;
    the embedding, head and loss are vocabulary-parallel."""
    from megalm.parallel.tp_plan import (ColumnParallel, GatherSequence, RowParallel, ScatterSequence, SequenceParallelParams,
                                         TPRandom, VocabParallel, VocabParallelLoss)
    rows = cfg.padded_vocab(tp)
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    learned_pos = cfg.position_embedding == "learned"
    plan: List[Tuple[str, object]] = []
    if sp and getattr(cfg, "fine_tuning_head", False):
        plan += [("score", GatherSequence())]  # it reads each sequence's last real token: the whole sequence
    if sp and not learned_pos:
        # No position table to add after the lookup: reduce-scatter the partial sums straight
        # into sequence shards (half the bytes of an all-reduce) and drop out on the shard.
        plan += [("embed.tok", VocabParallel(rows, reduce="reduce_scatter")), ("embed.drop", TPRandom())]
    else:
        plan += [("embed.tok", VocabParallel(rows))]
        if sp:  # positions and dropout on the full (replicated) sequence, then keep this rank's part
            plan += [("embed", ScatterSequence())]
    plan += [
        ("blocks.*.attn.qkv", ColumnParallel(segments=(q, kv, kv))),
        ("blocks.*.attn.proj", RowParallel()),
        ("blocks.*.attn.core", TPRandom()),  # attention dropout over this rank's heads
        ("blocks.*.mlp.fc1", ColumnParallel(segments=(f, f) if cfg.activation == "swiglu" else None)),
        ("blocks.*.mlp.fc2", RowParallel()),
    ]
    if sp:
        plan += [(f"blocks.*.{name}", TPRandom()) for name in ("attn.dropout", "mlp.dropout")]
        plan += [(name, SequenceParallelParams()) for name in ("blocks.*.norm1", "blocks.*.norm2", "norm")]
    plan += [("head", ColumnParallel(rows=rows)), ("criterion", VocabParallelLoss(rows))]
    return plan


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


FAMILY = Family(
    name="gpt", config=GPTConfig, build=GPT, init_weights=init_weights, validate=validate, flops_per_token=flops_per_token, tp_plan=tp_plan,
    parts=Parts(layers="blocks", first=("embed",), last=("norm", "head", "criterion", "score"), selective=("attn.core",)),
    samples=samples,
    hf="megalm.models.gpt_hf", vocab_params=VOCAB_PARAMS, tied=(("head.weight", "embed.tok.weight"),),
    optional_inputs=("position_ids", "segment_ids"))
