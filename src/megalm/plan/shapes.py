"""The sizes the formulas read off a config: bytes an element, a rank's tokens of a sequence and micro-batches
of a step, and `_Shape`, one micro-batch on one rank as the activation formulas (megalm.plan.activations,
attention, moe) see it, resolved once from the config by `_shape`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalm.distributed.mesh import ParallelDims
from megalm.errors import ConfigError
from megalm.models.registry import family_of
from megalm.ops.attention import attention_backend
from megalm.training.precision import param_dtype

FP32 = 4
INT64 = 8
_BERT_FINE_TUNING = ("BERT's fine-tuning heads (model.num_labels, num_choices, span_head) are not modelled by "
                     "megalm.plan's activation and collective formulas, only its pretraining heads (MLM and "
                     "sentence order): a classifier reads one pooled token a sequence and a span head every token, "
                     "whose saved tensors, sequence-parallel gathers and loss scalars were not measured")


def local_tokens(cfg) -> int:
    """Tokens of a sequence on one rank: model.seq_length, or its 1 / cp under context parallelism
    (megalm.parallel.context: two chunks of 2 x cp)."""
    return cfg.model.seq_length // cfg.parallel.cp


def microbatches(cfg, dp: int) -> int:
    t = cfg.trainer
    return t.global_batch_size // (t.micro_batch_size * dp)


@dataclass(frozen=True)
class _Shape:
    """What the formulas read, resolved once from the config: sizes of one micro-batch on one rank."""
    s: int        # tokens a sequence on this rank: model.seq_length / cp
    b: int        # sequences a micro-batch (times num_choices)
    h: int
    a: int        # query heads
    kv: int       # key / value width, kv_heads * head_dim
    groups: int   # query heads per kv head
    f: int        # ffn width
    vocab: int    # padded vocabulary rows at this tp
    t: int
    sp: bool
    e: int        # bytes of a compute element: 4 (fp32), 2 (bf16 / fp16 autocast)
    autocast: bool
    cpu: bool
    rope: bool
    swiglu: bool
    rmsnorm: bool
    bias: bool
    dropout: float
    attention_dropout: float
    lm_head: bool
    bert: bool = False        # BERT's layers and heads (megalm.models.bert); the rest are GPT's
    post_norm: bool = False   # BERT's norm_position=post: a norm after the embedding and after each residual
    token_types: bool = False  # BERT's token-type embedding
    binary_head: bool = False  # BERT's pooler and sentence-order head
    cp: int = 1               # context-parallel ranks a sequence is split over (megalm.parallel.context)
    hd: int = 0               # head_dim
    # A mixture of experts in place of each layer's MLP (megalm.models.moe; model.num_experts > 0):
    experts: int = 0          # E, every expert of a layer (0: a dense MLP)
    topk: int = 0             # k experts a token
    sigmoid: bool = False     # sigmoid scores (else softmax)
    aux: bool = False         # the load-balancing loss is on (its softmax probabilities are kept)
    z: bool = False           # the router z-loss is on (its log-sum-exp is kept)
    capacity: Optional[float] = None  # moe_capacity_factor (None: dropless)
    ep: int = 1               # expert-parallel ranks: a rank holds experts / ep of a layer
    relu: bool = False
    expert_tp: int = 1        # expert tensor parallelism (parallel.expert_tp): each expert split over tp
    unfused: bool = False     # model.attention_backend resolves to unfused (megalm.models.layers.attention_backend)
    fused_head: bool = False  # model.fused_loss: the head's matmul inside the chunked loss (its input gathered whole)
    main: bool = False        # trainer.mixed_precision=main_params in bf16 / fp16: the weights are in the compute dtype
    recompute_act: bool = False  # parallel.recompute_activation: fc2's input freed after its forward
    r: int = FP32  # bytes of a residual-stream element (`held_bytes`): fp32 under autocast (fp32 weights and
    #                embeddings, so the residual sums stay fp32), the weights' dtype under main, as in Megatron

    @property
    def seq(self) -> int:
        """Divisor of the sequence-parallel region (norms, residual, hidden dropout)."""
        return self.t if self.sp else 1

    @property
    def fused_attention(self) -> bool:
        return not self.unfused and not (self.cpu and self.attention_dropout > 0)

    def mask(self, element: int) -> int:
        """Bytes a dropout keeps an element: CUDA's native_dropout a bool, CPU's a noise tensor of the input's dtype."""
        return element if self.cpu else 1


def encoder(m) -> bool:
    """The model is an encoder (its family's kind): the formulas count BERT's layers and heads for it (a post-norm
    option, token types, the MLM head, pooler and sentence-order head, each read from the config), and GPT's
    pre-norm decoder block for a decoder family."""
    return family_of(m.arch).kind == "encoder"


def check_modelled(m, what: str) -> None:
    """A ConfigError unless the formulas of `what` cover the model: a decoder language model, or an encoder's
    pretraining (megalm.family.KINDS; an encoder-decoder, or a fine-tuning head, is not modelled)."""
    kind = family_of(m.arch).kind
    if kind == "encoder" and getattr(m, "fine_tuning_head", False):
        raise ConfigError(_BERT_FINE_TUNING)
    if kind not in ("decoder", "encoder") or getattr(m, "fine_tuning_head", False):
        raise ConfigError(f"{what} cover decoder language models and encoders' pretraining; model.arch={m.arch!r} "
                          + ("with a fine-tuning head" if kind == "decoder" else f"(an {kind})") + " is not modelled yet")


def _shape(cfg, world: int, device: Optional[str] = None) -> _Shape:
    m, p, tr = cfg.model, cfg.parallel, cfg.trainer
    kind = family_of(m.arch).kind
    if kind not in ("decoder", "encoder"):
        raise ConfigError(f"activation memory is derived for decoder and encoder layers; model.arch={m.arch} is an "
                          f"{kind}")
    bert = kind == "encoder"
    if bert and m.fine_tuning_head:
        raise ConfigError(_BERT_FINE_TUNING)
    if m.transformer_impl != "local" or tr.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"activation memory is derived for transformer_impl=local in fp32 / bf16 / fp16; got "
                          f"model.transformer_impl={m.transformer_impl}, trainer.precision={tr.precision}")
    device = device or ("cpu" if tr.device == "cpu" else "cuda")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; choose cpu or cuda")
    dims = ParallelDims.from_config(p, world)
    if p.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"parallel.recompute={p.recompute} is not one of none, selective, full")
    return _Shape(s=m.seq_length // dims.cp, b=tr.micro_batch_size * max(1, getattr(m, "num_choices", 0)),
                  h=m.hidden_size, a=m.num_attention_heads, kv=m.kv_heads * m.head_dim,
                  groups=m.num_attention_heads // m.kv_heads, f=m.ffn_size, vocab=m.padded_vocab(dims.tp), t=dims.tp,
                  sp=p.sequence_parallel and dims.tp > 1,
                  e=FP32 if tr.precision == "fp32" else 2, autocast=tr.precision != "fp32", cpu=device == "cpu",
                  rope=getattr(m, "position_embedding", "learned") == "rope", swiglu=m.activation == "swiglu",
                  rmsnorm=m.normalization == "rmsnorm", bias=m.bias, dropout=m.dropout,
                  attention_dropout=m.attention_dropout, lm_head=not getattr(m, "fine_tuning_head", False),
                  bert=bert, post_norm=bert and getattr(m, "norm_position", "pre") == "post",
                  token_types=bert and getattr(m, "num_tokentypes", 0) > 0,
                  binary_head=bert and getattr(m, "binary_head", False), cp=dims.cp, hd=m.head_dim,
                  experts=getattr(m, "num_experts", 0), topk=getattr(m, "moe_router_topk", 0),
                  sigmoid=getattr(m, "moe_router_score_function", "softmax") == "sigmoid",
                  aux=getattr(m, "moe_aux_loss_coeff", 0.0) > 0, z=getattr(m, "moe_z_loss_coeff", 0.0) > 0,
                  capacity=getattr(m, "moe_capacity_factor", None), ep=p.ep, relu=m.activation == "relu",
                  expert_tp=p.expert_tp if dims.tp > 1 else 1, fused_head=getattr(m, "fused_loss", False),
                  unfused=_unfused(m, tr, device),
                  main=param_dtype(tr) is not None, recompute_act=getattr(p, "recompute_activation", False),
                  r=held_bytes(tr))


def held_bytes(trainer) -> int:
    """Bytes of a weight element as the run holds it (fp32, or the compute dtype's 2 under
    trainer.mixed_precision=main_params), and so of the residual stream the embedding's lookup starts: the hidden
    states between layers, what crosses pipeline stages and the tp collectives outside the matmuls."""
    low = param_dtype(trainer)
    return FP32 if low is None else low.itemsize


def _unfused(m, tr, device: str) -> bool:
    """Whether the run's attention is the unfused one (model.attention_backend, `auto` resolved as the layers do)."""
    import torch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(tr.precision, torch.float32)
    return attention_backend(getattr(m, "attention_backend", "sdpa"), device, dtype, tr.compile != "none") == "unfused"
