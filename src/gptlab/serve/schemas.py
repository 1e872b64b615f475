"""The OpenAI request bodies the server accepts, validated into `SamplingConfig`, and its error objects.

Types are checked strictly (pydantic's strict mode: "5" is not a number, true is not an integer) and
unknown fields are refused, as OpenAI refuses them. Value checks that `SamplingConfig` makes (a
negative temperature, top_p outside (0, 1], ...) are made there and nowhere else; the server only
adds its own limits (`Limits`: max_tokens, stop strings, the context, the queue). Every failure is an
`APIError`: an HTTP status and OpenAI's error object `{"error": {"message", "type", "param", "code"}}`,
naming the field.

Fields OpenAI defines that gptlab cannot honour (echo, suffix, penalties, logit_bias) are accepted
at their neutral values, so clients that always send them work, and refused otherwise.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gptlab.config import SamplingConfig

MAX_LOGPROBS = 20  # OpenAI allows 5; more is an extension
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")  # the fields a model's own defaults may fill


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, each bounded so that no client can exhaust it."""

    max_tokens: int = 1024  # the largest max_tokens
    max_stops: int = 4  # stop strings per request, as OpenAI allows
    max_stop_chars: int = 64  # characters per stop string (each is searched for at every token)
    max_context: int | None = None  # prompt + max_tokens at most; None: the model's block_size
    max_waiting: int = 256  # rows queued for a slot before new requests get a 429
    request_timeout: float = 600.0  # seconds from arrival to the last token
    prefill_chunk: int = 256  # prompt tokens prefilled per step, between the batch's decode steps

    def __post_init__(self) -> None:
        counts = {"max_tokens": self.max_tokens, "max_stops": self.max_stops, "max_waiting": self.max_waiting,
                  "max_stop_chars": self.max_stop_chars, "prefill_chunk": self.prefill_chunk}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value} must be at least 1")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"--max-context={self.max_context} must be at least 2 (a prompt and a token)")
        if not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise ValueError(f"--request-timeout={self.request_timeout} must be a positive number of seconds")


class APIError(Exception):
    """A request the server refuses, as an HTTP status and OpenAI's error object.

    `retry_after` (seconds) becomes a Retry-After header: the server is busy, not the request wrong."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False  # a last chunk with usage (and "usage": null on every other chunk)


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (OpenAI's legacy completions API, plus top_k)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | list[str]
    model: str | None = None  # None: the model this server serves
    max_tokens: int = 16  # OpenAI's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # an extension: OpenAI has no top-k
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class AttentionRequest(BaseModel):
    """The body of POST /v1/attention: where the last token of `text` attends, in one layer and head."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str
    layer: int = 0
    head: int = 0


def parse(model: type[BaseModel], data: Any) -> Any:
    """`model` built from decoded JSON, or a 400 APIError naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field {param!r}: {model.__name__} has no such field",
                           param, "unknown_field") from None
        if first["type"] == "missing":
            raise APIError(400, f"{param} is required", param, "missing_field") from None
        shown = repr(first.get("input"))[:80]
        raise APIError(400, f"{param}={shown} is invalid: {first['msg'][0].lower()}{first['msg'][1:]}",
                       param, "invalid_type") from None


def with_defaults(request: CompletionRequest, defaults: dict[str, Any]) -> CompletionRequest:
    """The request with a model's own sampling defaults in the fields it did not set itself."""
    unset = {k: v for k, v in defaults.items() if k not in request.model_fields_set}
    return request.model_copy(update=unset) if unset else request


def sampling_config(request: CompletionRequest, seed: int | None, limits: Limits) -> SamplingConfig:
    """The request's SamplingConfig for one choice; SamplingConfig's own checks become 400s."""
    refuse_unsupported(request)
    if request.max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens={request.max_tokens} is more than this server allows "
                       f"({limits.max_tokens}); ask for fewer", "max_tokens", "max_tokens_too_large")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > limits.max_stops:
        raise APIError(400, f"stop has {len(stop)} strings; this server allows at most {limits.max_stops}",
                       "stop", "too_many_stops")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise APIError(400, f"stop strings may be at most {limits.max_stop_chars} characters long",
                       "stop", "stop_too_long")
    try:
        return SamplingConfig(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                              max_new_tokens=request.max_tokens, stop=tuple(stop), seed=seed)
    except ValueError as err:
        field = re.match(r"SamplingConfig\.(\w+)", str(err))
        param = {"max_new_tokens": "max_tokens"}.get(field.group(1), field.group(1)) if field else None
        message = str(err).replace("SamplingConfig.max_new_tokens", "max_tokens")
        raise APIError(400, message.replace("SamplingConfig.", ""), param, "invalid_value") from None


def refuse_unsupported(request: CompletionRequest) -> None:
    """A 400 for OpenAI options set to something gptlab does not do."""
    checks = [
        ("echo", request.echo, "echo is not supported: the completion never repeats the prompt"),
        ("suffix", request.suffix is not None, "suffix (insertion) is not supported"),
        ("presence_penalty", request.presence_penalty != 0, "presence_penalty must be 0"),
        ("frequency_penalty", request.frequency_penalty != 0, "frequency_penalty must be 0"),
        ("logit_bias", bool(request.logit_bias), "logit_bias is not supported"),
        ("best_of", request.best_of not in (None, 1, request.n), "best_of must equal n"),
        ("n", request.n < 1, f"n={request.n} must be at least 1"),
        ("seed", request.seed is not None and not 0 <= request.seed < 2**63,
         f"seed={request.seed} must be in [0, 2**63)"),
        ("logprobs", request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS,
         f"logprobs={request.logprobs} must be in 0..{MAX_LOGPROBS}"),
        ("prompt", not request.prompts, "prompt must hold at least one string"),
        ("stream_options", request.stream_options is not None and not request.stream,
         "stream_options is only allowed when stream is true"),
    ]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param, "unsupported_value")
