"""The HTTP API of megalm.serve, on FastAPI: Megatron's and OpenAI's endpoints over one Engine.

- `PUT /api`: Megatron-LM's text-generation server's request and response. Fields: prompts (a
  list of strings), tokens_to_generate (64), temperature (1.0, in (0, 100]), top_k (0), top_p
  (0.0; not together with top_k), logprobs (false), add_BOS (false: prepend the start token: the
  end-of-document token, or an imported model's own), stop_on_eol, stop_on_double_eol (false),
  random_seed (-1: none). The answer holds `text` (each prompt followed by its generation), `segments`
  (their tokens as text) and, with logprobs, `logprobs` (of every token after the first).
  tokens_to_generate=0 scores the prompts.
- `POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's (prompt or messages, max_tokens,
  temperature, top_p, n, stream, stream_options.include_usage, stop, logprobs, echo, seed, user,
  presence_penalty, frequency_penalty, logit_bias; completions also best_of); `stream: true` sends
  server-sent events, with include_usage a last chunk holding the usage. A text prompt is read as a
  document, after the end-of-document token, as training saw it (an imported model: after its own
  start tokens, none for many); token-id prompts (a list of ids, or a list of such lists) as given;
  chat messages are written with the model's own Jinja chat template where it has one, else the run's
  data.chat_template, and the reply is generated after the assistant's opening (megalm.serve.chat).
- `GET /v1/models`, `GET /health` (the engine's load), and `GET /`: a playground page (a prompt,
  sampling settings, the completion streamed in as it comes).

A request that is not valid JSON, has a field of the wrong type or out of range, a field the
endpoint does not take, or a prompt that leaves no room for the tokens asked is answered 400 with
{"error": {"message", "type", "param"}} naming the field; a full queue is 503; an unknown path 404 and
a method a path does not take 405, in the same shape. The server goes on, and logs one line a request
(method, path, status, prompt and completion tokens, seconds).

An encoder-decoder model (Seq2SeqEngine) reads each prompt as its source, without the
end-of-document token; its completions and Megatron `text` are the output alone. It takes no chat,
echo, add_BOS or tokens_to_generate=0 (400, naming the field).
"""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
import re
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from megalm.data.tasks.sft import template_parts
from megalm.errors import ConfigError
from megalm.serve.chat import chat_prompt
from megalm.serve.engine import Engine, QueueFull, Request, Sampling, Seq2SeqEngine

try:
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # the optional extra
    raise ConfigError(f"megalm.serve needs FastAPI and uvicorn ({e}): pip install 'megalm[serve]'") from None

from megalm.serve.schemas import (BadRequest, ChatRequest, CompletionRequest, MegatronRequest,
                                  _check_stream_options, _delta, _sse, _stops, _usage)


log = logging.getLogger("megalm.serve")
ENDPOINTS = "PUT /api, POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /"


def _error(message: str, param: Optional[str], status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


class Server:
    """The endpoints' logic over an Engine (create_app wires them to routes)."""

    def __init__(self, engine: Engine, tokenizer, *, model_name: str, seq_length: int, chat_template: str):
        self.engine, self.tok = engine, tokenizer
        self.model_name, self.seq_length, self.chat_template = model_name, seq_length, chat_template
        self.created = int(time.time())
        self.seq2seq = isinstance(engine, Seq2SeqEngine)

    # -- running requests ------------------------------------------------------------------------
    def _prompt_ids(self, text: str, field: str) -> List[int]:
        """A decoder model reads a prompt as a document, after the end-of-document token (an imported model: its
        own start tokens); an encoder-decoder model reads it as its source, as fine-tuning did."""
        if not self.seq2seq:
            return self.tok.prompt(text)
        ids = self.tok.encode(text)
        if not ids:
            raise BadRequest(f"{field}: the source is empty; the encoder needs at least one token", field)
        return ids

    def _refuse_for_seq2seq(self, what: str, param: str) -> None:
        if self.seq2seq:
            raise BadRequest(f"{param}: {what}, which an encoder-decoder model (T5) does not do: its output is "
                             "generated from the prompt as a source, not after it", param)

    def _check_room(self, prompt: List[int], max_tokens: int, field: str, prompt_field: str = "prompt") -> None:
        if self.seq2seq:
            engine: Seq2SeqEngine = self.engine  # type: ignore[assignment]
            if len(prompt) > engine.source_length:
                raise BadRequest(f"{prompt_field}: the source is {len(prompt)} tokens; the encoder reads at most "
                                 f"{engine.source_length} (model.seq_length)", prompt_field)
            if max_tokens > engine.room(len(prompt)):
                raise BadRequest(f"{field}: {max_tokens} tokens were asked; the decoder writes at most "
                                 f"{engine.room(len(prompt))} (model.decoder_seq_length - 1)", field)
            return
        if len(prompt) + max_tokens > self.seq_length:
            raise BadRequest(f"{field}: the prompt is {len(prompt)} tokens and {max_tokens} more were asked; the model "
                             f"reads at most {self.seq_length} (prompt + {field} <= {self.seq_length})", field)

    def _start(self, prompt: List[int], sampling: Sampling):
        """Submit one request; (request, asyncio queue of its events)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(prompt, sampling, lambda *ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise BadRequest(f"the server is busy: {e}; retry later", None, 503) from None
        return req, events

    def _start_all(self, jobs) -> list:
        """Submit (prompt, sampling) jobs; when one cannot be queued, withdraw those already queued."""
        started: list = []
        try:
            for prompt, sampling in jobs:
                started.append(self._start(prompt, sampling))
        except BadRequest:
            for req, _ in started:
                self.engine.cancel(req)
            raise
        return started

    async def _finish_all(self, started) -> List[str]:
        """Wait for every request; their finish reasons. If the client goes away, withdraw them all."""
        try:
            return [await self._finish(req, events) for req, events in started]
        except BaseException:
            for req, _ in started:
                self.engine.cancel(req)
            raise

    async def _finish(self, req: Request, events: asyncio.Queue) -> str:
        """Wait for the request to end; its finish reason."""
        while True:
            kind, value, _, _ = await events.get()
            if kind == "done":
                return str(value)
            if kind == "error":
                raise BadRequest(f"generation failed: {value}", None, 500)

    # -- Megatron ----------------------------------------------------------------------------------
    async def megatron(self, body: MegatronRequest) -> Dict[str, Any]:
        if body.top_k > 0 and body.top_p > 0:
            raise BadRequest("top_k and top_p cannot both be set (Megatron's rule)", "top_p")
        stops = (["\n\n"] if body.stop_on_double_eol else []) + (["\n"] if body.stop_on_eol else [])
        if body.add_BOS:
            self._refuse_for_seq2seq("add_BOS starts a prompt at the end-of-document token", "add_BOS")
        if body.tokens_to_generate == 0:
            self._refuse_for_seq2seq("tokens_to_generate=0 scores the prompts", "tokens_to_generate")
        runs = []
        for i, text in enumerate(body.prompts):
            if self.seq2seq:
                prompt = self._prompt_ids(text, "prompts")
            else:
                prompt = (self.tok.context if body.add_BOS else []) + self.tok.encode(text)
            if not prompt:
                raise BadRequest(f"prompts[{i}] is empty: give text, or add_BOS=true to start from the "
                                 "end-of-document token", "prompts")
            self._check_room(prompt, body.tokens_to_generate, "tokens_to_generate", "prompts")
            runs.append(prompt)
        started = self._start_all(
            (prompt, Sampling(max_tokens=body.tokens_to_generate, temperature=body.temperature, top_k=body.top_k,
                              top_p=body.top_p if body.top_p > 0 else 1.0, stop=stops,
                              seed=body.random_seed if body.random_seed >= 0 else None, prompt_logprobs=body.logprobs))
            for prompt in runs)
        await self._finish_all(started)
        out: Dict[str, Any] = {"text": [], "segments": []}
        for prompt, (r, _) in zip(runs, started):
            if self.seq2seq:  # the output alone: it does not continue its source
                out["text"].append(r.text)
                out["segments"].append([self.tok.decode([t]) for t in r.tokens])
                continue
            # Megatron's answer: each prompt followed by its generation
            out["text"].append(self.tok.decode(prompt) + r.text)
            out["segments"].append([self.tok.decode([t]) for t in prompt + r.tokens])
        if body.logprobs:
            out["logprobs"] = [list(r.prompt_logprobs) + list(r.logprobs) for r, _ in started]
        return out

    # -- OpenAI ------------------------------------------------------------------------------------
    def _sampling(self, body, max_tokens: int, stop: List[str], j: int, prompt_logprobs: bool = False,
                  top_logprobs: int = 0) -> Sampling:
        """An OpenAI request's sampling for its j-th completion of a prompt (seed + j)."""
        return Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, stop=stop,
                        seed=None if body.seed is None else body.seed + j, prompt_logprobs=prompt_logprobs,
                        top_logprobs=top_logprobs, presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty, logit_bias=self._logit_bias(body.logit_bias))

    def _logit_bias(self, bias: Optional[Dict[str, float]]):
        out = []
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.tok.vocab_size:
                raise BadRequest(f"logit_bias: the key {key!r} is not a token id in [0, {self.tok.vocab_size})",
                                 "logit_bias")
            if not -100 <= value <= 100:
                raise BadRequest(f"logit_bias[{key!r}]={value} must be in [-100, 100]", "logit_bias")
            out.append((int(key), float(value)))
        return tuple(out)

    def _prompts(self, prompt) -> List[tuple]:
        """(text, ids, how many tokens the server put before the text) of each prompt: a text is encoded as a
        document (after the start token), token ids are taken as given (each in the tokenizer's vocabulary)."""
        if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)):
            prompt = [prompt]
        if not prompt:
            raise BadRequest("prompt: give a string, token ids, or a non-empty list of either", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                ids = self._prompt_ids(p, "prompt")
                out.append((p, ids, 0 if self.seq2seq else len(ids) - len(self.tok.encode(p))))
                continue
            if not p or not all(0 <= t < self.tok.vocab_size for t in p):
                raise BadRequest(f"prompt: token ids must be a non-empty list of ids in [0, {self.tok.vocab_size}) "
                                 f"(got {p[:8]!r}{'...' if len(p) > 8 else ''})", "prompt")
            out.append((self.tok.decode(p), list(p), 0))
        return out

    async def completions(self, body: CompletionRequest, usage: Optional[Dict[str, int]] = None):
        prompts = self._prompts(body.prompt)
        stops = _stops(body.stop)
        if body.echo:
            self._refuse_for_seq2seq("echo puts the prompt before the completion", "echo")
        best = body.best_of if body.best_of is not None else body.n
        if best < body.n:
            raise BadRequest(f"best_of={best} must be at least n={body.n}", "best_of")
        if best > body.n and body.stream:
            raise BadRequest("best_of > n cannot stream: the best are known only at the end", "best_of")
        _check_stream_options(body)
        for _, ids, _ in prompts:
            self._check_room(ids, body.max_tokens, "max_tokens")
        jobs = [(i, j, text, ids, lead) for i, (text, ids, lead) in enumerate(prompts) for j in range(best)]
        started = self._start_all((ids, self._sampling(body, body.max_tokens, stops, j,
                                                       body.echo and body.logprobs is not None, body.logprobs or 0))
                                  for _, j, _, ids, _ in jobs)
        cid, model = f"cmpl-{uuid.uuid4().hex[:24]}", body.model or self.model_name
        prompt_tokens = sum(len(ids) for _, ids, _ in prompts)
        if usage is not None:
            usage["prompt_tokens"] = prompt_tokens * best
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream_completions(cid, model, [(i * body.n + j, text) for i, j, text, _, _
                                                                           in jobs], started, body.echo,
                                                              prompt_tokens * best if include else None, usage),
                                     media_type="text/event-stream")
        reasons = await self._finish_all(started)
        choices, completion_tokens = [], sum(len(req.tokens) for req, _ in started)
        for i in range(len(prompts)):  # each prompt's n best of its candidates, by log-probability a token
            mine = [k for k, job in enumerate(jobs) if job[0] == i]
            mine.sort(key=lambda k: -sum(started[k][0].logprobs) / max(1, len(started[k][0].logprobs))
                      if best > body.n else 0)
            for rank, k in enumerate(mine[:body.n]):
                (_, _, text, _, lead), (req, _) = jobs[k], started[k]
                choice = {"text": (text if body.echo else "") + req.text, "index": i * body.n + rank, "logprobs": None,
                          "finish_reason": reasons[k]}
                if body.logprobs is not None:
                    choice["logprobs"] = self._openai_logprobs(req, text if body.echo else None, lead)
                choices.append(choice)
        counts = _usage(prompt_tokens * best, completion_tokens)
        if usage is not None:
            usage.update(counts)
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": counts}

    def _openai_logprobs(self, req: Request, echoed: Optional[str], lead: int = 1) -> Dict[str, Any]:
        """The legacy completions logprobs object: each token, its log-probability, its offset in the text, and
        (logprobs=n > 0) each generated token's step's n most likely tokens, {text: log-probability} (an echoed
        prompt's tokens get None there: the server does not rank what it did not sample)."""
        # an echoed prompt: its tokens after the `lead` start tokens the server put first (all of given ids); a first
        # token with nothing before it has no log-probability: None, as OpenAI's
        shown = req.prompt[lead:] if echoed is not None else []
        tokens = [self.tok.decode([t]) for t in shown] + [self.tok.decode([t]) for t in req.tokens]
        shown_values = ([] if lead else [None]) + list(req.prompt_logprobs)[max(lead - 1, 0):] \
            if echoed is not None else []
        values = shown_values + list(req.logprobs)
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top = None
        if req.sampling.top_logprobs:
            ranked = [{self.tok.decode([t]): lp for t, lp in step} for step in req.top_logprobs]
            top = [None] * len(shown) + ranked
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}

    async def _stream_completions(self, cid, model, jobs, started, echo: bool, prompt_tokens: Optional[int],
                                  usage: Optional[Dict[str, int]]) -> AsyncIterator[str]:
        try:
            for (index, text), (req, events) in zip(jobs, started):
                sent = ""
                if echo:
                    yield _sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                                "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": None}]})
                while True:
                    kind, value, so_far, _ = await events.get()
                    delta = _delta(so_far, sent) if kind == "token" else ""
                    if delta:
                        sent += delta
                        yield _sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                                    "choices": [{"text": delta, "index": index, "logprobs": None,
                                                 "finish_reason": None}]})
                    elif kind in ("done", "error"):
                        rest = req.text[len(sent):] if req.text.startswith(sent) else ""
                        yield _sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                                    "choices": [{"text": rest, "index": index, "logprobs": None,
                                                 "finish_reason": str(value) if kind == "done" else "error"}]})
                        break
            for event in _stream_end(cid, model, "text_completion", started, prompt_tokens, usage):
                yield event
        finally:
            for req, _ in started:
                self.engine.cancel(req)

    async def chat(self, body: ChatRequest, usage: Optional[Dict[str, int]] = None):
        self._refuse_for_seq2seq("chat continues a conversation written with the run's chat template", "messages")
        _check_stream_options(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_tokens")
        prompt = chat_prompt(self.tok, self.chat_template, body.messages)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else max(1, min(256, self.seq_length - len(prompt)))
        self._check_room(prompt, max_tokens, "max_tokens" if body.max_completion_tokens is None
                         else "max_completion_tokens")
        _, after = template_parts(self.chat_template, "assistant")
        user_before, _ = template_parts(self.chat_template, "user")
        stops = _stops(body.stop) + [after + user_before]  # the next turn's opening ends the reply
        started = self._start_all((prompt, self._sampling(body, max_tokens, stops, j)) for j in range(body.n))
        cid, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", body.model or self.model_name
        if usage is not None:
            usage["prompt_tokens"] = len(prompt) * body.n
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream_chat(cid, model, started, after,
                                                       len(prompt) * body.n if include else None, usage),
                                     media_type="text/event-stream")
        choices, completion_tokens = [], 0
        reasons = await self._finish_all(started)
        for j, ((req, _), reason) in enumerate(zip(started, reasons)):
            completion_tokens += len(req.tokens)
            content = req.text[:-len(after)] if after and req.text.endswith(after) else req.text
            choice: Dict[str, Any] = {"index": j, "message": {"role": "assistant", "content": content},
                                      "finish_reason": reason, "logprobs": None}
            if body.logprobs:
                choice["logprobs"] = {"content": [{"token": self.tok.decode([t]), "logprob": lp, "bytes": None,
                                                   "top_logprobs": []} for t, lp in zip(req.tokens, req.logprobs)]}
            choices.append(choice)
        if usage is not None:
            usage["completion_tokens"] = completion_tokens
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": _usage(len(prompt) * body.n, completion_tokens)}

    async def _stream_chat(self, cid, model, started, after: str, prompt_tokens: Optional[int],
                           usage: Optional[Dict[str, int]]) -> AsyncIterator[str]:
        def chunk(j, delta, reason=None):
            return _sse({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                         "choices": [{"index": j, "delta": delta, "logprobs": None, "finish_reason": reason}]})
        try:
            for j, (req, events) in enumerate(started):
                yield chunk(j, {"role": "assistant", "content": ""})
                sent = ""
                while True:
                    kind, value, so_far, _ = await events.get()
                    if kind == "token":
                        # hold back what may be the template's closing text until the reply ends
                        delta = _delta(so_far[:len(so_far) - len(after)] if after else so_far, sent)
                        if delta:
                            yield chunk(j, {"content": delta})
                            sent += delta
                    elif kind in ("done", "error"):
                        final = req.text[:-len(after)] if after and req.text.endswith(after) else req.text
                        rest = final[len(sent):] if final.startswith(sent) else ""
                        yield chunk(j, {"content": rest} if rest else {}, str(value) if kind == "done" else "error")
                        break
            for event in _stream_end(cid, model, "chat.completion.chunk", started, prompt_tokens, usage):
                yield event
        finally:
            for req, _ in started:
                self.engine.cancel(req)

    def models(self) -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "megalm"}]}


_TYPE_TAG = re.compile(r"(str|int|float|bool|none|[a-z]+\[.*\]|function-[a-z]+\[.*\])")


def _stream_end(cid: str, model: str, kind: str, started, prompt_tokens: Optional[int],
                usage: Optional[Dict[str, int]]):
    """A stream's last events: with stream_options.include_usage (`prompt_tokens` given) a chunk holding no choice
    and the usage, then [DONE]; the completion tokens go to the access log's `usage` too."""
    completion = sum(len(req.tokens) for req, _ in started)
    if usage is not None:
        usage["completion_tokens"] = completion
    if prompt_tokens is not None:
        yield _sse({"id": cid, "object": kind, "created": int(time.time()), "model": model, "choices": [],
                    "usage": _usage(prompt_tokens, completion)})
    yield "data: [DONE]\n\n"


class _AccessLog:
    """ASGI middleware: one log line a request once its answer's last byte is sent (a stream's at its end, or when the
    client leaves): method, path, status, the prompt and completion tokens the endpoint put in request.state.usage,
    seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, usage, status, done = time.perf_counter(), {}, [0], [False]
        scope.setdefault("state", {})["usage"] = usage

        def line():
            if not done[0]:
                done[0] = True
                log.info("%s %s %d prompt_tokens=%s completion_tokens=%s %.3fs", scope["method"], scope["path"],
                         status[0], usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"),
                         time.perf_counter() - start)

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                line()
        try:
            await self.app(scope, receive, sending)
        finally:
            line()


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="megalm", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        # the field's path: without "body", and without the type a union member was tried as ("str", "list[str]")
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _TYPE_TAG.fullmatch(str(x))]
        param = ".".join(loc) or "body"
        if first.get("type") == "json_invalid":
            return _error(f"the body is not valid JSON: {first.get('msg', '')}", "body", 400)
        if first.get("type") == "extra_forbidden":
            return _error(f"{param}: this endpoint takes no field {loc[-1]!r}", param, 400)
        return _error(f"{param}: {first.get('msg', 'invalid')} (got {first.get('input')!r})", param, 400)

    @app.exception_handler(BadRequest)
    async def _bad(request: HTTPRequest, exc: BadRequest):
        kind = {503: "server_busy", 500: "server_error"}.get(exc.status, "invalid_request_error")
        return _error(exc.message, exc.param, exc.status, kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: HTTPRequest, exc: StarletteHTTPException):  # 404, 405: the shape of every other error
        what = {404: f"no endpoint {request.url.path}", 405: f"{request.url.path} does not take {request.method}"}
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(f"{what.get(exc.status_code, exc.detail)} (endpoints: {ENDPOINTS})", None, exc.status_code, kind)

    app.add_middleware(_AccessLog)

    @app.put("/api")
    async def megatron(body: MegatronRequest):
        return await server.megatron(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        return await server.completions(body, request.state.usage)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HTTPRequest):
        return await server.chat(body, request.state.usage)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name, **server.engine.load()}

    playground = (resources.files("megalm.serve") / "playground.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        """The playground: a prompt, sampling settings, and the completion streamed as it comes."""
        return playground

    return app
