"""Sentiment data that ships offline: the 200 labelled sentences of the movie-review
polarity data that gensim 4.4 carries in its test data (`pang_lee_polarity.cor`, fastText's
"__label__neg|pos text" lines; the `megalm[sentiment]` extra).

    python -m megalm.data.sentiment OUT_DIR [--dev 40] [--seed 0]

writes OUT_DIR/train.txt and OUT_DIR/dev.txt in UTF-8 (data.task=fasttext, data.labels=[neg,pos]);
how: megalm.data.corpora.sentiment.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

from megalm.data.corpora.sentiment import write_splits
from megalm.errors import cli_errors

PROG = "megalm.data.sentiment"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path, help="folder for train.txt and dev.txt")
    ap.add_argument("--dev", type=int, default=40, help="held-out sentences, half of each label (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        train, dev = write_splits(args.output, args.dev, args.seed)
        print(json.dumps({"train": train, "dev": dev, "output": str(args.output)}))


if __name__ == "__main__":
    main()
