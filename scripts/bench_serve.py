"""Serving throughput: megalm.serve at several concurrencies against the same requests one by one,
and against Hugging Face transformers' `generate` on the same weights, in one run.

A server process serves the run; clients send the same N completion requests (greedy, at most
--max-tokens new tokens, ending early at the end-of-document token as both systems do) with 1, 8
and 32 in flight at a time. Concurrency 1 is the requests one by one through the server. The
transformers model is the run exported to Hugging Face's format, generating each request alone in
this process (batch 1, its KV cache), as a client would without a server. Reported: requests/s,
generated tokens/s, latency p50 / p99, and each row's tokens/s relative to one by one.

    python scripts/bench_serve.py RUN_DIR                      # 64 requests of 64 tokens
    python scripts/bench_serve.py RUN_DIR --requests 32 --max-tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

PROMPTS = ["import os\n", "def main():\n", "class Config:\n    def", "for i in range(10):\n", "# Utilities\n",
           "def parse(text):\n    \"\"\"", "try:\n    import", "with open(path) as f:\n"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run directory with a checkpoint (a decoder)")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests in flight")
    p.add_argument("--slots", type=int, default=32, help="the server's --slots")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(run_dir: Path, slots: int, max_queue: int):
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "megalm.serve", str(run_dir), "--port", str(port), "--slots",
                             str(slots), "--max-queue", str(max_queue)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


async def _clients(url: str, prompts, concurrency: int, max_tokens: int):
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies, tokens = [], []

    async def client(http):
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            r = await http.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                "temperature": 0, "stop": None})
            r.raise_for_status()
            latencies.append(time.perf_counter() - start)
            tokens.append(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - start, latencies, tokens


def _row(name, seconds, latencies, tokens):
    latencies = sorted(latencies)
    return {"system": name, "requests": len(latencies), "seconds": round(seconds, 3),
            "requests_per_s": round(len(latencies) / seconds, 3), "tokens_per_s": round(sum(tokens) / seconds, 1),
            "latency_p50_s": round(latencies[len(latencies) // 2], 3),
            "latency_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "tokens": sum(tokens)}


def hf_generate(run_dir: Path, prompts, max_tokens: int):
    """transformers' generate on the exported weights, each request alone (batch 1, KV cache, greedy)."""
    import transformers
    from megalm.convert import export_to_hf
    from megalm.data import load_tokenizer
    tok = load_tokenizer(run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model = transformers.AutoModelForCausalLM.from_pretrained(export_to_hf(run_dir, Path(tmp) / "hf")).eval()
    latencies, tokens = [], []
    start = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            t0 = time.perf_counter()
            ids = torch.tensor([[tok.eod] + tok.encode(p)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=tok.eod, pad_token_id=tok.eod)
            latencies.append(time.perf_counter() - t0)
            new = out[0, ids.shape[1]:].tolist()
            tokens.append(new.index(tok.eod) if tok.eod in new else len(new))  # as the server counts
    return time.perf_counter() - start, latencies, tokens


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # this process is the clients (and transformers, timed on its own)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(args.requests)]
    proc, url = start_server(args.run_dir, args.slots, max(args.concurrency) + args.requests)
    rows = []
    try:
        asyncio.run(_clients(url, prompts[:4], 2, 4))  # warm-up
        for c in args.concurrency:
            rows.append(_row(f"megalm.serve, {c} in flight", *asyncio.run(_clients(url, prompts, c, args.max_tokens))))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    torch.set_num_threads(os.cpu_count() or 1)  # as many as the server's process had
    rows.append(_row("transformers generate, one by one", *hf_generate(args.run_dir, prompts, args.max_tokens)))
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_one_by_one"] = round(r["tokens_per_s"] / base, 2)
    width = max(len(r["system"]) for r in rows)
    print(f"{'system':<{width}}  req/s   tok/s   p50 s   p99 s   vs 1-by-1")
    for r in rows:
        print(f"{r['system']:<{width}}  {r['requests_per_s']:5.2f}  {r['tokens_per_s']:6.1f}  {r['latency_p50_s']:6.3f}"
              f"  {r['latency_p99_s']:6.3f}   {r['vs_one_by_one']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
