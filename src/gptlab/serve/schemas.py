"""The OpenAI request bodies the server accepts, validated into `SamplingConfig`, and its error objects.

Types are checked strictly (pydantic's strict mode: "5" is not a number, true is not an integer) and
unknown fields are refused, as OpenAI refuses them. Value checks that `SamplingConfig` makes (a
negative temperature, top_p outside (0, 1], ...) are made there and nowhere else; the server only
adds its own limits (max_tokens, the number of choices). Every failure is an `APIError`: an HTTP
status and OpenAI's error object `{"error": {"message", "type", "param", "code"}}`, naming the field.

Fields OpenAI defines that gptlab cannot honour (echo, suffix, penalties, logit_bias) are accepted
at their neutral values, so clients that always send them work, and refused otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gptlab.config import SamplingConfig

MAX_LOGPROBS = 20  # OpenAI allows 5; more is an extension


class APIError(Exception):
    """A request the server refuses, as an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = True  # usage is always sent in a last chunk; accepted for compatibility


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


def sampling_config(request: CompletionRequest, seed: int | None, max_tokens_limit: int) -> SamplingConfig:
    """The request's SamplingConfig for one choice; SamplingConfig's own checks become 400s."""
    refuse_unsupported(request)
    if request.max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens={request.max_tokens} is more than this server allows "
                       f"({max_tokens_limit}); ask for fewer", "max_tokens", "max_tokens_too_large")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
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
    ]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param, "unsupported_value")
