"""FLOPs of a pipeline stage's forward and backward on one rank (`stage_work`), from the family's one FLOPs
definition (megalm.models.flops), split as the zero-bubble schedules split backward (`StageWork`)."""

from __future__ import annotations

import dataclasses
from typing import Tuple

from megalm.models import flops_per_token
from megalm.plan.shapes import local_tokens


def layer_and_head_flops_per_token(model_cfg) -> Tuple[float, float]:
    """Training FLOPs per token of one transformer layer, and of everything outside the layers.

    Both come from the family's own `flops_per_token` (megalm.models.flops: 6 x matmul weights +
    12 L s h_attn, model FLOPs, recomputation not counted), evaluated at the model's depth and at
    depth 0: the difference is the layers' share, which is the same for every layer; what is left at
    depth 0 is the head (and, for BERT, its MLM transform and pooler), all of it on the last stage.
    """
    total = flops_per_token(model_cfg)
    outside = flops_per_token(dataclasses.replace(model_cfg, num_layers=0))
    return (total - outside) / model_cfg.num_layers, outside


def attention_core_flops_per_token(model_cfg) -> float:
    """Forward FLOPs per token per layer of QK^T and AV (2 x 2 s h_attn: megalm.models.flops's 12 L s h_attn
    is these times 3 for forward + backward), the part selective recomputation runs twice."""
    return 4.0 * model_cfg.seq_length * model_cfg.num_attention_heads * model_cfg.head_dim


@dataclasses.dataclass
class StageWork:
    """FLOPs one rank spends on one micro-batch in one (virtual) stage, split as the zero-bubble schedules
    split backward (Qi et al. 2023, arXiv:2401.10241): F forward, I the gradient of the stage's input
    (activations; the attention core's whole backward is here, it has no weights), W the weights'
    gradient (as many FLOPs as the forward's matmuls). B = I + W, twice F. Recomputation adds its
    forward to I: the whole forward of the recomputed layers (full), or the attention core (selective)."""
    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def stage_work(cfg, layers: int, last: bool, tp: int) -> StageWork:
    """Per-rank FLOPs of one micro-batch through a stage of `layers` layers (with the head when `last`).

    Under context parallelism a rank runs seq_length / cp of each sequence's tokens, and its queries' share
    of the attention: 1/cp of the micro-batch's model FLOPs (the layout of 2 x cp chunks gives every rank
    the same share of the causal work). Attention is counted as model FLOPs count it, as for cp = 1 (every
    query over every key); the ring computes (2cp + 1) / (4cp) of that (it skips the chunk pairs the causal
    mask hides entirely), a causal kernel about half."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.trainer.micro_batch_size * local_tokens(cfg)
    layer, outside = layer_and_head_flops_per_token(m)
    attn = attention_core_flops_per_token(m)  # forward, per layer
    layer_fwd = layer / 3
    matmul_fwd = layer_fwd - attn
    fwd = layers * layer_fwd + (outside / 3 if last else 0.0)
    head_mm = outside / 3 if last else 0.0
    weight = layers * matmul_fwd + head_mm
    inputs = layers * (matmul_fwd + 2 * attn) + head_mm
    if p.recompute == "full":
        n = layers if p.recompute_num_layers is None else min(layers, p.recompute_num_layers)
        inputs += n * layer_fwd
    elif p.recompute == "selective":
        inputs += layers * attn
    scale = tokens / tp
    return StageWork(fwd * scale, inputs * scale, weight * scale)
