"""Write LAMBADA-format cloze items ({"text": ...}, the last word to predict) from the paragraphs
of a text file: each paragraph of at least 10 words, its last 80 kept (a small model's context),
whitespace collapsed, its closing punctuation dropped so that it ends with the word, which must be
alphabetic.

    python examples/text_generation/make_cloze.py TEXT_FILE OUT.jsonl
"""

import json
import re
import sys
from pathlib import Path


def items(text: str):
    for paragraph in re.split(r"\n\s*\n", text):
        words = paragraph.split()
        if len(words) < 10:
            continue
        line = " ".join(words[-80:]).rstrip(".,;:!?)\"'")
        last = line.rsplit(" ", 1)[-1]
        if last.isalpha() and len(last) > 1:
            yield {"text": line}


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    rows = list(items(src.read_text(encoding="utf-8")))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"items": len(rows), "output": str(out)}))


if __name__ == "__main__":
    main()
