"""BERT as Megatron builds it (arXiv:1810.04805; Megatron-LM, arXiv:1909.08053), single-device code.

Token, learned position and token-type embeddings; bidirectional self-attention over the keys
the padding mask keeps; pre-LN blocks and a final norm by default (Megatron), post-LN as an
option (`norm_position=post`: the original BERT and Hugging Face's, with a norm after the
embeddings instead of a final one). Heads: a pooler (token 0 -> dense -> tanh), the MLM head
(dense -> GELU -> norm -> output tied to the word embeddings, with a bias) and, by default, the
binary sentence-order head (Linear(h, 2) on the pooled output). The loss is the masked mean of
the MLM cross-entropy plus, with the binary head, the sentence-order cross-entropy.

Layers live in a ModuleDict keyed by global index, and the embedding / heads may be absent on a
pipeline stage, so parameter names are the same at every layout (as GPT's). A stage after the
first takes and returns (hidden states, padding mask).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megalm.data.samples.bert import BertSamples
from megalm.family import Part
from megalm.models.bert.config import BertConfig
from megalm.models.flops import flops_per_token as transformer_flops
from megalm.models.init import init_by_name
from megalm.models.layers import MLP, Attention, TableEmbedding, build_norm, gelu
from megalm.models.losses import LMLoss, classification_loss, fold_choices, span_loss

VOCAB_PARAMS = ("embed.tok.weight", "lm_head.out.weight", "lm_head.out.bias")  # rows = padded vocabulary


class BertEmbedding(nn.Module):
    def __init__(self, cfg: BertConfig, vocab_rows: int):
        super().__init__()
        h = cfg.hidden_size
        self.tok = TableEmbedding(vocab_rows, h)
        self.pos = TableEmbedding(cfg.seq_length, h)
        self.types = TableEmbedding(cfg.num_tokentypes, h) if cfg.num_tokentypes > 0 else None
        self.norm = build_norm(cfg) if cfg.norm_position == "post" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, token_types: Optional[torch.Tensor]) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.pos.num_embeddings:
            raise ValueError(f"sequence of {T} tokens exceeds model.seq_length={self.pos.num_embeddings}")
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))
        if self.types is not None:
            x = x + self.types(token_types)
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


class BertLayer(nn.Module):
    """Pre-LN: x + attn(norm1(x)), then x + mlp(norm2(x)); post-LN: norm1(x + attn(x)), norm2(x + mlp(x))."""

    def __init__(self, cfg: BertConfig, layer_idx: int):
        super().__init__()
        self.post = cfg.norm_position == "post"
        self.norm1, self.norm2 = build_norm(cfg), build_norm(cfg)
        self.attn = Attention(cfg, layer_idx, causal=False)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.post:
            x = self.norm1(x + self.attn(x, None, None, 0, mask))
            return self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x), None, None, 0, mask)
        return x + self.mlp(self.norm2(x))


class Pooler(nn.Module):
    """tanh(dense(hidden of token 0)): the sequence summary the binary head (and classifiers) read."""

    def __init__(self, h: int):
        super().__init__()
        self.dense = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class MLMHead(nn.Module):
    """dense -> GELU (exact, or tanh with activation=gelu) -> norm -> logits over the vocabulary
    (weight tied to the word embeddings, with a bias)."""

    def __init__(self, cfg: BertConfig, vocab_rows: int):
        super().__init__()
        h = cfg.hidden_size
        self.dense = nn.Linear(h, h)
        self.exact = cfg.activation != "gelu"
        self.norm = build_norm(cfg)
        self.out = nn.Linear(h, vocab_rows, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(gelu(self.dense(x), exact=self.exact)))


class BERT(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        V, h = cfg.padded_vocab_size, cfg.hidden_size  # tp_plan pads further for tensor parallelism
        self.embed: Optional[BertEmbedding] = BertEmbedding(cfg, V)
        self.blocks = nn.ModuleDict({str(i): BertLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm: Optional[nn.Module] = build_norm(cfg) if cfg.norm_position == "pre" else None
        self.pooler: Optional[Pooler] = Pooler(h)
        self.classifier: Optional[nn.Linear] = None
        self.classifier_drop: Optional[nn.Dropout] = None
        self.qa_head: Optional[nn.Linear] = None
        self.lm_head: Optional[MLMHead] = None
        self.binary_head: Optional[nn.Linear] = None
        self.criterion: Optional[nn.Module] = None
        if cfg.span_head:  # extractive QA: (start, end) logits of every token
            self.pooler = None
            self.qa_head = nn.Linear(h, 2)
            self.metric_names: Tuple[str, ...] = ("start_acc", "end_acc")
        elif cfg.num_labels or cfg.num_choices:
            # Megatron's Classification / MultipleChoice heads: pooler -> dropout -> linear (one score a choice)
            self.classifier_drop, self.classifier = nn.Dropout(cfg.dropout), nn.Linear(h, cfg.num_labels or 1)
            self.metric_names = () if cfg.num_labels == 1 else ("acc",)
        else:
            self.lm_head = MLMHead(cfg, V)
            self.lm_head.out.weight = self.embed.tok.weight
            self.binary_head = nn.Linear(h, 2) if cfg.binary_head else None
            self.criterion = LMLoss(cfg.vocab_size)
            self.metric_names = ("lm_loss", "mlm_acc") + (("sop_loss", "sop_acc") if cfg.binary_head else ())
        """What `loss_and_metrics` reports beside the loss (the trainer logs them)."""
        self.new_heads: Tuple[str, ...] = ("qa_head",) if cfg.span_head else ("classifier",) if self.classifier else ()
        """Modules a fine-tuning start initialises afresh: a pretrained checkpoint does not hold them."""

    def forward(self, *inputs: torch.Tensor, part: Optional[Part] = None):
        """(tokens, token_types, padding_mask), each (B, T) → (MLM logits (B, T, V), sentence-order
        logits (B, 2)), or the MLM logits alone without the binary head; with num_labels, the
        classifier's (B, num_labels); with num_choices, inputs (B, C, T) → scores (B, C); with the
        span head, (start, end) logits (B, T, 2).

        With `part` (a pipeline stage) only its layers run: a stage after the first takes
        (hidden (B, T, h), padding_mask), and one before the last returns them.
        """
        first, last = part is None or part.first, part is None or part.last
        if first:
            tokens, token_types, padding_mask = fold_choices(inputs, self.cfg.num_choices)
            x = self.embed(tokens, token_types)  # (B, T, h), or this rank's sequence shard under SP
        else:
            x, padding_mask = inputs
        mask = padding_mask.bool()[:, None, None, :]  # (B, 1, 1, T): the real tokens, as keys
        blocks = self.blocks.values() if part is None else [self.blocks[str(i)] for i in part.layers]
        for block in blocks:
            x = block(x, mask)
        if not last:
            return x, padding_mask
        if self.norm is not None:
            x = self.norm(x)
        if self.qa_head is not None:
            return self.qa_head(x)
        if self.classifier is not None:
            scores = self.classifier(self.classifier_drop(self.pooler(x)))
            return scores.view(-1, self.cfg.num_choices) if self.cfg.num_choices else scores
        logits = self.lm_head(x)  # (B, T, V), or this rank's vocabulary shard under TP
        if self.binary_head is None:
            return logits
        return logits, self.binary_head(self.pooler(x))

    def loss(self, output, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Masked mean of the MLM loss over the masked positions, plus the sentence-order loss."""
        return self.loss_and_metrics(output, batch)[0]

    def loss_and_metrics(self, output, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The loss, and `metric_names`' values on this micro-batch (detached): the MLM loss and the
        fraction of masked tokens predicted right; with the binary head, the sentence-order loss
        and accuracy."""
        if self.qa_head is not None:
            return span_loss(output, batch["start_positions"], batch["end_positions"])
        if self.classifier is not None:
            return classification_loss(output, batch["label"], regression=self.cfg.num_labels == 1)
        logits, order = (output, None) if self.binary_head is None else output
        mask = batch["loss_mask"].float()
        lm = self.criterion(logits, batch["labels"], mask)
        loss, values = lm, [lm.detach()]
        with torch.no_grad():
            values.append((self.criterion.correct(logits, batch["labels"]) * mask).sum() / mask.sum().clamp(min=1.0))
        if order is not None:
            sop = F.cross_entropy(order.float(), batch["is_random"])
            loss = loss + sop
            values += [sop.detach(), (order.argmax(-1) == batch["is_random"]).float().mean()]
        return loss, torch.stack([v.float() for v in values])


def init_weights(model: nn.Module, cfg: BertConfig, seed: int) -> None:
    """Every parameter from (seed, global name) (megalm.models.init): N(0, init_std), residual
    output projections init_std / sqrt(2 * num_layers) (Megatron's scaled init), norms 1, biases 0."""
    init_by_name(model, cfg, seed, VOCAB_PARAMS)


def flops_per_token(cfg: BertConfig, seq_length: Optional[int] = None) -> float:
    """megalm.models.flops's definition, with BERT's MLM head: its dense (h x h) and the output
    (h x V_padded) matmuls on every token (the pooler and binary head act on one token a sequence)."""
    h = cfg.hidden_size
    if cfg.fine_tuning_head:  # no MLM head: a classifier on one token a sequence, or a span head's h x 2
        return transformer_flops(cfg, seq_length) - 6.0 * h * cfg.padded_vocab_size + (12.0 * h if cfg.span_head else 0.0)
    return transformer_flops(cfg, seq_length) + 6.0 * h * h


def samples(cfg: BertConfig):
    """How BERT's training samples are made (megalm.data.samples.bert)."""
    return BertSamples(cfg)


