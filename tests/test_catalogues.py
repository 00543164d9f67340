"""Translation pairs from Django's installed gettext catalogues (megalm.data.catalogues)."""

from __future__ import annotations

import json
import sys

import pytest

from megalm.data.catalogues import main
from megalm.data.corpora.catalogues import catalogue_pairs, prompt, write_pairs
from megalm.errors import ConfigError, DataError


def test_french_pairs_come_from_djangos_catalogues():
    import polib
    from importlib import resources
    from pathlib import Path
    pairs = catalogue_pairs("fr")
    assert len(pairs) > 500 and len({s for s, _ in pairs}) == len(pairs)
    assert all("\n" not in s + t and s and t for s, t in pairs)
    # every pair is an entry of one of the French .po files, read here with polib directly
    root = Path(str(resources.files("django")))
    entries = {e.msgid.strip(): e.msgstr.strip() for f in root.glob("**/locale/fr/LC_MESSAGES/*.po")
               for e in polib.pofile(str(f)).translated_entries()}
    assert all(entries.get(s) == t or s in entries for s, t in pairs)
    assert ("Arabic", "Arabe") in pairs and dict(pairs)["Arabic"] == entries["Arabic"]
    assert catalogue_pairs("de") != pairs


def test_written_files_split_the_pairs_and_read_as_sft_and_generate_data(tmp_path):
    from megalm.data.tasks.sft import example_pieces
    from megalm.evaluate.likelihood import read_jsonl
    pairs = catalogue_pairs("fr")
    train, test = write_pairs(pairs, "fr", tmp_path, test_fraction=0.1, seed=3)
    assert train + test == len(pairs) and test == round(0.1 * len(pairs))
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = read_jsonl(tmp_path / "test.jsonl", ["prompt", "reference"])
    assert {r["prompt"] for r in rows}.isdisjoint(r["prompt"] for _, r in held)
    assert len(rows) == train and len(held) == test
    want = {prompt(s, "fr"): t for s, t in pairs}
    assert all(want[r["prompt"]] == r["response"][1:] and r["response"][0] == " " for r in rows)
    assert all(want[r["prompt"]] == r["reference"] for _, r in held)
    assert rows[0]["prompt"] == f"English: {pairs[0][0]}\nFrench:" or pairs[0][0] in {r["prompt"][9:-8] for _, r in held}
    assert example_pieces(rows[0], "{role}: {content}\n", "x") == [(rows[0]["prompt"], False), (rows[0]["response"], True)]
    again = tmp_path / "again"
    write_pairs(pairs, "fr", again, test_fraction=0.1, seed=3)
    assert (again / "test.jsonl").read_bytes() == (tmp_path / "test.jsonl").read_bytes()  # seeded


def test_mistakes_are_named(tmp_path, monkeypatch, capsys):
    with pytest.raises(DataError, match=r"no catalogue for language 'xx'; it has: .*\bfr\b"):
        catalogue_pairs("xx")
    with pytest.raises(ConfigError, match=r"--test-fraction=1.5 must be in \(0, 1\)"):
        write_pairs([("a", "b")], "fr", tmp_path, test_fraction=1.5)
    monkeypatch.setitem(sys.modules, "polib", None)
    with pytest.raises(ConfigError, match=r"pip install 'megalm\[catalogues\]'"):
        catalogue_pairs("fr")
    with pytest.raises(SystemExit) as e:
        main(["--language", "fr", "--output", str(tmp_path / "o")])
    assert e.value.code == 1 and capsys.readouterr().err.startswith("megalm.data.catalogues: invalid config: ")
