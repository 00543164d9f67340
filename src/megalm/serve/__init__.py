"""`python -m megalm.serve RUN_DIR [--host 127.0.0.1 --port 5000]`: serve a trained decoder run over HTTP.

The run's latest checkpoint (or --step's) answers Megatron's `PUT /api`, OpenAI's
`/v1/completions` and `/v1/chat/completions` (streamed as server-sent events when asked),
`/v1/models` and `/health` (api.py); concurrent requests are decoded together with continuous
batching (engine.py). SIGTERM or Ctrl-C stops taking requests, finishes those in flight, and exits
0. Needs the `megalm[serve]` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import List, Optional

from megalm.errors import ConfigError, cli_errors

PROG = "megalm.serve"
log = logging.getLogger("megalm.serve")


def build(run_dir: Path, *, device: str = "cpu", slots: int = 8, max_queue: int = 64, seed: int = 0,
          name: Optional[str] = None):
    """(FastAPI app, Engine) for the run."""
    from megalm.generate import load_for_generation
    from megalm.serve.api import Server, create_app
    from megalm.serve.engine import Engine
    if slots < 1 or max_queue < 1:
        raise ConfigError(f"--slots {slots} and --max-queue {max_queue} must be at least 1")
    cfg, model, tok, state = load_for_generation(Path(run_dir), device)
    if cfg.model.arch != "gpt" or getattr(cfg.model, "fine_tuning_head", False):
        raise ConfigError(f"megalm.serve generates text with decoder language models; {run_dir} is "
                          f"model.arch={cfg.model.arch}" + (" with a fine-tuning head" if cfg.model.arch == "gpt" else ""))
    engine = Engine(model, tok, seq_length=cfg.model.seq_length, slots=slots,
                    max_queue=max_queue, seed=seed)
    server = Server(engine, tok, model_name=name or f"{cfg.model.name}-step{state['step']}",
                    seq_length=cfg.model.seq_length, chat_template=cfg.data.chat_template)
    return create_app(server), engine


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory written by megalm.train")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=5000, help="port (default 5000, as Megatron's server)")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded together at most (default 8)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a slot at most; more are answered 503 (default 64)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seeds requests that give none (default 0)")
    ap.add_argument("--name", default=None, help="the model's name in the API (default <model>-step<N>)")
    args = ap.parse_args(argv)
    with cli_errors(PROG):
        import uvicorn
        from megalm.generate import _resolve_device
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        app, engine = build(args.run_dir, device=_resolve_device(args.device), slots=args.slots,
                            max_queue=args.max_queue, seed=args.seed, name=args.name)
        log.info("serving %s on http://%s:%d", args.run_dir, args.host, args.port)
        # uvicorn stops on SIGTERM / SIGINT once the requests in flight have their answers, then raises the
        # signal again for the handler it found: these handlers make that the orderly exit (status 0)
        signal.signal(signal.SIGTERM, lambda signum, frame: log.info("stopped by SIGTERM"))
        signal.signal(signal.SIGINT, lambda signum, frame: log.info("stopped by SIGINT"))
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=300)
        finally:
            engine.stop(timeout=60)


if __name__ == "__main__":
    main()
