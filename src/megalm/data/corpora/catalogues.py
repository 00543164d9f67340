"""English -> other-language pairs from the gettext catalogues an installed package ships, offline:
the work of `python -m megalm.data.catalogues`.

Django ships its user-interface strings translated into ~100 languages (about 800 single-line
strings per language, BSD licence): `megalm[catalogues]` installs it with polib, which reads the
.po files. Every translated, non-fuzzy, singular entry of the package's
`**/locale/<language>/LC_MESSAGES/*.po` becomes a pair (one line each side, the first translation
of a repeated English string kept), in file order. A seeded shuffle then holds out --test-fraction
of them. The output folder gets
  train.jsonl  {"prompt": "English: ...\\n<Language>:", "response": " ..."}   for data=sft
  test.jsonl   {"prompt": ..., "reference": "..."}                             for megalm.evaluate generate
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from megalm.errors import ConfigError, DataError

LANGUAGES = {"fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt": "Portuguese", "nl": "Dutch",
             "pl": "Polish", "ru": "Russian", "ja": "Japanese", "zh_Hans": "Chinese", "ko": "Korean", "tr": "Turkish",
             "sv": "Swedish", "cs": "Czech", "uk": "Ukrainian", "fi": "Finnish", "da": "Danish", "el": "Greek"}
MAX_CHARS = 200  # longer strings are paragraphs of help text, not short UI strings


def catalogue_pairs(language: str, package: str = "django") -> List[Tuple[str, str]]:
    """(English, translation) pairs of the package's catalogues for `language`, in file order."""
    try:
        import polib  # lazy: an optional extra (megalm[catalogues])
        from importlib import resources
        root = Path(str(resources.files(package)))
    except ModuleNotFoundError as e:
        raise ConfigError(f"reading {package}'s catalogues needs {e.name}: pip install 'megalm[catalogues]'") from None
    files = sorted(root.glob(f"**/locale/{language}/LC_MESSAGES/*.po"))
    if not files:
        have = sorted({p.parts[-3] for p in root.glob("**/locale/*/LC_MESSAGES/*.po")})
        raise DataError(f"{package} has no catalogue for language {language!r}; it has: {', '.join(have) or 'none'}")
    pairs, seen = [], set()
    for path in files:
        for entry in polib.pofile(str(path)).translated_entries():
            source, target = entry.msgid.strip(), entry.msgstr.strip()
            if entry.msgid_plural or "fuzzy" in entry.flags or source in seen or not target:
                continue
            if "\n" in source or "\n" in target or max(len(source), len(target)) > MAX_CHARS:
                continue
            seen.add(source)
            pairs.append((source, target))
    return pairs


def prompt(source: str, language: str) -> str:
    return f"English: {source}\n{LANGUAGES.get(language, language)}:"


def write_pairs(pairs: Sequence[Tuple[str, str]], language: str, output: Path, test_fraction: float = 0.1,
                seed: int = 0) -> Tuple[int, int]:
    """train.jsonl (SFT) and test.jsonl (generate) in `output`; returns their sizes."""
    if not 0 < test_fraction < 1:
        raise ConfigError(f"--test-fraction={test_fraction} must be in (0, 1)")
    order = np.random.RandomState(seed).permutation(len(pairs))
    n_test = max(1, int(round(len(pairs) * test_fraction)))
    test, train = sorted(order[:n_test].tolist()), sorted(order[n_test:].tolist())
    output.mkdir(parents=True, exist_ok=True)
    with open(output / "train.jsonl", "w", encoding="utf-8") as f:
        for i in train:
            f.write(json.dumps({"prompt": prompt(pairs[i][0], language), "response": " " + pairs[i][1]},
                               ensure_ascii=False) + "\n")
    with open(output / "test.jsonl", "w", encoding="utf-8") as f:
        for i in test:
            f.write(json.dumps({"prompt": prompt(pairs[i][0], language), "reference": pairs[i][1]},
                               ensure_ascii=False) + "\n")
    return len(train), len(test)
