"""Tasks scored by log-likelihood: perplexity, LAMBADA cloze, multiple choice (megalm.evaluate)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch

from megalm.data.formats.jsonl import json_lines
from megalm.errors import ConfigError, DataError

NORMALIZE = ("none", "tokens", "chars")
MAX_LOSS_FOR_PPL = 20.0  # Megatron's cap: exp(min(20, loss))


@dataclass
class Scored:
    """One scored span: the log-probability of each target token, and whether it was the argmax."""
    logprobs: torch.Tensor  # (n,) float64
    argmax_hits: torch.Tensor  # (n,) bool


class Scorer:
    """Log-probabilities of target spans from a causal model, batched."""

    def __init__(self, model, vocab_size: int, seq_length: int, pad: int, batch_size: int = 8):
        self.model, self.vocab_size, self.seq_length, self.pad = model.eval(), vocab_size, seq_length, pad
        self.batch_size = batch_size
        self.device = next(model.parameters()).device

    def score(self, rows: Sequence[Tuple[List[int], int]]) -> List[Scored]:
        """rows: (ids, k): score ids[t] given ids[:t] for t in [k, len(ids)); 1 <= k < len(ids) and
        len(ids) - 1 <= seq_length (one forward of ids[:-1]). Data-parallel replicas of a model at a
        layout score a share each (megalm.evaluate.layout.across_replicas)."""
        from megalm.evaluate.layout import across_replicas  # lazy: the model stack, off evaluate's `--help`
        return across_replicas(self.model, self._score, rows)

    @torch.no_grad()
    def _score(self, rows: Sequence[Tuple[List[int], int]]) -> List[Scored]:
        out: List[Scored] = []
        for b in range(0, len(rows), self.batch_size):
            batch = rows[b:b + self.batch_size]
            width = max(len(ids) - 1 for ids, _ in batch)
            inputs = torch.full((len(batch), width), self.pad, dtype=torch.long)
            for r, (ids, _) in enumerate(batch):  # padding after a row cannot change it (causal)
                inputs[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            logits = self.model(inputs.to(self.device))[..., :self.vocab_size].double()  # (B, T, V), no padding rows
            logp = torch.log_softmax(logits, dim=-1).cpu()
            for r, (ids, k) in enumerate(batch):
                targets = torch.tensor(ids[k:])
                rows_lp = logp[r, k - 1:len(ids) - 1]  # position t - 1 predicts ids[t]
                out.append(Scored(rows_lp.gather(-1, targets[:, None])[:, 0], rows_lp.argmax(-1) == targets))
        return out


def windows(n: int, seq_length: int, stride: int) -> List[Tuple[int, int, int]]:
    """(start, end, first) of each window over ids[0:n]: inputs ids[start:end], targets
    ids[start + 1:end + 1], of which those from index `first` on are new. Every target 1..n-1 once."""
    if not 1 <= stride <= seq_length:
        raise ConfigError(f"--stride={stride} must be in [1, model.seq_length={seq_length}]")
    out, scored, start = [], 0, 0
    while scored < n - 1:
        end = min(start + seq_length, n - 1)
        out.append((start, end, max(scored, start) + 1))
        scored, start = end, start + stride
    return out


def perplexity(scorer: Scorer, tokenizer, text: str, stride: int) -> Dict[str, Any]:
    ids = tokenizer.context + tokenizer.encode(text)
    if len(ids) < 2:
        raise DataError("the text has no tokens to score")
    spans = windows(len(ids), scorer.seq_length, stride)
    scored = scorer.score([(ids[s:e + 1], first - s) for s, e, first in spans])
    nll = -float(sum(s.logprobs.sum() for s in scored))
    count = len(ids) - 1
    words = len(text.strip().split(" "))
    loss = nll / count
    return {"tokens": count, "words": words, "windows": len(spans), "stride": stride, "nll": nll, "loss": loss,
            "ppl": math.exp(min(MAX_LOSS_FOR_PPL, loss)),
            "adjusted_ppl": math.exp(min(MAX_LOSS_FOR_PPL, nll / words)), "token_ratio": count / words}


def read_jsonl(path: Path, fields: Sequence[str]) -> List[Tuple[str, Dict[str, Any]]]:
    """("file:line", record) of each non-blank JSON line, each with `fields`; errors name file:line."""
    records = []
    for where, rec in json_lines(path):
        missing = [k for k in fields if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise DataError(f"{where}: no {', '.join(repr(k) for k in missing)} field (needs {', '.join(fields)})")
        records.append((where, rec))
    if not records:
        raise DataError(f"{path} holds no examples")
    return records


def fits(ids: List[int], seq_length: int, where: str) -> List[int]:
    if len(ids) - 1 > seq_length:
        raise DataError(f"{where}: {len(ids) - 1} tokens to read (end-of-document token included) do not fit "
                        f"model.seq_length={seq_length}")
    return ids


def cloze_rows(tokenizer, path: Path, seq_length: int, strict: bool = True) -> List[Tuple[List[int], int]]:
    """One scoring row per LAMBADA line: tokenizer.context + context + target, and where the target starts."""
    rows = []
    for where, rec in read_jsonl(path, ["text"]):
        text = rec["text"]
        if not isinstance(text, str) or not text.split():
            raise DataError(f"{where}: 'text' must be a string with at least one word")
        if strict:  # Megatron's: the context before the last word, then " " + the word
            last = text.split()[-1]
            context = tokenizer.encode(text[:text.rfind(last)].strip())
            target = tokenizer.encode(" " + last)
        else:
            tokens = tokenizer.encode(text)
            context, target = tokens[:-1], tokens[-1:]
        context = tokenizer.context + context
        rows.append((fits(context + target, seq_length, where), len(context)))
    return rows


def cloze(scorer: Scorer, tokenizer, path: Path, strict: bool = True) -> Dict[str, Any]:
    hits = [bool(s.argmax_hits.all()) for s in scorer.score(cloze_rows(tokenizer, path, scorer.seq_length, strict))]
    return {"examples": len(hits), "strict": strict, "correct": sum(hits), "accuracy": sum(hits) / len(hits)}


Rows = List[Tuple[List[int], int]]


def split_context(context: str, continuation: str) -> Tuple[str, str]:
    """(context, continuation) with the context's trailing whitespace moved to the front of the continuation, as
    lm-evaluation-harness's own models split them: a tokenizer reads a space as the start of the word after it."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


def choice_rows(tokenizer, path: Path, seq_length: int) -> Tuple[Rows, List[Tuple[List[str], int]]]:
    """Scoring rows of every choice of every line (tokenizer.context + context + choice, split as `split_context`
    splits them: the harness's convention), and each line's (choices, label); its rows are consecutive."""
    rows, examples = [], []
    for where, rec in read_jsonl(path, ["context", "choices", "label"]):
        options, label = rec["choices"], rec["label"]
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(c, str) and c for c in options):
            raise DataError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
            raise DataError(f"{where}: 'label' {label!r} is not an index into its {len(options)} choices "
                            f"(0..{len(options) - 1})")
        for c in options:
            before, after = split_context(str(rec["context"]), c)
            context, target = tokenizer.context + tokenizer.encode(before), tokenizer.encode(after)
            if not target:
                raise DataError(f"{where}: the choice {c!r} has no tokens")
            rows.append((fits(context + target, seq_length, where), len(context)))
        examples.append((options, label))
    return rows, examples


def choice(scorer: Scorer, tokenizer, path: Path, normalize: str = "none") -> Dict[str, Any]:
    if normalize not in NORMALIZE:
        raise ConfigError(f"--normalize={normalize!r} is not one of {', '.join(NORMALIZE)}")
    rows, examples = choice_rows(tokenizer, path, scorer.seq_length)
    scored = iter(scorer.score(rows))
    correct = 0
    for options, label in examples:
        scores = []
        for c in options:
            lp = next(scored).logprobs
            scores.append(float(lp.sum()) / {"none": 1, "tokens": len(lp), "chars": len(c)}[normalize])
        correct += int(max(range(len(options)), key=scores.__getitem__) == label)
    return {"examples": len(examples), "normalize": normalize, "correct": correct,
            "accuracy": correct / len(examples)}
