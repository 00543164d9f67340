"""`python -m megalm.serve RUN_DIR [--host 127.0.0.1 --port 5000] [--tp N --pp M]`: serve a trained
decoder run (or, on one process, an encoder-decoder run) over HTTP.

The run's latest checkpoint answers Megatron's `PUT /api`, OpenAI's `/v1/completions` and
`/v1/chat/completions` (streamed as server-sent events when asked), `/v1/models` and `/health`
(api.py); concurrent requests are decoded together with continuous batching (engine.py). With
--tp / --pp the model runs at that layout over tp x pp ranks, started here or by torchrun: rank 0
takes the HTTP requests and tells the others each forward it runs, so every rank runs the same
steps and none waits on a request it never saw. SIGTERM or Ctrl-C stops taking requests, finishes
those in flight, stops the other ranks, and exits 0. Needs the `megalm[serve]` extra (FastAPI,
uvicorn).

An encoder-decoder run (a family of kind encoder-decoder: T5) reads each prompt as its source and answers with the
decoder's output (a translation, a summary), to [EOS] or max_tokens; it is served by
`Seq2SeqEngine`, on one process. Chat, echo and scoring prompts belong to decoder models and are
answered 400 for it.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
from pathlib import Path
from typing import List, Optional

from megalm.errors import ConfigError, cli_errors

PROG = "megalm.serve"
log = logging.getLogger("megalm.serve")
RANK_WAIT_S = 365 * 24 * 3600.0  # the other ranks wait for rank 0's next forward as long as the server runs


def _check(cfg, run_dir, layout: bool = False) -> str:
    """The kind of a run this server can generate with: a decoder language model (at any layout), or an
    encoder-decoder one (in one process); its family's kind decides, so a new decoder family is served as GPT
    is."""
    from megalm.models.registry import family_of  # lazy: Hydra and the families' schemas, off `--help`
    kind = family_of(cfg.model.arch).kind
    if kind == "encoder-decoder":
        if layout:
            raise ConfigError(f"{run_dir} is an encoder-decoder model (model.arch={cfg.model.arch}), which "
                              "megalm.serve runs on one process: drop --tp / --pp")
        return kind
    head = getattr(cfg.model, "fine_tuning_head", False)
    if kind != "decoder" or head:
        raise ConfigError(f"megalm.serve generates text with decoder language models and encoder-decoder ones; "
                          f"{run_dir} is model.arch={cfg.model.arch}, "
                          + ("a decoder with a fine-tuning head" if kind == "decoder" else f"an {kind}"))
    return kind


def _check_address(host: str, port: int) -> None:
    """Bind host:port once and let it go: an address in use (or not this machine's) is said before the model loads,
    not by the HTTP server after it."""
    import socket
    if port == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
            sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose another port "
                          "(0: any free one) or a host address of this machine") from None


def build(run_dir: Path, *, device: str = "cpu", slots: int = 8, max_queue: int = 64, seed: int = 0,
          name: Optional[str] = None, tp: int = 1, pp: int = 1):
    """(FastAPI app, Engine) for the run, on this process (tp x pp = 1) or as rank 0 of a layout whose
    process group is up; on the other ranks of a layout, follow rank 0 and return None."""
    from megalm.serve.engine import Engine, Ranks, Seq2SeqEngine  # lazy: torch and the models, off `--help`
    if slots < 1 or max_queue < 1:
        raise ConfigError(f"--slots {slots} and --max-queue {max_queue} must be at least 1")
    ranks = None
    if tp * pp > 1:
        import torch.distributed as dist
        from megalm.evaluate.layout import load_at_layout  # lazy: as the engine
        cfg, model, tok, state = load_at_layout(Path(run_dir), tp, pp, device)
        kind = _check(cfg, run_dir, layout=True)
        ranks = Ranks(next(model.parameters()).device)
        if dist.get_rank() != 0:
            # these ranks stop when rank 0 tells them; the signals are rank 0's to act on
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            ranks.follow(model, slots, cfg.model.seq_length)
            return None
    else:
        from megalm.generate import load_for_generation  # lazy: as the engine
        cfg, model, tok, state = load_for_generation(Path(run_dir), device)
        kind = _check(cfg, run_dir)
    from megalm.serve.api import Server, create_app  # lazy: fastapi, an extra (megalm[serve])
    if kind == "encoder-decoder":
        engine: Engine = Seq2SeqEngine(model, tok, slots=slots, max_queue=max_queue, seed=seed)
    else:
        engine = Engine(model, tok, seq_length=cfg.model.seq_length, slots=slots, max_queue=max_queue, seed=seed,
                        ranks=ranks)
    server = Server(engine, tok, model_name=name or f"{cfg.model.name}-step{state['step']}",
                    seq_length=cfg.model.seq_length, chat_template=cfg.data.chat_template)
    return create_app(server), engine


def serve(run_dir: Path, host: str, port: int, **options) -> None:
    """Build and run the server until SIGTERM / SIGINT (on a follower rank: until rank 0 stops)."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    built = build(run_dir, **options)
    if built is None:
        return
    app, engine = built
    log.info("serving %s on http://%s:%d", run_dir, host, port)
    # uvicorn stops on SIGTERM / SIGINT once the requests in flight have their answers, then raises the
    # signal again for the handler it found: these handlers make that the orderly exit (status 0)
    signal.signal(signal.SIGTERM, lambda signum, frame: log.info("stopped by SIGTERM"))
    signal.signal(signal.SIGINT, lambda signum, frame: log.info("stopped by SIGINT"))
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=300)
    finally:
        engine.stop(timeout=60)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=5000, help="port (default 5000, as Megatron's server)")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded together at most (default 8)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a slot at most; more are answered 503 (default 64)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the model runs over (default 1)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages the model runs over (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seeds requests that give none (default 0)")
    ap.add_argument("--name", default=None, help="the model's name in the API (default <model>-step<N>)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        from megalm.distributed.device import resolve_device  # lazy: importing megalm.serve stays free of torch
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port {args.port} must be 0 to 65535 (0: any free port)")
        _check_address(args.host, args.port)
        if args.tp < 1 or args.pp < 1:
            raise ConfigError(f"--tp {args.tp} and --pp {args.pp} must be at least 1")
        options = dict(device=str(resolve_device(args.device, "--device")), slots=args.slots,
                       max_queue=args.max_queue, seed=args.seed, name=args.name, tp=args.tp, pp=args.pp)
        if args.tp * args.pp == 1:
            return serve(args.run_dir, args.host, args.port, **options)
        from megalm.evaluate.layout import check_layout, on_ranks  # lazy: torch, only for a layout
        from megalm.models.registry import load_run_config  # lazy: as _check's
        _check(load_run_config(args.run_dir), args.run_dir, layout=True)  # before the layout's own checks
        check_layout(args.run_dir, args.tp, args.pp)
        if "RANK" not in os.environ:  # the ranks start here: pass SIGTERM on; Ctrl-C reaches them itself
            signal.signal(signal.SIGTERM, lambda signum, frame: [
                os.kill(child.pid, signum) for child in multiprocessing.active_children()])
            signal.signal(signal.SIGINT, lambda signum, frame: None)
        on_ranks(args.tp * args.pp, options["device"], serve, args.run_dir, args.host, args.port,
                 wait_s=RANK_WAIT_S, **options)


if __name__ == "__main__":
    main()
