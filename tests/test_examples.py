"""The example scripts parse, and the code example's pair maker gives pairs of the right shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*/run.sh")), ids=lambda p: p.parent.name)
def test_example_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert (script.parent / "README.md").is_file()


def test_code_pairs_are_docstring_prompts_and_body_responses(tmp_path):
    out = tmp_path / "pairs.jsonl"
    r = subprocess.run([sys.executable, str(EXAMPLES / "code_generation" / "make_pairs.py"), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) > 100 and json.loads(r.stdout)["pairs"] == len(rows)
    for row in rows:
        assert row["prompt"].startswith("def ") and row["prompt"].rstrip()[-1] in "\"'"  # ends with its docstring
        assert row["response"].strip() and len(row["prompt"]) + len(row["response"]) <= 500
