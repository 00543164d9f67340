"""The polarity sentences that ship with gensim, as megalm.data.sentiment writes them, read back
through data.task=fasttext."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megalm.data.tasks.classification import read_examples
from megalm.errors import ConfigError, DataError


def test_written_splits_are_the_shipped_sentences(tmp_path):
    from megalm.data.corpora.sentiment import polarity_path
    r = subprocess.run([sys.executable, "-m", "megalm.data.sentiment", str(tmp_path), "--dev", "40"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    raw = polarity_path().read_bytes().decode("cp1252").splitlines()
    shipped = {line.strip() for line in raw if line.strip()}
    train = (tmp_path / "train.txt").read_text(encoding="utf-8").splitlines()
    dev = (tmp_path / "dev.txt").read_text(encoding="utf-8").splitlines()
    assert json.loads(r.stdout) == {"train": len(train), "dev": 40, "output": str(tmp_path)}
    assert set(train) | set(dev) == shipped and not set(train) & set(dev) and len(shipped) == len(train) + 40
    assert sum(x.startswith("__label__neg ") for x in dev) == 20 and any("—" in x or "é" in x for x in shipped)
    examples = read_examples([str(tmp_path / "dev.txt")], "fasttext", ["neg", "pos"], 2)
    assert [e.label for e in examples] == [int(x.startswith("__label__pos ")) for x in dev]
    assert examples[0].text == dev[0].split(" ", 1)[1].strip() and examples[0].pair is None


@pytest.mark.parametrize("line, message", [
    ("neg a film", r"x.txt:1: a fastText line is '__label__<name> text'"),
    ("__label__meh a film", r"x.txt:1: label 'meh' is not one of neg, pos"),
    ("__label__pos", r"x.txt:1: a fastText line"),
])
def test_bad_fasttext_lines_name_file_and_line(tmp_path, line, message):
    (tmp_path / "x.txt").write_text(line + "\n")
    with pytest.raises(DataError, match=message):
        read_examples([str(tmp_path / "x.txt")], "fasttext", ["neg", "pos"], 2)
    with pytest.raises(ConfigError, match=r"data.task=fasttext names its classes in data.labels"):
        read_examples([str(tmp_path / "x.txt")], "fasttext", [], 2)
