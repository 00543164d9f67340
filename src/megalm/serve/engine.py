"""The serving engine: continuous batching of text generation over one decoder model
(`Engine`), or over one encoder-decoder model whose prompts are sources (`Seq2SeqEngine`).

Requests wait in a bounded queue. A worker thread holds up to `slots` of them at a time, each in
its own slot of a KV cache (`SlotKVCache`: per slot, the keys and values of its positions). A
request that enters a slot is prefilled alone (its prompt in one forward); then every step decodes
one token for every slot together, each at its own position, with an attention mask that keeps
each row to its own keys. A finished request frees its slot at once and the next waiting one
enters at the next step, without waiting for the batch (continuous batching, as Orca and vLLM do).

A request's tokens do not depend on its neighbours: its rows of the batch see only its own
cache, it samples from its own generator (seeded by the request), and its stop conditions are its
own. (Float sums of a batched matmul may round differently from a single row's; greedy decoding
picks the same tokens unless two logits tie to within that rounding.)

At a tensor- or pipeline-parallel layout the engine runs on rank 0, and `Ranks` sends each of its
forwards (tokens, slots, positions) to the other ranks, which run it on slot caches of their own
heads and layers.

Results go back through a callback per request, called from the worker thread: ("token", id,
text so far, logprob) for each new token, then ("done", finish reason, None, None), or ("error",
message, None, None).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from megalm.data.samples.t5 import t5_specials
from megalm.generate import sample_next
from megalm.models.layers import Encoded

log = logging.getLogger("megalm.serve")


class QueueFull(Exception):
    """The engine holds as many waiting requests as it may."""


@dataclass
class Sampling:
    """How one request generates."""
    max_tokens: int
    """Tokens to generate at most; 0 scores the prompt (with prompt_logprobs)."""
    temperature: float = 0.0
    """0: greedy."""
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    """The request's own generator; None: drawn from the engine's."""
    stop: Sequence[str] = ()
    """Strings that end the generation (the text is cut before the first one)."""
    stop_at_eod: bool = True
    """End at the end-of-document token (not part of the text)."""
    prompt_logprobs: bool = False
    """Also report the log-probability of each prompt token after the first (echo / Megatron's logprobs)."""
    top_logprobs: int = 0
    """Also report, for each generated token, the n most likely tokens of its step and their log-probabilities."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token this request has generated (OpenAI's, as vLLM applies it)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for every time this request has generated it."""
    logit_bias: Tuple[Tuple[int, float], ...] = ()
    """(token id, bias) added to those logits before every draw."""


def _adjusted(logits: torch.Tensor, r: "Request") -> torch.Tensor:
    """(1, V) logits to draw r's next token from: the model's, less the presence and frequency penalties of the tokens
    r generated, plus its logit bias."""
    sp = r.sampling
    penalised = bool(r.tokens) and bool(sp.presence_penalty or sp.frequency_penalty)
    if not (sp.logit_bias or penalised):
        return logits[None]  # nothing to adjust: no copy
    out = logits.float()[None]
    if sp.logit_bias:
        ids, bias = zip(*sp.logit_bias)
        out = out.index_add(1, torch.tensor(ids, device=out.device), torch.tensor([bias], device=out.device))
    if penalised:
        if r.counts is None:  # counted once; _take adds each new token
            r.counts = torch.bincount(torch.tensor(r.tokens, device=out.device), minlength=out.shape[-1]).float()
        out = out - sp.frequency_penalty * r.counts - sp.presence_penalty * (r.counts > 0).float()
    return out


@dataclass
class Request:
    prompt: List[int]
    sampling: Sampling
    emit: Callable[[str, object, Optional[str], Optional[float]], None]
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    prompt_logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    """Per generated token (Sampling.top_logprobs > 0): its step's most likely (token, log-probability), best first."""
    text: str = ""
    slot: int = -1
    generator: Optional[torch.Generator] = None
    cancelled: bool = False
    counts: Optional[torch.Tensor] = None
    """(V,) how often each token was generated, kept once a penalty needs it."""


class SlotKVCache:
    """Keys and values per slot: (slots, kv_heads, max_len, head_dim) per layer; layers below
    `first_layer` (an encoder's, which never cache) hold nothing."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, device, dtype,
                 first_layer: int = 0):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape if i >= first_layer else (0,), device=device, dtype=dtype) for i in range(num_layers)]
        self.v = [torch.zeros(shape if i >= first_layer else (0,), device=device, dtype=dtype) for i in range(num_layers)]
        self.max_len = max_len

    def rows(self, slots: torch.Tensor, starts: torch.Tensor, length: int) -> "_Rows":
        """The cache as a batch of `slots`, row b writing `length` new positions from starts[b]."""
        return _Rows(self, slots, starts, length)


class _Rows:
    """What the model's attention layers see as `cache`: each row writes at its own position and
    reads its slot's keys up to the longest row's end (the attention mask hides the rest)."""

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, starts: torch.Tensor, length: int):
        self.cache, self.slots = cache, slots
        self.positions = starts[:, None] + torch.arange(length, device=starts.device)  # (B, T)
        self.end = int(self.positions.max()) + 1
        if self.end > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; asked for {self.end}")  # a bug

    def mask(self) -> torch.Tensor:
        """(B, 1, T, end) bool: query t of row b sees keys 0 .. its own position."""
        keys = torch.arange(self.end, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None])[:, None]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        rows = self.slots[:, None].expand_as(self.positions)
        # (B, kv, T, hd) -> (B, T, kv, hd): one [kv, hd] block per (slot, position)
        self.cache.k[layer].permute(0, 2, 1, 3)[rows, self.positions] = k.transpose(1, 2)
        self.cache.v[layer].permute(0, 2, 1, 3)[rows, self.positions] = v.transpose(1, 2)
        return self.cache.k[layer][self.slots, :, :self.end], self.cache.v[layer][self.slots, :, :self.end]


def slot_cache(model, slots: int, seq_length: int) -> SlotKVCache:
    """The slots' cache for this rank's model: its own key/value heads under tensor parallelism (every
    layer's entry is made; a pipeline stage fills its own layers' only)."""
    cfg, p = model.cfg, next(model.parameters())
    tp = getattr(model, "tp", 1)
    return SlotKVCache(cfg.num_layers, slots, cfg.kv_heads // tp, seq_length, cfg.head_dim, p.device, p.dtype,
                       first_layer=getattr(cfg, "encoder_layers", 0))


class Ranks:
    """Rank 0's engine tells the other ranks of a tp / pp layout each forward it runs (the tokens,
    slots and start positions), so that every rank runs the same forwards in the same order; the
    others `follow`. Only rank 0 takes requests, so no rank waits for a request another never saw."""

    FORWARD, STOP = 0, 1

    def __init__(self, device):
        import torch.distributed as dist
        self.dist, self.device = dist, device

    def _send(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.dist.broadcast(t, src=0)

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor) -> None:
        self._send(torch.tensor([self.FORWARD, *tokens.shape], device=self.device), tokens.contiguous(), slots, starts)

    def stop(self) -> None:
        self._send(torch.tensor([self.STOP, 0, 0], device=self.device))

    def follow(self, model, slots: int, seq_length: int) -> int:
        """On a rank other than 0: run rank 0's forwards until it stops; how many were run."""
        cache = slot_cache(model, slots, seq_length)
        count = 0
        with torch.no_grad():
            while True:
                head = torch.empty(3, dtype=torch.long, device=self.device)
                self.dist.broadcast(head, src=0)
                kind, b, t = head.tolist()
                if kind == self.STOP:
                    return count
                tokens = torch.empty(b, t, dtype=torch.long, device=self.device)
                slot_ids = torch.empty(b, dtype=torch.long, device=self.device)
                starts = torch.empty(b, dtype=torch.long, device=self.device)
                self._send(tokens, slot_ids, starts)
                rows = cache.rows(slot_ids, starts, t)
                model(tokens, cache=rows, positions=rows.positions, attention_mask=rows.mask())
                count += 1


class Engine:
    """Continuous batching over `model`: a single-process decoder, or rank 0's part of one at a tp / pp
    layout (the other ranks follow its forwards: `Ranks`)."""

    def __init__(self, model, tokenizer, *, seq_length: int, slots: int = 8, max_queue: int = 64, seed: int = 0,
                 ranks: Optional["Ranks"] = None):
        """`model`: a single-process decoder, or this rank's LayoutModel (megalm.evaluate.layout) with
        `ranks` telling the other ranks of the layout each forward to run alongside."""
        if slots < 1 or max_queue < 1:
            raise ValueError(f"slots={slots} and max_queue={max_queue} must be at least 1")
        self.model, self.tokenizer, self.ranks = model.eval(), tokenizer, ranks
        self.seq_length, self.slots, self.max_queue = seq_length, slots, max_queue
        cfg = model.cfg
        # Log-probabilities over the model's vocabulary, as training's loss takes them (its padding rows
        # left out); tokens are drawn from the tokenizer's ids only.
        self.model_vocab, self.tokens = cfg.vocab_size, tokenizer.vocab_size
        self.stop_token = self.end_token(tokenizer)
        p = next(model.parameters())
        self.device = p.device
        self.cache = slot_cache(model, slots, seq_length)
        self.waiting: Deque[Request] = collections.deque()
        self.active: Dict[int, Request] = {}
        self.lengths = [0] * slots  # positions held in each slot's cache
        self.seeds = torch.Generator().manual_seed(seed)
        self.cond = threading.Condition()
        self.stopping = False
        self.steps = 0
        self.thread = threading.Thread(target=self._run, name="megalm-serve-engine", daemon=True)
        self.thread.start()

    @staticmethod
    def end_token(tokenizer) -> int:
        """The token that ends a generation (Sampling.stop_at_eod): the end of the document."""
        return tokenizer.eod

    def room(self, prompt_tokens: int) -> int:
        """How many tokens a request of `prompt_tokens` may generate (negative: the prompt alone is too long)."""
        return self.seq_length - prompt_tokens

    # -- the requests' side ----------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request (QueueFull when max_queue are waiting)."""
        if not request.prompt:
            raise ValueError("a request needs at least one prompt token")  # the API checks first
        if request.sampling.max_tokens > self.room(len(request.prompt)):
            raise ValueError(f"{len(request.prompt)} prompt tokens + {request.sampling.max_tokens} to generate "
                             f"exceed the model's {self.seq_length}")  # the API checks first
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the server's --max-queue)")
            if request.sampling.seed is not None:
                request.generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self.seeds))
                request.generator = torch.Generator(device=self.device).manual_seed(seed)
            self.waiting.append(request)
            self.cond.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: drop the request at the next step."""
        request.cancelled = True

    def load(self) -> Dict[str, int]:
        with self.cond:
            return {"active": len(self.active), "waiting": len(self.waiting), "slots": self.slots,
                    "max_queue": self.max_queue, "steps": self.steps}

    def stop(self, timeout: Optional[float] = None) -> None:
        """Finish what is queued and running, then end the worker."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout)
        if self.ranks is not None:
            self.ranks.stop()

    # -- the worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.active and not self.stopping:
                    self.cond.wait()
                if self.stopping and not self.waiting and not self.active:
                    return
                admitted = []
                free = [s for s in range(self.slots) if s not in self.active]
                while free and self.waiting:
                    r = self.waiting.popleft()
                    if r.cancelled:  # withdrawn while it waited
                        r.emit("done", "cancelled", None, None)
                        continue
                    r.slot = free.pop(0)
                    self.active[r.slot] = r
                    admitted.append(r)
            try:
                with torch.no_grad():
                    for r in admitted:
                        self._prefill(r)
                    if self.active:
                        self._decode()
                self.steps += 1
            except Exception as e:  # a bug: fail the requests in flight, keep serving
                log.exception("serving step failed")
                with self.cond:
                    failed, self.active = list(self.active.values()), {}
                for r in failed:
                    r.emit("error", f"{type(e).__name__}: {e}", None, None)

    def _logits(self, tokens: torch.Tensor, slots: List[int], starts: List[int]) -> torch.Tensor:
        slots_t, starts_t = torch.tensor(slots, device=self.device), torch.tensor(starts, device=self.device)
        if self.ranks is not None:
            self.ranks.forward(tokens, slots_t, starts_t)
        rows = self.cache.rows(slots_t, starts_t, tokens.shape[1])
        logits = self.model(tokens, cache=rows, positions=rows.positions, attention_mask=rows.mask())
        return logits[..., :self.model_vocab].float()  # padded vocabulary rows are not tokens

    def _prefill(self, r: Request) -> None:
        ids = torch.tensor([r.prompt], device=self.device)
        logits = self._logits(ids, [r.slot], [0])[0]  # (T, V)
        self.lengths[r.slot] = len(r.prompt)
        if r.sampling.prompt_logprobs:
            logp = torch.log_softmax(logits[:-1], dim=-1)
            r.prompt_logprobs = logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
        if r.sampling.max_tokens == 0:  # scoring the prompt only
            return self._finish(r, "length")
        self._take(r, logits[-1])

    def _decode(self) -> None:
        order = sorted(self.active)
        for s in [s for s in order if self.active[s].cancelled]:
            self._finish(self.active[s], "cancelled")
        order = sorted(self.active)
        if not order:
            return
        last = torch.tensor([[self.active[s].tokens[-1]] for s in order], device=self.device)
        logits = self._logits(last, order, [self.lengths[s] for s in order])[:, -1]  # (B, V)
        for s in order:
            self.lengths[s] += 1
        for row, s in enumerate(order):
            self._take(self.active[s], logits[row])

    def _take(self, r: Request, logits: torch.Tensor) -> None:
        """Sample r's next token from its logits (V,), report it, and finish r when it is done."""
        sp = r.sampling
        allowed = logits if self.tokens >= len(logits) else logits.clone().index_fill_(
            0, torch.arange(self.tokens, len(logits), device=logits.device), float("-inf"))
        token = int(sample_next(_adjusted(allowed, r), sp.temperature, sp.top_k, sp.top_p, r.generator)[0])
        logp = torch.log_softmax(logits, dim=-1)  # the model's own, as OpenAI reports them
        logprob = float(logp[token])
        if sp.stop_at_eod and token == self.stop_token:
            return self._finish(r, "stop")
        r.tokens.append(token)
        if r.counts is not None:
            r.counts[token] += 1
        r.logprobs.append(logprob)
        if sp.top_logprobs:
            values, ids = logp[:self.tokens].topk(min(sp.top_logprobs, self.tokens))  # real tokens only
            r.top_logprobs.append(list(zip(ids.tolist(), values.tolist())))
        text = self.tokenizer.decode(r.tokens)
        cut = [text.find(s) for s in sp.stop if s and s in text]
        if cut:
            r.text = text[:min(cut)]
            r.emit("token", token, r.text, logprob)
            return self._finish(r, "stop")
        r.text = text
        r.emit("token", token, text, logprob)
        if len(r.tokens) >= sp.max_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str) -> None:
        with self.cond:
            self.active.pop(r.slot, None)
        r.emit("done", reason, None, None)


class Seq2SeqEngine(Engine):
    """Continuous batching over an encoder-decoder model (T5, one process): a request's prompt is
    its source. When it enters a slot the encoder reads the source alone, and each decoder layer's
    cross-attention keys and values of it are kept in the slot (`source_k` / `source_v`, with the
    source's padding mask); then the decoder starts from [BOS] and, as for a decoder model, every
    step decodes one token of every slot over the slots' self-attention caches, each row at its own
    position and over its own source. The output ends at [EOS]."""

    def __init__(self, model, tokenizer, *, slots: int = 8, max_queue: int = 64, seed: int = 0):
        cfg, p = model.cfg, next(model.parameters())
        self.bos = t5_specials(tokenizer).bos
        self.source_length = cfg.seq_length
        layers, shape = cfg.num_layers - cfg.encoder_layers, (slots, cfg.kv_heads, cfg.seq_length, cfg.head_dim)
        self.source_k = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(layers)]
        self.source_v = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(layers)]
        self.source_mask = torch.zeros(slots, cfg.seq_length, dtype=torch.bool, device=p.device)
        self.source_lengths = [0] * slots
        super().__init__(model, tokenizer, seq_length=cfg.decoder_seq_length, slots=slots, max_queue=max_queue,
                         seed=seed)

    @staticmethod
    def end_token(tokenizer) -> int:
        return t5_specials(tokenizer).eos

    def room(self, prompt_tokens: int) -> int:
        """The decoder reads [BOS] and all but the last output token: decoder_seq_length - 1 tokens out,
        whatever the source's length (which the encoder takes up to model.seq_length)."""
        return self.seq_length - 1 if prompt_tokens <= self.source_length else -1

    def submit(self, request: Request) -> None:
        if request.sampling.max_tokens < 1 or request.sampling.prompt_logprobs:  # the API checks first
            raise ValueError("an encoder-decoder model generates from its source; it does not score it")
        super().submit(request)

    def _logits(self, tokens: torch.Tensor, slots: List[int], starts: List[int]) -> torch.Tensor:
        slots_t, starts_t = torch.tensor(slots, device=self.device), torch.tensor(starts, device=self.device)
        rows = self.cache.rows(slots_t, starts_t, tokens.shape[1])
        n = max(self.source_lengths[s] for s in slots)  # the longest source of these rows; the mask hides the rest
        encoded = Encoded(None, self.source_mask[slots_t, :n][:, None, None, :],
                          [(k[slots_t, :, :n], v[slots_t, :, :n]) for k, v in zip(self.source_k, self.source_v)])
        logits = self.model.decode(tokens, encoded, cache=rows, positions=rows.positions, attention_mask=rows.mask())
        return logits[..., :self.model_vocab].float()

    def _prefill(self, r: Request) -> None:
        source = torch.tensor([r.prompt], device=self.device)
        encoded = self.model.encode(source, torch.ones_like(source))
        n, s = len(r.prompt), r.slot
        for (k, v), keep_k, keep_v in zip(encoded.cross_kv, self.source_k, self.source_v):
            keep_k[s, :, :n], keep_v[s, :, :n] = k[0], v[0]
        self.source_mask[s] = False
        self.source_mask[s, :n] = True
        self.source_lengths[s] = n
        logits = self._logits(torch.tensor([[self.bos]], device=self.device), [s], [0])[0]
        self.lengths[s] = 1
        self._take(r, logits[-1])
