"""Tokenizers behind one small interface (base), by kind: sentencepiece (trained on a corpus and
cached, or loaded from a .model file), huggingface (a `tokenizer.json`) and null (data that is already
ids); build turns a config into one and reads a saved one back; training holds
`python -m megalm.data.train_tokenizer`'s work.
"""
