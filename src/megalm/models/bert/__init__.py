"""The BERT family: bidirectional encoders pretrained by masked-LM (and sentence order), fine-tuned as
classifiers, multiple-choice scorers or extractive QA; their tensor-parallel plan and their Hugging Face
mapping (BertForPreTraining)."""

from megalm.family import Family, Parts
from megalm.models.bert.config import BertConfig, validate
from megalm.models.bert.model import BERT, VOCAB_PARAMS, flops_per_token, init_weights, samples
from megalm.models.bert.parallelize import tp_plan

FAMILY = Family(
    name="bert", kind="encoder", config=BertConfig, build=BERT, init_weights=init_weights, flops_per_token=flops_per_token,
    validate=validate, tp_plan=tp_plan, inputs=("tokens", "token_types", "padding_mask"),
    parts=Parts(layers="blocks", first=("embed",),
                last=("norm", "pooler", "lm_head", "binary_head", "criterion", "classifier", "classifier_drop",
                      "qa_head"),
                selective=("attn.core",)),
    samples=samples,
    hf="megalm.models.bert.hf", vocab_params=VOCAB_PARAMS, tied=(("lm_head.out.weight", "embed.tok.weight"),))
