#!/usr/bin/env python3
"""Train a sentencepiece (or byte-level BPE) tokenizer on a corpus; see `megalm.data.train_tokenizer`.

    python scripts/train_tokenizer.py --input data.jsonl --vocab-size 32000 --output tok/
"""

import sys

from megalm.data.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
