"""Turning text into token files, above the corpora and the tokenizers it reads.

- pipeline: your JSON-lines or text files to Megatron's .bin/.idx (with `workers`, its tokenizing
  processes), the work of `python -m megalm.data.preprocess`;
- cached_tokens: the built-in corpora tokenized once into the cache.
"""
