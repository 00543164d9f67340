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


def test_made_up_squad_files_read_back(tmp_path):
    from megalm.data.tasks.squad import read_squad
    r = subprocess.run([sys.executable, str(EXAMPLES / "question_answering" / "make_squad.py"), str(tmp_path),
                        "--train", "20", "--dev", "4"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"train": 100, "dev": 20}
    questions = read_squad(tmp_path / "train-v2.0.json")  # checks every answer against its context
    assert len(questions) == 100 and sum(q.impossible for q in questions) == 20


def test_cloze_items_end_with_their_word(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten eleven.\n\nshort one.\n\n"
                    "a b c d e f g h i j  k   l 1990.\n\nthe cat sat on the mat and then it sat on the hat\n")
    out = tmp_path / "c.jsonl"
    r = subprocess.run([sys.executable, str(EXAMPLES / "text_generation" / "make_cloze.py"), str(text), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"text": "one two three four five six seven eight nine ten eleven"},
                    {"text": "the cat sat on the mat and then it sat on the hat"}]
