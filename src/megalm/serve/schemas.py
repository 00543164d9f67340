"""The request bodies megalm.serve's endpoints take (megalm.serve.api): Megatron's `PUT /api` and OpenAI's completions
and chat, each field typed and bounded, no field beyond them (pydantic, strict); the checks across fields that
pydantic does not make (`BadRequest`: 400 naming the field); the pieces of an answer (usage, server-sent events, the
settled part of a streamed text)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from megalm.errors import ConfigError

try:
    from pydantic import BaseModel, ConfigDict, Field, field_validator
except ImportError as e:  # the optional extra
    raise ConfigError(f"megalm.serve needs FastAPI and uvicorn ({e}): pip install 'megalm[serve]'") from None


class _Strict(BaseModel):
    """Fields of the declared types only (no coercion of "4" to 4) and no fields beyond them."""
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before",
                     check_fields=False)
    @classmethod
    def _number(cls, v):
        """JSON has one number type: 1 is as good a temperature as 1.0."""
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class MegatronRequest(_Strict):
    prompts: List[str] = Field(min_length=1)
    tokens_to_generate: int = Field(64, ge=0)
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(0.0, ge=0.0, le=1.0)
    logprobs: bool = False
    add_BOS: bool = False
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    random_seed: int = -1


class StreamOptions(_Strict):
    include_usage: bool = False
    """A last chunk (no choices) with the request's usage, before [DONE]."""


class _Penalties(_Strict):
    """OpenAI's adjustments of the next token's logits, applied before sampling (greedy included), as vLLM applies them:
    each token's logit less presence_penalty if it was generated before in this completion and frequency_penalty
    times how often, plus logit_bias[token id] (keys are token ids, as JSON object keys are strings)."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    stream_options: Optional[StreamOptions] = None


class CompletionRequest(_Penalties):
    model: Optional[str] = None
    prompt: Union[str, List[str], List[int], List[List[int]]]
    """Text, a list of texts, token ids, or a list of token-id lists (read as given: no end-of-document token first)."""
    best_of: Optional[int] = Field(None, ge=1, le=16)
    """Candidates generated per prompt (at least n); the n with the highest log-probability a token are returned."""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stop: Optional[Union[str, List[str]]] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False
    seed: Optional[int] = None
    user: Optional[str] = None


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Penalties):
    model: Optional[str] = None
    messages: List[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stop: Optional[Union[str, List[str]]] = None
    logprobs: bool = False
    seed: Optional[int] = None
    user: Optional[str] = None


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _stops(stop: Optional[Union[str, List[str]]]) -> List[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise BadRequest(f"stop: at most 4 non-empty strings (got {stops!r})", "stop")
    return stops


def _delta(so_far: str, sent: str) -> str:
    """What of a reply decoded so far can be streamed after `sent` without ever changing: all but a trailing run of
    U+FFFD, which is how the byte pieces of a character not yet complete decode (it becomes the character once its
    last byte comes); "" while nothing new is settled."""
    settled = so_far.rstrip("\ufffd")
    return settled[len(sent):] if settled.startswith(sent) else ""


def _usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")


def _sse(payload: Dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
