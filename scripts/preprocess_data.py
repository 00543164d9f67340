#!/usr/bin/env python3
"""Raw text (JSON lines or plain text) to Megatron .bin/.idx; see `megalm.data.preprocess`.

    python scripts/preprocess_data.py --input data.jsonl --output-prefix out/data \\
        --tokenizer-type sentencepiece --tokenizer-model tokenizer.model --append-eod --workers 4
"""

import sys

from megalm.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
