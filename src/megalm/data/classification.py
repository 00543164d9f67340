"""Sequence classification and regression data (data=classification): GLUE's files and JSON lines.

data.task names the layout of data.paths (training) and data.valid_paths (validation):
- jsonl: {"text": str, "text_pair": str (optional), "label": int or a name of data.labels, or a
  number for a regression (model.num_labels=1)}
- GLUE's TSV files as Megatron's readers take them: mnli (sentence1, sentence2, gold_label; the
  labels contradiction, entailment, neutral), qqp (question1, question2, is_duplicate), sst2
  (sentence, label), cola (no header: source, label, original label, sentence), stsb (sentence1,
  sentence2, score: a regression).
A family turns each example into a sample (BERT: [CLS] a [SEP] b [SEP], the longer text trimmed
first); the training order is a fresh permutation each epoch, as for SFT.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megalm.data.jsonl import json_lines
from megalm.errors import ConfigError, DataError

# task -> (text column, pair column or None, label column, label names or None for a regression; None header = CoLA)
GLUE = {
    "mnli": ("sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral")),
    "qqp": ("question1", "question2", "is_duplicate", ("0", "1")),
    "sst2": ("sentence", None, "label", ("0", "1")),
    "cola": (3, None, 1, ("0", "1")),
    "stsb": ("sentence1", "sentence2", "score", None),
}
TASKS = ("jsonl",) + tuple(GLUE)


@dataclass(frozen=True)
class Example:
    text: str
    pair: Optional[str]
    label: Union[int, float]


def task_labels(task: str, labels: Sequence[str]) -> Optional[Tuple[str, ...]]:
    """The class names of a task (None: a regression); jsonl takes data.labels (empty: a regression
    or integer labels, which model.num_labels bounds)."""
    if task not in TASKS:
        raise ConfigError(f"data.task={task!r} is not one of {', '.join(TASKS)}")
    if task != "jsonl":
        return GLUE[task][3]
    return tuple(labels) or None


def num_classes(task: str, labels: Sequence[str], num_labels: int) -> int:
    """model.num_labels the task needs (1: regression)."""
    names = task_labels(task, labels)
    if task == "stsb":
        return 1
    return len(names) if names is not None else num_labels


def _label(value, names: Optional[Tuple[str, ...]], num_labels: int, where: str) -> Union[int, float]:
    if num_labels == 1:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where}: label {value!r} is not a number (a regression: model.num_labels=1)") from None
    if names is not None and str(value) in names:
        return names.index(str(value))
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < num_labels:
        return value
    allowed = ", ".join(names) if names is not None else f"0..{num_labels - 1}"
    raise DataError(f"{where}: label {value!r} is not one of {allowed}")


def read_examples(paths: Sequence[str], task: str, labels: Sequence[str], num_labels: int) -> List[Example]:
    names = task_labels(task, labels)
    out: List[Example] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise DataError(f"{path} does not exist")
        out += _read_jsonl(path, names, num_labels) if task == "jsonl" else _read_glue(path, task, names, num_labels)
    if not out:
        raise DataError(f"{', '.join(map(str, paths))} hold no examples")
    return out


def _read_jsonl(path: Path, names, num_labels: int) -> List[Example]:
    out = []
    for where, rec in json_lines(path):
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str) or "label" not in rec:
            raise DataError(f"{where}: needs 'text' (a string) and 'label' (and may have 'text_pair')")
        pair = rec.get("text_pair")
        if pair is not None and not isinstance(pair, str):
            raise DataError(f"{where}: 'text_pair' must be a string")
        out.append(Example(rec["text"], pair, _label(rec["label"], names, num_labels, where)))
    return out


def _read_glue(path: Path, task: str, names, num_labels: int) -> List[Example]:
    text_col, pair_col, label_col, _ = GLUE[task]
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header: Dict[Union[str, int], int] = {}
        if isinstance(text_col, str):
            first = next(rows, None)
            if first is None:
                return out
            header = {name: k for k, name in enumerate(first)}
            missing = [c for c in (text_col, pair_col, label_col) if c is not None and c not in header]
            if missing:
                raise DataError(f"{path}:1: the {task} header lacks {', '.join(missing)} (has {', '.join(first)}); "
                                f"a test file without labels cannot be trained or scored")
        col = (lambda c: header[c]) if header else (lambda c: c)
        for n, row in enumerate(rows, 2 if header else 1):
            where = f"{path}:{n}"
            need = max(col(c) for c in (text_col, pair_col, label_col) if c is not None)
            if len(row) <= need:
                raise DataError(f"{where}: {len(row)} columns, the {task} layout needs {need + 1}")
            out.append(Example(row[col(text_col)], row[col(pair_col)] if pair_col is not None else None,
                               _label(row[col(label_col)], names, num_labels, where)))
    return out


class ClassificationDataset:
    """One split's samples: `make(example)` (the family's layout) of a fresh permutation of the
    examples each epoch (numpy RandomState(seed + epoch)), so a sample depends on its index only."""

    def __init__(self, examples: Sequence[Example], make, name: str, seed: int, num_samples: Optional[int]):
        from megalm.data.sft import EpochShuffle
        if not examples:
            raise DataError(f"the {name} split has no examples")
        self.samples = [make(e) for e in examples]  # tokenized once
        self.name, self.order = name, EpochShuffle(len(self.samples), seed)
        self.num_samples = num_samples or len(self.samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name} sample {i} is out of range [0, {self.num_samples})")
        return self.samples[self.order(i)]
