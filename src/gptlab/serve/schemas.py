"""The OpenAI request bodies the server accepts, validated into `SamplingConfig`, and its error objects.

Types are checked strictly (pydantic's strict mode: "5" is not a number, true is not an integer) and
unknown fields are refused, as OpenAI refuses them. Value checks that `SamplingConfig` makes (a
negative temperature, top_p outside (0, 1], ...) are made there and nowhere else; the server only
adds its own limits (`Limits`: max_tokens, stop strings, the context, the queue). Every failure is an
`APIError`: an HTTP status and OpenAI's error object `{"error": {"message", "type", "param", "code"}}`,
naming the field.

Fields OpenAI defines that gptlab cannot honour (suffix, penalties, echo when streamed) are accepted at
their neutral values, so clients that always send them work, and refused otherwise. Structured output
is asked for with OpenAI's `response_format` or vLLM's `structured_outputs` (`ResponseFormat`,
`StructuredOutputs`; compiled by `serve.constraints`); `speculative` (an extension) turns the server's
speculative decoding off for one request, or asks for it. A prompt
may be text or token ids, as OpenAI's completions API allows (lm-eval sends ids). `TokenizeRequest` and
`DetokenizeRequest` are the bodies of vLLM's /tokenize and /detokenize, which lm-eval's remote tokenizer
calls.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gptlab.config import SamplingConfig, SettingError

MAX_LOGPROBS = 20  # OpenAI allows 5; more is an extension
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")  # the fields a model's own defaults may fill
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's names of union members
MAX_DEPTH = 32  # arrays and objects nested in a body at most (OpenAI's bodies need about 5)
SURROGATE = re.compile("[\ud800-\udfff]")  # left by JSON's "\\ud800" alone; a proper pair decodes to one


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
                raise SettingError(f"{{name}}={value} must be at least 1", name=name)
        if self.max_context is not None and self.max_context < 2:
            raise SettingError(f"{{max_context}}={self.max_context} must be at least 2 (a prompt and a "
                               "token)", max_context="max_context")
        if not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise SettingError(f"{{timeout}}={self.request_timeout} must be a positive number of seconds",
                               timeout="request_timeout")


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


class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: a named JSON schema (`strict` or not, it is enforced)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its current name for the older guided_json, guided_regex and
    guided_choice): one of a JSON schema, a regular expression, a list of choices or any JSON object."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: the model, sampling and the stream."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None: the model this server serves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # an extension: OpenAI has no top-k
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as JSON writes it, a string) -> bias
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # an extension: vLLM's
    speculative: bool | None = None  # an extension: False turns speculative decoding off (None: the server's)

    @property
    def token_limit(self) -> tuple[int | None, str]:
        """The most tokens asked for (None: the server's limit) and the field that asked."""
        raise NotImplementedError

    def logprobs_count(self) -> int | None:
        """How many likeliest tokens each generated token lists (None: no logprobs at all)."""
        raise NotImplementedError

    def refusals(self) -> list[tuple[str, bool, str]]:
        """(param, refused, message) for the values of this request's own fields that gptlab refuses."""
        return []


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions (OpenAI's legacy completions API, plus top_k)."""

    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids, one prompt or a batch
    max_tokens: int = 16  # OpenAI's default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch, as text or as token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # one prompt: a string or a list of ids
        return list(prompt)  # type: ignore[arg-type]

    @property
    def token_limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def refusals(self) -> list[tuple[str, bool, str]]:
        return [
            ("echo", self.echo and self.stream, "echo is not supported with stream: ask without stream"),
            ("suffix", self.suffix is not None, "suffix (insertion) is not supported"),
            ("best_of", self.best_of not in (None, 1, self.n), "best_of must equal n"),
            ("logprobs", self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs={self.logprobs} must be in 0..{MAX_LOGPROBS}"),
            ("prompt", not self.prompts, "prompt must hold at least one prompt"),
        ]


class TextPart(BaseModel):
    """A part of a message's content given as a list: only text parts (no images, no audio)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation, as OpenAI's chat API sends it (its content a string or text parts)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted, as OpenAI does; no gptlab template shows it

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    """The body of POST /v1/chat/completions (OpenAI's chat completions API, plus top_k)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # OpenAI's older name for max_completion_tokens
    max_completion_tokens: int | None = None  # None: until the end of the turn, within the server's limit
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprobs_count(self) -> int | None:
        """top_logprobs as a row's `logprobs`: how many alternatives, or None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusals(self) -> list[tuple[str, bool, str]]:
        both = None not in (self.max_tokens, self.max_completion_tokens)
        return [
            ("messages", not self.messages, "messages must hold at least one message"),
            ("max_completion_tokens", both and self.max_tokens != self.max_completion_tokens,
             f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} differ: "
             "give one of them"),
            ("top_logprobs", self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS,
             f"top_logprobs={self.top_logprobs} must be in 0..{MAX_LOGPROBS}"),
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs,
             "top_logprobs needs logprobs: true"),
        ]


class AttentionRequest(BaseModel):
    """The body of POST /v1/attention: where the last token of `text` attends, in one layer and head.

    With `messages`, `text` continues the conversation as the chat route renders it (a reply so far)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str
    layer: int = 0
    head: int = 0
    messages: list[ChatMessage] | None = None


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize (vLLM's): a text to encode, with the special tokens a prompt gets (an
    imported tokenizer's BOS) or, by default as lm-eval asks, without them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    """The body of POST /detokenize (vLLM's): token ids to decode."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tokens: list[int]
    model: str | None = None


def parse(model: type[BaseModel], data: Any) -> Any:
    """`model` built from decoded JSON, or a 400 APIError naming the first bad field (`messages[1].role`)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = field_path(first["loc"]) or None
        if first["type"] == "extra_forbidden":
            owner = f": {model.__name__} has no such field" if len(first["loc"]) == 1 else ""
            raise APIError(400, f"unknown field {param!r}{owner}", param, "unknown_field") from None
        if first["type"] == "missing":
            raise APIError(400, f"{param} is required", param, "missing_field") from None
        shown = repr(first.get("input"))[:80]
        raise APIError(400, f"{param}={shown} is invalid: {first['msg'][0].lower()}{first['msg'][1:]}",
                       param, "invalid_type") from None


def check_body(data: Any) -> None:
    """A 400 APIError naming the field for decoded JSON that no route can use: arrays and objects nested
    past MAX_DEPTH, or a string (or field name) holding a lone surrogate ("a\\ud800b"), which is no
    character and cannot be encoded, compared or sent back as UTF-8. Walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            found = SURROGATE.search(value)
            if found:
                code = ord(found.group())
                raise APIError(400, f"{path or 'the body'}: the text holds the lone surrogate U+{code:04X}, "
                               "which is no character; send the text as UTF-8 (a pair such as "
                               "\\ud83d\\ude00 is fine)", path or None, "invalid_text")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise APIError(400, f"{path or 'the body'}: arrays and objects are nested more than {MAX_DEPTH} "
                           "deep", path or None, "too_deep")
        if isinstance(value, list):
            stack.extend((value[i], f"{path}[{i}]", depth + 1) for i in reversed(range(len(value))))
            continue
        children = []
        for key, item in value.items():
            if SURROGATE.search(key):
                raise APIError(400, f"a field name in {path or 'the body'} holds a lone surrogate, which is "
                               "no character; send the text as UTF-8", path or None, "invalid_text")
            if not key.isidentifier():
                step = f"[{json.dumps(key)}]"
            else:
                step = f".{key}" if path else key
            children.append((item, path + step, depth + 1))
        stack.extend(reversed(children))  # the first bad field is the one named


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a reader writes it: ("messages", 1, "role") -> "messages[1].role".

    The names pydantic gives the members of a union ("str", "list[TextPart]") are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in UNION_TAGS:
            path += f".{part}" if path else part
    return path


def with_defaults(request: SamplingRequest, defaults: dict[str, Any]) -> Any:
    """The request with a model's own sampling defaults in the fields it did not set itself."""
    unset = {k: v for k, v in defaults.items() if k not in request.model_fields_set}
    return request.model_copy(update=unset) if unset else request


def sampling_config(request: SamplingRequest, seed: int | None, limits: Limits) -> SamplingConfig:
    """The request's SamplingConfig for one choice; SamplingConfig's own checks become 400s. A request
    that sets no token limit (a chat turn) gets the server's largest."""
    refuse_unsupported(request)
    max_tokens, field = request.token_limit
    max_tokens = limits.max_tokens if max_tokens is None else max_tokens
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"{field}={max_tokens} is more than this server allows "
                       f"({limits.max_tokens}); ask for fewer", field, "max_tokens_too_large")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > limits.max_stops:
        raise APIError(400, f"stop has {len(stop)} strings; this server allows at most {limits.max_stops}",
                       "stop", "too_many_stops")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise APIError(400, f"stop strings may be at most {limits.max_stop_chars} characters long",
                       "stop", "stop_too_long")
    bias: Any = request.logit_bias or None  # JSON's keys are strings: SamplingConfig reads them as ids
    try:
        return SamplingConfig(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                              max_new_tokens=max_tokens, stop=tuple(stop), seed=seed, logit_bias=bias)
    except ValueError as err:
        found = re.match(r"SamplingConfig\.(\w+)", str(err))
        param = {"max_new_tokens": field}.get(found.group(1), found.group(1)) if found else None
        message = str(err).replace("SamplingConfig.max_new_tokens", field)
        raise APIError(400, message.replace("SamplingConfig.", ""), param, "invalid_value") from None


def refuse_unsupported(request: SamplingRequest) -> None:
    """A 400 for OpenAI options set to something gptlab does not do."""
    checks = [
        ("presence_penalty", request.presence_penalty != 0, "presence_penalty must be 0"),
        ("frequency_penalty", request.frequency_penalty != 0, "frequency_penalty must be 0"),
        ("n", request.n < 1, f"n={request.n} must be at least 1"),
        ("seed", request.seed is not None and not 0 <= request.seed < 2**63,
         f"seed={request.seed} must be in [0, 2**63)"),
        ("stream_options", request.stream_options is not None and not request.stream,
         "stream_options is only allowed when stream is true"),
        *request.refusals(),
    ]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param, "unsupported_value")
