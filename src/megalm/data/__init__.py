"""Data pipeline: corpus -> tokenizer -> Megatron .bin/.idx -> packed samples -> micro-batches."""

from megalm.data.corpora import StdlibCorpus, stdlib_corpus
from megalm.data.gpt_dataset import GPTDataset, MockGPTDataset
from megalm.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from megalm.data.loader import DataBundle, MicroBatchLoader, build_data, split_documents
from megalm.data.tokenizer import NullTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DataBundle", "MicroBatchLoader", "build_data", "load_tokenizer", "split_documents",
    "Tokenizer", "SentencePieceTokenizer", "NullTokenizer",
    "IndexedDataset", "IndexedDatasetWriter", "best_dtype",
    "GPTDataset", "MockGPTDataset", "StdlibCorpus", "stdlib_corpus",
]
