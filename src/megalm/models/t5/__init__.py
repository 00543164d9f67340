"""The T5 family: encoder-decoder models pretrained by span corruption and fine-tuned on source / target
pairs; their tensor-parallel plan and their Hugging Face mapping (T5ForConditionalGeneration)."""

from megalm.family import Family, Parts
from megalm.models.t5.config import T5Config, validate
from megalm.models.t5.model import T5, VOCAB_PARAMS, flops_per_token, init_weights, samples
from megalm.models.t5.parallelize import tp_plan

FAMILY = Family(
    name="t5", kind="encoder-decoder", config=T5Config, build=T5, init_weights=init_weights, flops_per_token=flops_per_token,
    validate=validate, tp_plan=tp_plan, inputs=("tokens", "padding_mask", "decoder_tokens"),
    parts=Parts(layers="blocks", first=("embed", "enc_bias", "dec_bias"), last=("norm", "head", "criterion"),
                selective=("attn.core", "cross.core")),
    samples=samples, hf="megalm.models.t5.hf", vocab_params=VOCAB_PARAMS, tied=(("head.weight", "embed.tok.weight"),))
