"""`python -m megalm.evaluate RUN_DIR TASK --data FILE`: score a trained decoder run.

Tasks (each text is scored as a document: after the end-of-document token, as training saw it):

- perplexity: a text file, in windows of model.seq_length tokens. Window k starts at k * --stride;
  each target token is scored once, by the first window that reaches it, so every token after the
  first window has at least seq_length - stride tokens of context (Megatron's --overlapping-eval;
  --stride seq_length: disjoint windows). Reports the loss (mean NLL per token), perplexity
  exp(min(20, loss)) and Megatron's token-ratio adjusted perplexity for WikiText: the summed NLL
  per original word, words = text.strip().split(" ").
- cloze: LAMBADA JSON lines {"text": ...}, the last word predicted from the rest, by argmax.
  Strict (default): every token of " " + last word must be predicted; --non-strict: only the last
  token of the whole text (Megatron's two modes).
- choice: JSON lines {"context": str, "choices": [str, ...], "label": int}: each choice is scored by
  its log-likelihood after the context (the choice text appended as written: put its leading space
  in it); the highest wins. --normalize tokens | chars divides by the choice's length (acc_norm).

Results are printed as a table and written to RUN_DIR/eval/<task>_<data file stem>.json. The
model runs in this process at the run's single-process layout (checkpoints load at any layout).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megalm.errors import ConfigError, DataError, MissingFileError, cli_errors

PROG = "megalm.evaluate"
TASKS = ("perplexity", "cloze", "choice")
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

    @torch.no_grad()
    def score(self, rows: Sequence[Tuple[List[int], int]]) -> List[Scored]:
        """rows: (ids, k): score ids[t] given ids[:t] for t in [k, len(ids)); 1 <= k < len(ids) and
        len(ids) - 1 <= seq_length (one forward of ids[:-1])."""
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
    ids = [tokenizer.eod] + tokenizer.encode(text)
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


def _lines(path: Path, fields: Sequence[str]) -> List[Tuple[int, Dict[str, Any]]]:
    """(line number, record) of each non-blank JSON line, each with `fields`; errors name file:line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
            missing = [k for k in fields if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise DataError(f"{path}:{n}: no {', '.join(repr(k) for k in missing)} field (needs "
                                f"{', '.join(fields)})")
            records.append((n, rec))
    if not records:
        raise DataError(f"{path} holds no examples")
    return records


def _fits(ids: List[int], seq_length: int, where: str) -> List[int]:
    if len(ids) - 1 > seq_length:
        raise DataError(f"{where}: {len(ids) - 1} tokens to read (end-of-document token included) do not fit "
                        f"model.seq_length={seq_length}")
    return ids


def cloze_rows(tokenizer, path: Path, seq_length: int, strict: bool = True) -> List[Tuple[List[int], int]]:
    """One scoring row per LAMBADA line: [eod] + context + target, and where the target starts."""
    rows = []
    for n, rec in _lines(path, ["text"]):
        text = rec["text"]
        if not isinstance(text, str) or not text.split():
            raise DataError(f"{path}:{n}: 'text' must be a string with at least one word")
        if strict:  # Megatron's: the context before the last word, then " " + the word
            last = text.split()[-1]
            context = tokenizer.encode(text[:text.rfind(last)].strip())
            target = tokenizer.encode(" " + last)
        else:
            tokens = tokenizer.encode(text)
            context, target = tokens[:-1], tokens[-1:]
        rows.append((_fits([tokenizer.eod] + context + target, seq_length, f"{path}:{n}"), 1 + len(context)))
    return rows


def cloze(scorer: Scorer, tokenizer, path: Path, strict: bool = True) -> Dict[str, Any]:
    hits = [bool(s.argmax_hits.all()) for s in scorer.score(cloze_rows(tokenizer, path, scorer.seq_length, strict))]
    return {"examples": len(hits), "strict": strict, "correct": sum(hits), "accuracy": sum(hits) / len(hits)}


def choice_rows(tokenizer, path: Path, seq_length: int) -> Tuple[List[Tuple[List[int], int]], List[Tuple[List[str], int]]]:
    """Scoring rows of every choice of every line ([eod] + context + choice), and each line's
    (choices, label); its rows are consecutive."""
    rows, examples = [], []
    for n, rec in _lines(path, ["context", "choices", "label"]):
        options, label = rec["choices"], rec["label"]
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(c, str) and c for c in options):
            raise DataError(f"{path}:{n}: 'choices' must be a list of at least two non-empty strings")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
            raise DataError(f"{path}:{n}: 'label' {label!r} is not an index into its {len(options)} choices "
                            f"(0..{len(options) - 1})")
        context = [tokenizer.eod] + tokenizer.encode(str(rec["context"]))
        for c in options:
            target = tokenizer.encode(c)
            if not target:
                raise DataError(f"{path}:{n}: the choice {c!r} has no tokens")
            rows.append((_fits(context + target, seq_length, f"{path}:{n}"), len(context)))
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


def evaluate(run_dir: Path, task: str, data: Path, *, stride: Optional[int] = None, strict: bool = True,
             normalize: str = "none", batch_size: int = 8, device: str = "cpu", write: bool = True) -> Dict[str, Any]:
    """Run one task on the run's latest checkpoint; return (and write) its results."""
    from megalm.generate import load_for_generation
    if task not in TASKS:
        raise ConfigError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size={batch_size} must be at least 1")
    data = Path(data).expanduser()
    if not data.is_file():
        raise MissingFileError(f"--data {data} does not exist")
    cfg, model, tok, state = load_for_generation(Path(run_dir), device)
    if cfg.model.arch != "gpt":
        raise ConfigError(f"megalm.evaluate scores decoder models (model.arch=gpt); {run_dir} is "
                          f"model.arch={cfg.model.arch}")
    # The softmax over the model's vocabulary, as training's loss takes it (padding rows excluded).
    scorer = Scorer(model, cfg.model.vocab_size, cfg.model.seq_length, tok.eod, batch_size)
    start = time.perf_counter()
    if task == "perplexity":
        text = data.read_text(encoding="utf-8")
        if not text.strip():
            raise DataError(f"{data} is empty")
        metrics = perplexity(scorer, tok, text, cfg.model.seq_length if stride is None else stride)
    elif task == "cloze":
        metrics = cloze(scorer, tok, data, strict)
    else:
        metrics = choice(scorer, tok, data, normalize)
    results = {"task": task, "data": str(data), "run": str(run_dir), "model": cfg.model.name,
               "step": state["step"], **metrics, "seconds": round(time.perf_counter() - start, 3)}
    if write:
        out = Path(run_dir) / "eval" / f"{task}_{data.stem}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        results["written_to"] = str(out)
    return results


def format_table(results: Dict[str, Any]) -> str:
    rows = [(k, f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in results.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megalm.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("task", choices=TASKS, help="what to score")
    ap.add_argument("--data", type=Path, required=True,
                    help="perplexity: a text file; cloze: JSON lines with 'text'; choice: JSON lines with "
                         "'context', 'choices', 'label'")
    ap.add_argument("--stride", type=int, default=None,
                    help="perplexity: tokens between window starts, 1..seq_length (default seq_length: disjoint)")
    ap.add_argument("--non-strict", action="store_true", help="cloze: score only the last token of the text")
    ap.add_argument("--normalize", default="none", choices=NORMALIZE,
                    help="choice: divide each choice's log-likelihood by its tokens or characters (default none)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        from megalm.generate import _resolve_device
        results = evaluate(args.run_dir, args.task, args.data, stride=args.stride, strict=not args.non_strict,
                           normalize=args.normalize, batch_size=args.batch_size, device=_resolve_device(args.device))
        print(format_table(results))


if __name__ == "__main__":
    main()
