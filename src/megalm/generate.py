"""`python -m megalm.generate RUN_DIR [--prompt ...]`: sample text from a trained run.

Loads the run's frozen config, its tokenizer and the latest checkpoint's weights, then decodes
with a KV cache: the prompt is processed once, then one token per step attends to the cached
keys and values. Sampling: temperature, then top-k, then top-p (nucleus, arXiv:1904.09751).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import torch
from omegaconf import OmegaConf

from megalm.config import Config


def load_run_config(run_dir: Path) -> Config:
    path = run_dir / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: point at a run directory written by megalm.train")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path)))


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits (B, V) → next ids (B,). temperature 0 = greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(model, prompt: List[int], *, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int = 50, top_p: float = 0.95, vocab_size: Optional[int] = None,
                 eod: Optional[int] = None, seed: int = 0, use_cache: bool = True) -> Iterator[int]:
    """Yield new token ids one at a time (stops at eod, max_new_tokens or the model's context)."""
    from megalm.models import KVCache
    cfg = model.cfg
    device = next(model.parameters()).device
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    budget = min(max_new_tokens, cfg.seq_length - ids.shape[1])
    if budget <= 0:
        raise ValueError(f"the prompt has {ids.shape[1]} tokens; model.seq_length={cfg.seq_length} leaves no room")
    cache = KVCache(cfg.num_layers, 1, cfg.kv_heads, cfg.seq_length, cfg.head_dim, device=device,
                    dtype=next(model.parameters()).dtype) if use_cache else None
    logits = model(ids, cache=cache, start=0)[:, -1]
    pos = ids.shape[1]
    for _ in range(budget):
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")  # padded rows are not tokens
        nxt = sample_next(logits, temperature, top_k, top_p, g)
        token = int(nxt.item())
        if eod is not None and token == eod:
            return
        yield token
        if use_cache:
            logits = model(nxt[:, None], cache=cache, start=pos)[:, -1]
        else:
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            logits = model(ids)[:, -1]
        pos += 1


def load_for_generation(run_dir: Path, device: str = "cpu"):
    from megalm.data import load_tokenizer
    from megalm.models import build_model
    from megalm.training.checkpoint import Checkpointer, load_model_weights
    cfg = load_run_config(run_dir)
    model = build_model(cfg.model, device=device)
    step_dir = Checkpointer(cfg.checkpoint, run_dir).latest()
    if step_dir is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / cfg.checkpoint.dir}")
    state = load_model_weights(step_dir, model)
    return cfg, model, load_tokenizer(run_dir), state


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megalm.generate", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens; 0 = all (default 50)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus mass to keep; 1 = all (default 0.95)")
    ap.add_argument("--num-samples", type=int, default=1, help="independent samples (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every step (slow; for checks)")
    args = ap.parse_args(argv)
    for name, value, ok in (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens > 0),
                            ("--temperature", args.temperature, args.temperature >= 0),
                            ("--top-k", args.top_k, args.top_k >= 0),
                            ("--top-p", args.top_p, 0 < args.top_p <= 1),
                            ("--num-samples", args.num_samples, args.num_samples > 0)):
        if not ok:
            ap.error(f"{name}={value} is out of range")
    try:
        cfg, model, tok, state = load_for_generation(args.run_dir, args.device)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"megalm.generate: {e}") from None
    print(f"# {cfg.model.name} from {args.run_dir} (step {state['step']})", file=sys.stderr)
    # Training packs documents after an end-of-document token, so eod is the start-of-text marker.
    prompt = [tok.eod] + tok.encode(args.prompt)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n# --- sample {i + 1} ---")
        sys.stdout.write(args.prompt)
        base = tok.decode(prompt)
        pending: List[int] = []
        printed = ""
        for token in generate_ids(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, vocab_size=tok.vocab_size, eod=tok.eod,
                                  seed=args.seed + i, use_cache=not args.no_cache):
            pending.append(token)
            # Decode prompt + tail together: a piece's leading space and multi-byte characters
            # only come out right in context.
            text = tok.decode(prompt + pending)[len(base):]
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
        sys.stdout.write(tok.decode(prompt + pending)[len(base):][len(printed):] + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
