"""The one definition of model FLOPs, used for TFLOP/s and MFU in logs and benchmarks.

Training FLOPs per token = 6 * N_matmul + 12 * L * s * h_attn, where
- N_matmul counts the weights that multiply each token: in every block q/k/v, the attention
  output projection and the MLP (a mixture of experts: the k experts a token runs, and the
  router); plus the LM head (h x V_padded, a matmul even when tied to the
  embedding). Embedding look-ups, norms and biases do no matmul and are left out.
- 12 * L * s * h_attn is attention itself: per layer QK^T and AV cost 2 * s * h_attn FLOPs each
  per token in the forward pass, and the backward pass costs twice the forward (x3).
  The causal mask is not credited (as PaLM, arXiv:2204.02311 App. B, and Megatron count).
The factor 6 is 2 (multiply-add) x 3 (forward + backward). Recomputation is not counted: these
are *model* FLOPs, so MFU does not reward recomputing.
"""

from megalm.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    h, hd = cfg.hidden_size, cfg.head_dim
    qkv = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * hd
    proj = cfg.num_attention_heads * hd * h
    mlp = h * cfg.ffn_size * (3 if cfg.activation == "swiglu" else 2)
    experts = getattr(cfg, "num_experts", 0)
    if experts:  # a token runs k experts' MLPs, and the router
        mlp = mlp * cfg.moe_router_topk + h * experts
    return cfg.num_layers * (qkv + proj + mlp) + h * cfg.padded_vocab_size


def flops_per_token(cfg: ModelConfig, seq_length: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token at the given sequence length."""
    s = seq_length or cfg.seq_length
    attn = 12 * cfg.num_layers * s * cfg.num_attention_heads * cfg.head_dim
    return 6.0 * matmul_params(cfg) + attn
