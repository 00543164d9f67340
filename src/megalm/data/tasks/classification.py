"""Sequence classification and regression data (data=classification): GLUE's files and JSON lines.

data.task names the layout of data.paths (training) and data.valid_paths (validation):
- jsonl: {"text": str, "text_pair": str (optional), "label": int or a name of data.labels, or a
  number for a regression (model.num_labels=1)}
- fasttext: fastText's lines, "__label__<name> text", each name one of data.labels (megalm.data.sentiment
  writes the movie-review polarity sentences that ship with gensim in it)
- GLUE's TSV files as Megatron's readers take them: mnli (sentence1, sentence2, gold_label; the
  labels contradiction, entailment, neutral), qqp (question1, question2, is_duplicate), sst2
  (sentence, label), cola (no header: source, label, original label, sentence), stsb (sentence1,
  sentence2, score: a regression).
Multiple choice (model.num_choices): the example's context is read with each choice in turn.
- choice: {"context": str, "choices": [str, ...], "label": index of the right choice}, every example
  with model.num_choices choices (the input megalm.evaluate's choice task reads);
- race: RACE's files as Megatron's reader takes them: data.paths are directories (or files) of .txt
  files, each one JSON {"article", "questions": [...], "options": [[4 options] ...], "answers":
  ["A".."D" ...]}; a choice is the question with its "_" blank filled by the option, or the
  question and the option.
A family turns each example into a sample (BERT: [CLS] a [SEP] b [SEP], the longer text trimmed
first; one such sequence per choice); the training order is a fresh permutation each epoch, as for SFT.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from megalm.data.formats.jsonl import json_lines, not_utf8, text_lines
from megalm.data.tasks.sft import EpochShuffle
from megalm.errors import ConfigError, DataError, not_a_file

# task -> (text column, pair column or None, label column, label names or None for a regression; None header = CoLA)
GLUE = {
    "mnli": ("sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral")),
    "qqp": ("question1", "question2", "is_duplicate", ("0", "1")),
    "sst2": ("sentence", None, "label", ("0", "1")),
    "cola": (3, None, 1, ("0", "1")),
    "stsb": ("sentence1", "sentence2", "score", None),
}
CHOICE_TASKS = {"choice": 0, "race": 4}
"""Multiple-choice layouts -> the choices each example has (0: what model.num_choices says)."""
TASKS = ("jsonl", "fasttext") + tuple(GLUE) + tuple(CHOICE_TASKS)
FASTTEXT_PREFIX = "__label__"


@dataclass(frozen=True)
class Example:
    text: str
    pair: Optional[str]
    label: Union[int, float]
    choices: Optional[Tuple[str, ...]] = None
    """Multiple choice: what is read after `text`, one sequence per choice (`pair` is then None)."""


def task_labels(task: str, labels: Sequence[str]) -> Optional[Tuple[str, ...]]:
    """The class names of a task (None: a regression); jsonl takes data.labels (empty: a regression
    or integer labels, which model.num_labels bounds)."""
    if task not in TASKS:
        raise ConfigError(f"data.task={task!r} is not one of {', '.join(TASKS)}")
    if labels and task not in ("jsonl", "fasttext"):
        raise ConfigError(f"data.labels={list(labels)} names the classes of data.task=jsonl or fasttext; "
                          f"data.task={task} has its own" + (f" ({', '.join(GLUE[task][3])})" if task in GLUE and
                                                             GLUE[task][3] else "") + ": leave data.labels empty")
    if task in CHOICE_TASKS:
        return None
    twice = sorted({name for name in labels if list(labels).count(name) > 1})
    if twice:
        raise ConfigError(f"data.labels={list(labels)} names {', '.join(twice)} more than once: each class once, in "
                          "label order")
    if task == "fasttext" and not labels:
        raise ConfigError("data.task=fasttext names its classes in data.labels (e.g. data.labels=[neg,pos] for "
                          "__label__neg / __label__pos), in label order")
    if task not in ("jsonl", "fasttext"):
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
            number = float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where}: label {value!r} is not a number (a regression: model.num_labels=1)") from None
        if not math.isfinite(number):  # one such target makes every step's loss non-finite
            raise DataError(f"{where}: label {value!r} is not a finite number (a regression: model.num_labels=1)")
        return number
    if names is not None and str(value) in names:
        return names.index(str(value))
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < num_labels:
        return value
    allowed = ", ".join(names) if names is not None else f"0..{num_labels - 1}"
    raise DataError(f"{where}: label {value!r} is not one of {allowed}")


def read_examples(paths: Sequence[str], task: str, labels: Sequence[str], num_labels: int,
                  num_choices: int = 0) -> List[Example]:
    names = task_labels(task, labels)
    out: List[Example] = []
    for p in paths:
        path = Path(p).expanduser()
        if task == "race" and path.is_dir():
            files = sorted(path.rglob("*.txt"))
            if not files:
                raise DataError(f"{path} holds no RACE .txt files")
            for f in files:
                out += _read_race(f)
            continue
        if not path.is_file():
            raise DataError(f"{path} {not_a_file(path)}")
        if task == "race":
            out += _read_race(path)
        elif task == "choice":
            out += _read_choice(path, num_choices)
        elif task == "fasttext":
            out += _read_fasttext(path, names, num_labels)
        else:
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


def _read_fasttext(path: Path, names, num_labels: int) -> List[Example]:
    out = []
    for n, line in text_lines(path):
        if not line.strip():
            continue
        label, _, text = line.strip().partition(" ")
        if not label.startswith(FASTTEXT_PREFIX) or not text.strip():
            raise DataError(f"{path}:{n}: a fastText line is '{FASTTEXT_PREFIX}<name> text'; got {line[:60]!r}")
        out.append(Example(text.strip(), None, _label(label[len(FASTTEXT_PREFIX):], names, num_labels, f"{path}:{n}")))
    return out


def _read_choice(path: Path, num_choices: int) -> List[Example]:
    out = []
    for where, rec in json_lines(path):
        choices = rec.get("choices") if isinstance(rec, dict) else None
        if (not isinstance(rec, dict) or not isinstance(rec.get("context"), str) or not isinstance(choices, list)
                or not all(isinstance(c, str) for c in choices)):
            raise DataError(f"{where}: needs 'context' (a string), 'choices' (a list of strings) and 'label'")
        if len(choices) != num_choices:
            raise DataError(f"{where}: {len(choices)} choices; model.num_choices={num_choices}, and every example "
                            "must have that many")
        label = rec.get("label")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_choices:
            raise DataError(f"{where}: label {label!r} is not a choice's index, 0..{num_choices - 1}")
        out.append(Example(rec["context"], None, label, tuple(choices)))
    return out


def _read_race(path: Path) -> List[Example]:
    try:
        rec = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise not_utf8(str(path), e) from None
    keys = ("article", "questions", "options", "answers")
    if not isinstance(rec, dict) or any(k not in rec for k in keys):
        raise DataError(f"{path}: a RACE file holds one JSON object with {', '.join(keys)}")
    qs, opts, answers = rec["questions"], rec["options"], rec["answers"]
    if not len(qs) == len(opts) == len(answers):
        raise DataError(f"{path}: {len(qs)} questions, {len(opts)} option lists and {len(answers)} answers differ")
    out = []
    for k, (question, options, answer) in enumerate(zip(qs, opts, answers)):
        where = f"{path}: question {k}"
        if not isinstance(options, list) or len(options) != 4 or not all(isinstance(o, str) for o in options):
            raise DataError(f"{where}: RACE questions have 4 options (strings); got {options!r}")
        if answer not in ("A", "B", "C", "D"):
            raise DataError(f"{where}: answer {answer!r} is not one of A, B, C, D")
        choices = tuple(question.replace("_", o) if "_" in question else f"{question} {o}" for o in options)
        out.append(Example(rec["article"], None, "ABCD".index(answer), choices))
    return out


def _read_glue(path: Path, task: str, names, num_labels: int) -> List[Example]:
    text_col, pair_col, label_col, _ = GLUE[task]
    out = []
    rows = csv.reader((line for _, line in text_lines(path)), delimiter="\t", quoting=csv.QUOTE_NONE)
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


def stack_choices(samples: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """One multiple-choice sample of the per-choice samples: each key stacked to (C, ...), the label kept once."""
    return {k: samples[0][k] if k == "label" else np.stack([s[k] for s in samples]) for k in samples[0]}


class ClassificationDataset:
    """One split's samples: `make(example)` (the family's layout) of a fresh permutation of the
    examples each epoch (numpy RandomState(seed + epoch)), so a sample depends on its index only."""

    def __init__(self, examples: Sequence[Example], make, name: str, seed: int, num_samples: Optional[int]):
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
