"""Data pipeline: corpus -> tokenizer -> Megatron .bin/.idx -> GPT sample indices -> blend -> micro-batches.

By folder: formats/ (the files on disk: .bin/.idx, JSON lines, raw corpus files, the array cache),
tokenizers/, corpora/ (the built-in corpora, and preprocessing yours), samples/ (each model family's
training samples, and blending), tasks/ (fine-tuning data: SFT, classification, SQuAD) and loader/
(build_data, and this rank's micro-batches); spec.py (data.split and data.blend) and provenance.py
(the tokenizer record beside a .bin/.idx) sit beside them, with the commands `python -m
megalm.data.{preprocess,train_tokenizer,benchmark,sentiment,catalogues}`.

Names are imported lazily, so that `python -m megalm.data.preprocess` and its worker processes
do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "megalm.data.corpora.stdlib": ("StdlibCorpus", "stdlib_corpus"),
    "megalm.data.samples.gpt": ("GPTDataset", "MockGPTDataset", "build_gpt_indices", "eod_loss_mask", "gpt_batch"),
    "megalm.data.samples.blended": ("BlendedDataset", "blending_indices"),
    "megalm.data.spec": ("blend_spec", "parse_blend", "split_weights"),
    "megalm.data.formats.indexed": ("IndexedDataset", "best_dtype"),
    "megalm.data.formats.indexed_writer": ("IndexedDatasetWriter", "merge_datasets"),
    "megalm.data.loader": ("DataBundle", "DataExhaustedError", "MicroBatchLoader", "build_data", "build_data_tokenizer",
                           "collate", "num_samples_for", "split_documents"),
    "megalm.data.tokenizers.base": ("NullTokenizer", "Tokenizer", "padded_vocab_size"),
    "megalm.data.tokenizers.sentencepiece": ("SentencePieceTokenizer",),
    "megalm.data.tokenizers.huggingface": ("HuggingFaceTokenizer",),
    "megalm.data.tokenizers.build": ("load_tokenizer", "build_tokenizer"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'megalm.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
