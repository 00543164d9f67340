"""Instruction pairs from the standard library's own functions: the signature and docstring as the
prompt, the body as the response (HumanEval's shape), for the functions that fit the context.

    python examples/code_generation/make_pairs.py OUT.jsonl [--max-chars 500]
"""

import argparse
import ast
import json
import sysconfig
from pathlib import Path


def pairs(max_chars: int):
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):  # the top-level modules: enough pairs, quick to read
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.col_offset != 0 or not ast.get_docstring(node):
                continue
            doc = node.body[0]
            prompt = "".join(lines[node.lineno - 1:doc.end_lineno])
            response = "".join(lines[doc.end_lineno:node.end_lineno])
            if response.strip() and len(prompt) + len(response) <= max_chars:
                yield {"prompt": prompt, "response": response}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--max-chars", type=int, default=500)
    args = ap.parse_args()
    rows = list(pairs(args.max_chars))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"pairs": len(rows), "output": str(args.output)}))
