"""megalm as an lm-evaluation-harness model: any harness task on a megalm run directory.

    python -m megalm.evaluate.harness RUN_DIR --tasks lambada_openai,hellaswag [--include-path DIR] [--tp 2 --pp 2]

or from Python, `lm_eval.simple_evaluate(model="megalm", model_args={"run_dir": RUN_DIR}, ...)` once
this module is imported (it registers the name). Needs the `megalm[harness]` extra (lm_eval); the
harness fetches its tasks' data sets itself, so offline runs use tasks over local files
(`--include-path`; when that folder holds every task asked for, the harness's own task index is not built).

Every text is read as a document (after tokenizer.context: the end-of-document token, or an imported model's
own start token), as training saw it and as
megalm.evaluate scores it: loglikelihood gives the log-probability of the continuation after the
context (trailing spaces of the context move to the continuation, as the harness's own models
do; a context too long for the model loses its oldest tokens), loglikelihood_rolling the summed
log-probability of a string over disjoint windows of model.seq_length, generate_until greedy or
sampled text cut at the first stop string.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from megalm.errors import ConfigError, cli_errors, did_you_mean
from megalm.evaluate.generation import complete
from megalm.evaluate.layout import check_layout, is_rank0, load_at_layout, on_ranks
from megalm.evaluate.likelihood import Scorer, split_context, windows
from megalm.generate import load_for_generation
from megalm.models.registry import family_of

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # the optional extra
    raise ConfigError(f"megalm.evaluate.harness needs lm-evaluation-harness ({e}): pip install "
                      "'megalm[harness]'") from None

PROG = "megalm.evaluate.harness"


@register_model("megalm")
class MegalmLM(LM):
    """A megalm run directory's latest checkpoint, in this process, or with tp / pp at that layout
    over the ranks of this process group (megalm.evaluate.layout; every rank scores every request,
    so the harness's own rank and world size stay 0 and 1). The harness also hands over
    `max_batch_size`, which a fixed batch size does not need."""

    def __init__(self, run_dir: str, device: str = "cpu", batch_size: Any = 8, max_batch_size: Any = None,
                 tp: Any = 1, pp: Any = 1) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("tp", tp), ("pp", pp)):
            if not str(value).isdigit() or int(value) < 1:
                raise ConfigError(f"{name}={value!r}: megalm takes a whole number (>= 1)")
        tp, pp = int(tp), int(pp)
        if tp * pp > 1:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise ConfigError(f"tp={tp} x pp={pp} runs the model over {tp * pp} ranks: start "
                                  f"python -m {PROG} --tp {tp} --pp {pp}, or the harness under torchrun "
                                  f"--nproc-per-node {tp * pp} with this process group initialised")
            self.cfg, self.model, self.tokenizer, self.state = load_at_layout(Path(run_dir), tp, pp, device)
        else:
            self.cfg, self.model, self.tokenizer, self.state = load_for_generation(Path(run_dir), device)
        kind = family_of(self.cfg.model.arch).kind
        if kind != "decoder":
            raise ConfigError(f"the harness scores decoder models; {run_dir} is model.arch={self.cfg.model.arch}, "
                              f"an {kind}")
        self.seq_length = self.cfg.model.seq_length
        self.scorer = Scorer(self.model, self.cfg.model.vocab_size, self.seq_length, self.tokenizer.eod,
                             int(batch_size))

    def _row(self, context: str, continuation: str) -> Tuple[List[int], int]:
        context, continuation = split_context(context, continuation)
        ctx = self.tokenizer.context + self.tokenizer.encode(context)
        cont = self.tokenizer.encode(continuation)
        if not cont:
            raise ConfigError(f"the continuation {continuation!r} has no tokens to score")
        keep = self.seq_length + 1 - len(cont)  # the oldest context goes first
        if keep < 1:
            raise ConfigError(f"a continuation of {len(cont)} tokens does not fit model.seq_length={self.seq_length}")
        ctx = ctx[-keep:]
        return ctx + cont, len(ctx)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        scored = self.scorer.score([self._row(*r.args) for r in requests])
        return [(float(s.logprobs.sum()), bool(s.argmax_hits.all())) for s in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        out = []
        for r in requests:
            ids = self.tokenizer.context + self.tokenizer.encode(r.args[0])
            if len(ids) < 2:
                out.append(0.0)
                continue
            spans = windows(len(ids), self.seq_length, self.seq_length)
            scored = self.scorer.score([(ids[s:e + 1], first - s) for s, e, first in spans])
            out.append(float(sum(s.logprobs.sum() for s in scored)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out = []
        for r in requests:
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            ids = self.tokenizer.encode(context)
            room = self.seq_length - 1 - max(1, min(max_new, self.seq_length // 2))
            text = self.tokenizer.decode(ids[-room:]) if len(ids) > room else context  # keep the newest context
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            out.append(complete(self.model, self.tokenizer, text, max_new_tokens=max_new, stop=until,
                                seq_length=self.seq_length, vocab_size=self.tokenizer.vocab_size,
                                temperature=temperature, seed=int(kwargs.pop("seed", 0) or 0),
                                where="generate_until"))
        return out


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("--tasks", required=True, help="comma-separated harness task names")
    ap.add_argument("--include-path", default=None, help="a folder of task YAML files of your own")
    ap.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the model runs over (default 1)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages the model runs over (default 1)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        results = run_harness(args.run_dir, args.tasks.split(","), include_path=args.include_path, limit=args.limit,
                              num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=args.device,
                              tp=args.tp, pp=args.pp)
        if results is not None and int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(results, indent=1, default=str))


def run_harness(run_dir: Path, tasks: List[str], *, include_path: Optional[str] = None, limit=None,
                num_fewshot: Optional[int] = None, batch_size: int = 8, device: str = "cpu", tp: int = 1,
                pp: int = 1) -> Dict[str, Any]:
    """lm_eval.simple_evaluate on the run (at tp x pp over as many ranks: this process's launcher's, or
    ranks started here); the per-task metrics, also written (by rank 0) to RUN_DIR/eval/harness.json."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp {tp} and --pp {pp} must be at least 1")
    if tp * pp > 1:
        check_layout(Path(run_dir), tp, pp)
        return on_ranks(tp * pp, device, _run_harness, run_dir, tasks, include_path, limit, num_fewshot, batch_size,
                        device, tp, pp)
    return _run_harness(run_dir, tasks, include_path, limit, num_fewshot, batch_size, device, tp, pp)


def _task_manager(task_manager_class, tasks: List[str], include_path: Optional[str]):
    """The harness's task index: the --include-path folder alone when it holds every task asked for (indexing
    the harness's own ~15,000 task files takes seconds), else that folder and the harness's own tasks."""
    if include_path:
        local = task_manager_class(include_path=include_path, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return task_manager_class(include_path=include_path)


def _check_tasks(manager, tasks: List[str], include_path: Optional[str]) -> None:
    """Each task a name the harness's index holds (a task, group or tag) or a task YAML file, as it loads them."""
    for task in tasks:
        if task not in manager.all_tasks and not Path(task).expanduser().is_file():
            raise ConfigError(f"--tasks {task}: not a task, group or tag the harness knows"
                              f"{did_you_mean(task, manager.all_tasks)}; `lm-eval ls tasks` lists them"
                              + ("" if include_path else ", and --include-path DIR adds a folder of your own"))


def _run_harness(run_dir, tasks, include_path, limit, num_fewshot, batch_size, device, tp,
                 pp) -> Optional[Dict[str, Any]]:
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = _task_manager(TaskManager, tasks, include_path)
    _check_tasks(manager, tasks, include_path)  # before the model loads, not as the harness's KeyError after
    model = MegalmLM(str(run_dir), device=device, batch_size=batch_size, tp=tp, pp=pp)
    out = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, log_samples=False)
    if out is None:  # the harness returns its results on the first rank only (LOCAL_RANK 0, under a launcher)
        return None
    results = {"run": str(run_dir), "step": model.state["step"], "tp": tp, "pp": pp, "results": out["results"]}
    if is_rank0():
        path = Path(run_dir) / "eval" / "harness.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


if __name__ == "__main__":
    main()
