"""SQuAD v1.1 / v2.0 scoring for an extractive question-answering reader (a fine-tuned BERT).

`best_answer` turns the reader's start / end logits over a question's windows
(megalm.data.tasks.squad.windows) into an answer text as Google's BERT run_squad.py write_predictions
does: the n_best highest start and end positions of each window, spans inside the context that
start where the window has the most context and are at most max_answer_length sub-tokens long,
scored by start + end logit. For SQuAD v2.0 (allow_null) the null answer "" wins when its score
(the lowest [CLS] start + end logit over the windows) beats the best span's by more than
null_threshold.

`normalize_answer`, `exact_match`, `f1` and `squad_scores` are the official SQuAD v2.0 evaluation
script's definitions (which score v1.1 files the same, except that an empty answer against an empty
gold scores F1 1 rather than 0): answers are lower-cased and stripped of punctuation, articles and
extra whitespace, the score of a question is the best over its gold answers, and an impossible
question's only gold answer is "".
"""

from __future__ import annotations

import collections
import re
import string
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megalm.data.loader import collate
from megalm.data.tasks.squad import Question, Window, answer_text, read_squad, words_of
from megalm.errors import ConfigError, DataError
from megalm.evaluate.layout import across_replicas
from megalm.models import family_of

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces."""
    s = "".join(c for c in s.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _tokens(s: str) -> List[str]:
    return normalize_answer(s).split() if s else []


def _golds(golds: Sequence[str]) -> Sequence[str]:
    return golds if len(golds) else [""]


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals a normalized gold answer, else 0.0 (no golds: [""])."""
    pred = normalize_answer(prediction)
    return float(max(pred == normalize_answer(g) for g in _golds(golds)))


def _f1(pred: List[str], gold: List[str]) -> float:
    if not pred or not gold:
        return float(pred == gold)
    same = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, golds: Sequence[str]) -> float:
    """The best token-overlap F1 of the normalized prediction against a gold answer (no golds: [""])."""
    pred = _tokens(prediction)
    return max(_f1(pred, _tokens(g)) for g in _golds(golds))


def gold_answers(q: Question) -> List[str]:
    """The answers a question is scored against, as the v2.0 script takes them: those whose
    normalized text is not empty, or [""] when none is left (always for an impossible question)."""
    return [a for a in q.answers if normalize_answer(a)] or [""]


def _best_indexes(logits: np.ndarray, n: int) -> List[int]:
    """The n positions of the highest logits, highest first (the lower position first on a tie)."""
    return sorted(range(len(logits)), key=lambda i: -logits[i])[:n]


def best_answer(windows: Sequence[Window], start_logits: Sequence[np.ndarray], end_logits: Sequence[np.ndarray],
                words: List[str], n_best: int = 20, max_answer_length: int = 30, allow_null: bool = False,
                null_threshold: float = 0.0) -> str:
    """The answer text the logits of a question's windows predict ("" for no answer). `words` are
    the context's words (megalm.data.tasks.squad.words_of), which the windows' token_to_word index."""
    if not len(windows) == len(start_logits) == len(end_logits):
        raise ValueError(f"{len(windows)} windows but {len(start_logits)} start and {len(end_logits)} end logits: "
                         f"one of each per window")
    best: Optional[Tuple[float, int, int, int]] = None  # (score, window, start, end)
    null_score = float("inf")
    for k, (window, starts, ends) in enumerate(zip(windows, start_logits, end_logits)):
        starts, ends = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
        if starts.ndim != 1 or starts.shape != ends.shape:
            raise ValueError(f"window {k}: start logits of shape {starts.shape} and end logits of shape "
                             f"{ends.shape}: both must be one logit per sample position")
        null_score = min(null_score, float(starts[0] + ends[0]))
        for s in _best_indexes(starts, n_best):
            if s not in window.token_to_word or not window.max_context.get(s, False):
                continue
            for e in _best_indexes(ends, n_best):
                if e not in window.token_to_word or e < s or e - s + 1 > max_answer_length:
                    continue
                score = float(starts[s] + ends[e])
                if best is None or score > best[0]:
                    best = (score, k, s, e)
    if best is None:
        return ""
    if allow_null and null_score - best[0] > null_threshold:
        return ""
    _, k, s, e = best
    return answer_text(words, windows[k].token_to_word[s], windows[k].token_to_word[e])


def squad_scores(predictions: Dict[str, str], questions: Sequence[Question]) -> Dict[str, float]:
    """exact_match and f1 in percent over the questions (a question without a prediction counts as
    predicted ""); with impossible questions also has_answer_* and no_answer_* over each kind and
    their counts has_answer_total / no_answer_total (a kind without questions is left out, as the
    v2.0 script leaves it out)."""
    if not questions:
        raise DataError("no questions to score")
    em: Dict[str, List[float]] = {"has_answer": [], "no_answer": []}
    f: Dict[str, List[float]] = {"has_answer": [], "no_answer": []}
    for q in questions:
        prediction, golds = predictions.get(q.qid, ""), gold_answers(q)
        kind = "no_answer" if q.impossible else "has_answer"
        em[kind].append(exact_match(prediction, golds))
        f[kind].append(f1(prediction, golds))
    total = len(questions)
    out = {"exact_match": 100.0 * sum(em["has_answer"] + em["no_answer"]) / total,
           "f1": 100.0 * sum(f["has_answer"] + f["no_answer"]) / total}
    if em["no_answer"]:
        for kind in ("has_answer", "no_answer"):
            n = len(em[kind])
            if n:
                out[f"{kind}_exact_match"] = 100.0 * sum(em[kind]) / n
                out[f"{kind}_f1"] = 100.0 * sum(f[kind]) / n
                out[f"{kind}_total"] = n
    return out


def squad(cfg, model, tokenizer, path, batch_size: int, *, n_best: int = 20, max_answer_length: int = 30,
          null_threshold: float = 0.0, details=None) -> Dict[str, float]:
    """The squad task of megalm.evaluate: a span-head run's answers to every question of a SQuAD file
    (windows as its training read them), scored with the official definitions. A file with impossible
    questions (v2.0) lets the reader answer nothing. `details`: where to write {question id: answer},
    the official script's predictions file."""
    import json

    import torch

    m = cfg.model
    if not getattr(m, "span_head", False):
        raise ConfigError(f"the squad task scores an extractive-QA run (model.span_head=true); this run is "
                          f"model.arch={m.arch} without a span head")
    if n_best < 1 or max_answer_length < 1:
        raise ConfigError(f"--n-best={n_best} and --max-answer-length={max_answer_length} must be at least 1")
    family = family_of(m.arch)
    make = family.samples(m).qa(tokenizer, m.seq_length, cfg.data.doc_stride, cfg.data.max_query_length)
    questions = read_squad(path)
    allow_null = any(q.impossible for q in questions)
    windows = [(q, make(q)) for q in questions]
    flat = [w for _, ws in windows for w in ws]
    device = next(model.parameters()).device
    model.eval()

    @torch.no_grad()
    def read(part) -> List[np.ndarray]:
        logits: List[np.ndarray] = []
        for b in range(0, len(part), batch_size):
            batch = collate([w.sample for w in part[b:b + batch_size]])
            logits += list(model(*(batch[k].to(device) for k in family.inputs)).float().cpu().numpy())
        return logits

    out = np.stack(across_replicas(model, read, flat))  # (windows, T, 2); data-parallel replicas: a share each
    predictions: Dict[str, str] = {}
    k = 0
    for q, ws in windows:
        part = out[k:k + len(ws)]
        k += len(ws)
        predictions[q.qid] = best_answer(ws, list(part[..., 0]), list(part[..., 1]), words_of(q.context)[0],
                                         n_best=n_best, max_answer_length=max_answer_length, allow_null=allow_null,
                                         null_threshold=null_threshold)
    if details is not None:
        details.write_text(json.dumps(predictions, indent=1) + "\n")
    return {"questions": len(questions), "windows": len(flat), "version": "2.0" if allow_null else "1.1",
            **squad_scores(predictions, questions)}
