"""The neox family: GPT-NeoX decoders as the Pythia suite trains them (partial rotary positions, parallel
attention and MLP residual, untied head), their parallel plans and their Hugging Face mapping
(GPTNeoXForCausalLM)."""

from megalm.family import Family, Parts
from megalm.models.neox.config import NeoXConfig, validate
from megalm.models.neox.model import VOCAB_PARAMS, NeoX, flops_per_token, init_weights
from megalm.models.neox.parallelize import cp_plan, tp_plan

FAMILY = Family(
    name="neox", kind="decoder", config=NeoXConfig, build=NeoX, init_weights=init_weights, validate=validate,
    flops_per_token=flops_per_token, tp_plan=tp_plan, cp_plan=cp_plan,
    parts=Parts(layers="blocks", first=("embed",), last=("norm", "head", "criterion"), selective=("attn.core",)),
    hf="megalm.models.neox.hf", vocab_params=VOCAB_PARAMS, tied=(("head.weight", "embed.tok.weight"),),
    optional_inputs=("position_ids", "segment_ids"))
