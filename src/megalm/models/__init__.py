"""Plain single-device model code; parallelism is applied from outside (megalm.parallel)."""

from megalm.models.flops import flops_per_token, matmul_params
from megalm.models.gpt import GPT, build_model, init_weights, lm_loss
from megalm.models.layers import KVCache

__all__ = ["GPT", "KVCache", "build_model", "flops_per_token", "init_weights", "lm_loss", "matmul_params"]
