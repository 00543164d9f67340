"""Hugging Face import and export: `python -m megalm.convert {export,import} ...`.

export: a megalm checkpoint (run dir, checkpoint dir or step folder, written at any parallel
layout) → a Hugging Face folder (config.json + model.safetensors) that transformers loads as
GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, BertForPreTraining or
T5ForConditionalGeneration. import: such a folder, or a GGUF file (a path, or an installed pip
distribution that ships one; megalm.convert.gguf), → a megalm checkpoint dir that is a run directory
(megalm.convert.imported) and that training starts from with checkpoint.load=DIR. The weight mapping
is the model family's (Family.hf); megalm.convert.hf applies it.
"""

from megalm.convert.hf import (UnsupportedArchitecture, export_arch, export_to_hf, hf_config, import_from_hf,
                               locate_checkpoint, model_config_from_hf)

__all__ = ["UnsupportedArchitecture", "export_arch", "export_to_hf", "hf_config", "import_from_hf",
           "locate_checkpoint", "model_config_from_hf"]
