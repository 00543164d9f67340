"""Sentiment data that ships offline: the 200 labelled sentences of the movie-review
polarity data that gensim 4.4 carries in its test data (`pang_lee_polarity.cor`, fastText's
"__label__neg|pos text" lines; the `megalm[sentiment]` extra), as `python -m megalm.data.sentiment`
writes them: OUT_DIR/train.txt and OUT_DIR/dev.txt in UTF-8 (data.task=fasttext, data.labels=[neg,pos]),
a seeded shuffle, the dev split holding as many of each label. The file is found without importing gensim
(whose import pulls in scipy's sparse algebra for nothing here).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Tuple

import numpy as np

from megalm.errors import ConfigError, DataError

LABELS = ("neg", "pos")


def polarity_path() -> Path:
    """gensim's copy of the polarity sentences."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the polarity sentences ship with gensim's test data: pip install 'megalm[sentiment]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "pang_lee_polarity.cor"
    if not path.is_file():
        raise DataError(f"{path} is missing: megalm[sentiment] pins gensim 4.4, which carries it")
    return path


def split(lines: List[str], dev: int, seed: int) -> Tuple[List[str], List[str]]:
    """(train, dev) lines: a seeded shuffle; dev takes dev // 2 lines of each label."""
    order = np.random.RandomState(seed).permutation(len(lines))
    shuffled = [lines[i] for i in order]
    per_label = {label: [x for x in shuffled if x.startswith(f"__label__{label} ")] for label in LABELS}
    if dev % 2 or any(len(v) <= dev // 2 for v in per_label.values()):
        raise ConfigError(f"--dev {dev} must be even and leave training lines of each label "
                          f"({', '.join(f'{k}: {len(v)}' for k, v in per_label.items())})")
    held = {x for v in per_label.values() for x in v[:dev // 2]}
    return [x for x in shuffled if x not in held], [x for x in shuffled if x in held]


def write_splits(output: Path, dev: int, seed: int) -> Tuple[int, int]:
    """OUT_DIR/train.txt and OUT_DIR/dev.txt of the polarity sentences (split); returns their sizes."""
    text = polarity_path().read_bytes().decode("cp1252")  # as the original release: Windows-1252 (é, —)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = list(dict.fromkeys(lines))  # a repeated sentence must not sit in both splits
    train, held = split(lines, dev, seed)
    output.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("dev", held)):
        (output / f"{name}.txt").write_text("".join(x + "\n" for x in part), encoding="utf-8")
    return len(train), len(held)
