"""Temporary alias for megalm.models.bert, which imports BertSamples by this old path: BERT's samples
live in megalm.data.samples.bert. Delete this module when that import names the new path."""

from megalm.data.samples.bert import BertSamples

__all__ = ["BertSamples"]
