"""The GPT family: decoder-only GPT-2/3 and Llama-style language models (with Mixtral-style mixtures of
experts), their parallel plans and their Hugging Face mapping (GPT2LMHeadModel, LlamaForCausalLM,
MixtralForCausalLM)."""

from megalm.family import Family, Parts
from megalm.models.gpt.config import GPTConfig, validate
from megalm.models.gpt.model import GPT, VOCAB_PARAMS, flops_per_token, init_weights, samples
from megalm.models.gpt.parallelize import cp_plan, expert_plan, tp_plan

FAMILY = Family(
    name="gpt", kind="decoder", config=GPTConfig, build=GPT, init_weights=init_weights, validate=validate,
    flops_per_token=flops_per_token, tp_plan=tp_plan, cp_plan=cp_plan, expert_plan=expert_plan,
    parts=Parts(layers="blocks", first=("embed",), last=("norm", "head", "criterion", "score"), selective=("attn.core",)),
    samples=samples, hf="megalm.models.gpt.hf", vocab_params=VOCAB_PARAMS, tied=(("head.weight", "embed.tok.weight"),),
    optional_inputs=("position_ids", "segment_ids"))
