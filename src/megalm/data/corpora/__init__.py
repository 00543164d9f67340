"""Corpora and turning them into token files.

- stdlib: the built-in corpora (the standard library's sources, and their docstrings as prose);
- cached_tokens: those corpora tokenized once into the cache;
- preprocess (with workers and sentences): your JSON-lines or text files to .bin/.idx, the work of
  `python -m megalm.data.preprocess`;
- catalogues, sentiment: small offline data sets drawn from installed packages, the work of
  `python -m megalm.data.catalogues` and `python -m megalm.data.sentiment`.
"""
