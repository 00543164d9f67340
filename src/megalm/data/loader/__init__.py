"""From a DataConfig to datasets (build: build_data and its tokenizer), and from datasets to this
rank's micro-batches (batches: MicroBatchLoader, Prefetcher, collate)."""

from megalm.data.loader.batches import DataExhaustedError, MicroBatchLoader, Prefetcher, collate
from megalm.data.loader.build import (DataBundle, build_data, build_data_tokenizer, corpus_sources, num_samples_for,
                                      split_documents)
from megalm.data.samples.gpt import GPTSamples  # build_data's default; megalm.models.gpt imports it from here

__all__ = ["DataBundle", "DataExhaustedError", "GPTSamples", "MicroBatchLoader", "Prefetcher", "build_data",
           "build_data_tokenizer", "collate", "corpus_sources", "num_samples_for", "split_documents"]
