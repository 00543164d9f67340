"""On-disk formats the data pipeline reads and writes.

- indexed, indexed_writer: Megatron's `.bin/.idx` token files (reading; writing and merging);
- jsonl: JSON-lines and UTF-8 text files of examples, and the two line-aligned files of a translation corpus;
- cache: numpy arrays built once and cached by what defines them, with the stable hashes and file locks
  every cache of the pipeline uses.
"""
