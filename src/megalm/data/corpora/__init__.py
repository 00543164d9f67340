"""Text sources: the built-in corpora and the small offline data sets megalm draws from installed packages.

- stdlib: the built-in corpora (the standard library's sources, and their docstrings as prose);
- sentences: splitting text into sentences (BERT's and T5's corpora);
- catalogues, sentiment: small offline data sets drawn from installed packages, the work of
  `python -m megalm.data.catalogues` and `python -m megalm.data.sentiment`.

Turning text into token files is megalm.data.preprocessing's.
"""
