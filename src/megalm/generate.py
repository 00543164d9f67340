"""`python -m megalm.generate RUN_DIR [--prompt ...]`: sample text from a trained run.

Loads the run's frozen config, its tokenizer and the latest checkpoint's weights, then decodes
with a KV cache: the prompt is processed once, then one token per step attends to the cached
keys and values. An encoder-decoder run (T5) reads the prompt as its source: the encoder runs
once, the decoder starts from BOS and stops at EOS. Sampling: temperature, then top-k, then top-p (nucleus, arXiv:1904.09751).

Mistakes in what the user asked for (an option out of range, a prompt the model cannot take, a
run directory without a checkpoint) are MegalmErrors: one line on stderr, exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import torch

from megalm.data import load_tokenizer
from megalm.data.samples.t5 import t5_specials
from megalm.distributed.device import resolve_device
from megalm.errors import ConfigError, MissingFileError, cli_errors
from megalm.models import build_model
from megalm.models.layers import KVCache
from megalm.models.registry import family_of, load_run_config

PROG = "megalm.generate"


def check_prompt(prompt: List[int], vocab_size: int, seq_length: int, what: str = "the prompt",
                 counted: str = "") -> int:
    """The room left after the prompt (>= 1); an error for ids outside the vocabulary or no room.
    `what` names the prompt in messages, `counted` says what its length includes."""
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{what} has token id {bad[0]}, outside the vocabulary of {vocab_size} ids "
                          f"(0..{vocab_size - 1})")
    room = seq_length - len(prompt)
    if room <= 0:
        raise ConfigError(f"{what} is {len(prompt)} tokens{counted} and model.seq_length={seq_length} leaves "
                          f"no room to generate: allowed: at most {seq_length - 1} tokens in all")
    return room


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
    cfg = model.cfg
    use_cache = use_cache and getattr(model, "supports_cache", True)  # a model at a tp/pp layout keeps none
    device = next(model.parameters()).device
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    budget = min(max_new_tokens, check_prompt(prompt, vocab_size or cfg.vocab_size, cfg.seq_length))
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
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


@torch.no_grad()
def generate_seq2seq_ids(model, source: List[int], *, bos: int, eos: Optional[int], max_new_tokens: int,
                         temperature: float = 0.8, top_k: int = 50, top_p: float = 0.95,
                         vocab_size: Optional[int] = None, seed: int = 0, use_cache: bool = True) -> Iterator[int]:
    """An encoder-decoder model's output for `source`, one id at a time: the encoder runs once (and each
    decoder layer's cross-attention keys and values are computed once from it), then the decoder from
    `bos`, a token a step over its KV cache; stops at eos, max_new_tokens or model.decoder_seq_length."""
    cfg = model.cfg
    device = next(model.parameters()).device
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    check_source(source, vocab_size or cfg.vocab_size, cfg.seq_length)
    ids = torch.tensor([source], dtype=torch.long, device=device)
    encoded = model.encode(ids, torch.ones_like(ids))
    cache = KVCache(cfg.num_layers, 1, cfg.kv_heads, cfg.decoder_seq_length, cfg.head_dim, device=device,
                    dtype=next(model.parameters()).dtype) if use_cache else None
    out = torch.tensor([[bos]], dtype=torch.long, device=device)
    logits = model.decode(out, encoded, cache, 0)[:, -1]
    for pos in range(1, min(max_new_tokens, cfg.decoder_seq_length - 1) + 1):
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")  # padded rows are not tokens
        nxt = sample_next(logits, temperature, top_k, top_p, g)
        token = int(nxt.item())
        if eos is not None and token == eos:
            return
        yield token
        if pos == cfg.decoder_seq_length - 1:
            return
        if use_cache:
            logits = model.decode(nxt[:, None], encoded, cache, pos)[:, -1]
        else:
            out = torch.cat([out, nxt[:, None]], dim=1)
            logits = model.decode(out, encoded)[:, -1]


def check_source(source: List[int], vocab_size: int, seq_length: int, what: str = "the source") -> None:
    """An encoder-decoder model's input: ids in the vocabulary, at most model.seq_length of them."""
    if not source:
        raise ConfigError(f"{what} is empty: the encoder needs at least one token")
    bad = [i for i in source if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{what} has token id {bad[0]}, outside the vocabulary of {vocab_size} ids "
                          f"(0..{vocab_size - 1})")
    if len(source) > seq_length:
        raise ConfigError(f"{what} is {len(source)} tokens; the encoder takes model.seq_length={seq_length} at most")


def load_for_generation(run_dir: Path, device: str = "cpu"):
    from megalm.training.checkpoint import Checkpointer, load_model_weights  # lazy: torch's checkpoint library, off `--help`
    cfg = load_run_config(run_dir)
    model = build_model(cfg.model, device=device)
    step_dir = Checkpointer(cfg.checkpoint, run_dir).for_reading()
    if step_dir is None:
        raise MissingFileError(f"no complete checkpoint under {run_dir / cfg.checkpoint.dir}: train this run "
                               "until it saves one (checkpoint.save=true), or point at a run that has one")
    state = load_model_weights(step_dir, model)
    return cfg, model, load_tokenizer(run_dir), state


def check_options(args: argparse.Namespace) -> None:
    """Each sampling option against its range, the range named in the message."""
    for name, value, ok, allowed in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
            ("--temperature", args.temperature, args.temperature >= 0, ">= 0 (0 = greedy)"),
            ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0 = all tokens)"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
            ("--num-samples", args.num_samples, args.num_samples >= 1, ">= 1")):
        if not ok:  # NaN fails every comparison, so it lands here too
            shown = f"{value:g}" if isinstance(value, float) else value
            raise ConfigError(f"{name}={shown} must be {allowed}")


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megalm.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    ap.add_argument("--max-new-tokens", type=int, default=200,
                    help="tokens to generate, at most model.seq_length minus the prompt (default 200)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens; 0 = all (default 50)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus mass to keep; 1 = all (default 0.95)")
    ap.add_argument("--num-samples", type=int, default=1, help="independent samples (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every step (slow; for checks)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        _generate(args)


def scoring_task(model_cfg) -> str:
    """The megalm.evaluate task that scores a run with a fine-tuning head: squad (a span head) or classify."""
    return "squad" if getattr(model_cfg, "span_head", False) else "classify"


def check_generates(cfg, run_dir: Path) -> None:
    """Only a decoder language model or an encoder-decoder (its family's kind) samples text; say what else a
    run is."""
    head = getattr(cfg.model, "fine_tuning_head", False)
    kind = family_of(cfg.model.arch).kind
    if kind in ("decoder", "encoder-decoder") and not head:
        return
    what = ("a fine-tuned scorer with no language-model head" if head else
            f"an {kind} (model.arch={cfg.model.arch}) with no decoder to sample from")
    raise ConfigError(f"{run_dir} is {what}: megalm.generate samples text from decoder language models and "
                      f"encoder-decoder ones" + (f"; score it with `python -m megalm.evaluate {run_dir} "
                                                 f"{scoring_task(cfg.model)} --data FILE`" if head else ""))


def _generate(args: argparse.Namespace) -> None:
    check_options(args)
    check_generates(load_run_config(args.run_dir), args.run_dir)
    cfg, model, tok, state = load_for_generation(args.run_dir, str(resolve_device(args.device, "--device")))
    if hasattr(model, "encode"):
        return _generate_seq2seq(args, cfg, model, tok, state)
    prompt = tok.prompt(args.prompt)  # after the end-of-document token (megalm's), or the model's own start
    lead = len(prompt) - len(tok.encode(args.prompt))
    lead_words = "the end-of-document token" if prompt[:lead] == [tok.eod] else \
        f"{lead} start token{'s' if lead != 1 else ''}"
    room = check_prompt(prompt, tok.vocab_size, cfg.model.seq_length,
                        what="--prompt", counted=f" (with {lead_words} put before it)")
    print(f"# {cfg.model.name} from {args.run_dir} (step {state['step']})", file=sys.stderr)
    if args.max_new_tokens > room:  # the KV cache and positions end at the model's context
        print(f"# generating at most {room} token{'s' if room != 1 else ''}, not {args.max_new_tokens}: prompt "
              f"{len(prompt)} ({lead_words} + {len(prompt) - lead} of --prompt) + --max-new-tokens "
              f"{args.max_new_tokens} > model.seq_length={cfg.model.seq_length}", file=sys.stderr)
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


def _generate_seq2seq(args: argparse.Namespace, cfg, model, tok, state) -> None:
    """An encoder-decoder run: --prompt is the encoder's input; the output is printed on its own."""
    specials = t5_specials(tok)
    source = tok.encode(args.prompt)
    check_source(source, tok.vocab_size, cfg.model.seq_length, what="--prompt")
    print(f"# {cfg.model.name} from {args.run_dir} (step {state['step']}); source: {args.prompt!r}", file=sys.stderr)
    room = cfg.model.decoder_seq_length - 1  # the decoder's positions after [BOS]
    if args.max_new_tokens > room:
        print(f"# generating at most {room} token{'s' if room != 1 else ''}, not {args.max_new_tokens}: "
              f"model.decoder_seq_length={cfg.model.decoder_seq_length} holds [BOS] and {room} more", file=sys.stderr)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n# --- sample {i + 1} ---")
        ids = list(generate_seq2seq_ids(model, source, bos=specials.bos, eos=specials.eos,
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_k=args.top_k, top_p=args.top_p, vocab_size=tok.vocab_size,
                                        seed=args.seed + i, use_cache=not args.no_cache))
        print(tok.decode(ids))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
