"""English -> other-language pairs from the gettext catalogues an installed package ships, offline.

    python -m megalm.data.catalogues --language fr --output data/en_fr [--package django]

Writes train.jsonl (for data=sft) and test.jsonl (for megalm.evaluate generate) into the output
folder; which pairs, and how they are held out: megalm.data.corpora.catalogues.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from megalm.data.corpora.catalogues import catalogue_pairs, write_pairs
from megalm.errors import cli_errors

PROG = "megalm.data.catalogues"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--language", required=True, help="the catalogues' language code (fr, de, es, ...)")
    ap.add_argument("--output", required=True, type=Path, help="folder for train.jsonl and test.jsonl")
    ap.add_argument("--package", default="django", help="the installed package whose catalogues to read")
    ap.add_argument("--test-fraction", type=float, default=0.1, help="pairs held out for test.jsonl (default 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out choice (default 0)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        pairs = catalogue_pairs(args.language, args.package)
        train, test = write_pairs(pairs, args.language, args.output, args.test_fraction, args.seed)
        print(json.dumps({"pairs": len(pairs), "train": train, "test": test, "output": str(args.output)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
