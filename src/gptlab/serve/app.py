"""The ASGI application of `gptlab serve`: OpenAI's completions and chat APIs over the continuous batcher.

Routes: `GET /` (the playground page), `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions` (`chat`: the conversation rendered with the run's chat template), both
streamed as server-sent events, one chunk per token, ending with `data: [DONE]`; usage in a last chunk
only with `stream_options: {"include_usage": true}`, as OpenAI does; and `POST /v1/attention` (the
attention weights the playground shows, from `gptlab.inspection`). For lm-eval's `local-completions`
model, a completion may echo its prompt with the prompt tokens' logprobs, and vLLM's tokenizer routes
answer its remote tokenizer: `GET /tokenizer_info`, `POST /tokenize` and `POST /detokenize`.
`GET /metrics` is Prometheus' scrape (`prometheus`), unless the app is made with `metrics=False` (a 404).

Request bodies are read here rather than by FastAPI, so that every refusal is one of OpenAI's error
objects with a 4xx status and the field named: a body that is not `Content-Type: application/json` is
a 415, one over 1 MB a 413 before it is parsed, bad JSON a 400, a bad field a 400 (`schemas`). A
prompt must encode to 1 .. block_size tokens, and with `max_context` below block_size the prompt and
max_tokens together must fit it. With an API key, /metrics and every /v1 route want `Authorization:
Bearer KEY` (401 otherwise); the page itself is open, and asks for the key. `guard` checks the Host name and
turns faults into a generic 500. A full queue is a 429 and a request that waited past its deadline a
503, both with Retry-After. A client that goes away cancels its rows, running or still queued.
The request's own work (encoding, queueing, its events as OpenAI's JSON) is in `completion` and `chat`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gptlab.config import SettingError
from gptlab.inference.lm import LM
from gptlab.inspection.attention_view import attention_maps
from gptlab.serve.batching import Scheduler
from gptlab.serve.chat import ChatServing, chat_text_ids, start_chat
from gptlab.serve.completion import Completion, Served, start_completion
from gptlab.serve.guard import LOOPBACK_NAMES, Guard
from gptlab.serve.page import playground
from gptlab.serve.prefix_cache import DEFAULT_BUDGET
from gptlab.serve.prometheus import Metrics, instrument
from gptlab.serve.schemas import (
    MAX_DEPTH,
    SAMPLING_DEFAULTS,
    APIError,
    AttentionRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    check_body,
    parse,
    with_defaults,
)
from gptlab.speculative import SpeculationConfig

MAX_BODY = 1 << 20  # bytes: a larger body is a 413


def create_app(lm: LM, name: str, *, api_key: str | None = None, max_batch: int = 64,
               limits: Limits | None = None, allowed_hosts: Collection[str] | None = LOOPBACK_NAMES,
               metrics: bool = True, speculation: SpeculationConfig | None = None,
               prefix_cache_bytes: int = DEFAULT_BUDGET) -> FastAPI:
    """The server's ASGI app for one model (`gptlab.load`'s LM, or `LM.from_model`); its decode thread runs
    while the app's lifespan does.

    The LM's sampling defaults (an imported model's generation_config: temperature, top_p, top_k) fill the
    fields a request does not set, and its chat template renders chats. `allowed_hosts`: the Host names it
    answers to (None: any); `metrics`: whether to count and answer GET /metrics; `speculation`:
    prompt-lookup decoding for every request that does not turn it off; `prefix_cache_bytes`: the prefix
    cache's budget (0: none)."""
    model, tokenizer, template = lm.model, lm.tokenizer, lm.template
    # max_tokens stays OpenAI's default: only the sampling fields take the run's own defaults.
    defaults = {key: value for key, value in lm.defaults.items() if key in SAMPLING_DEFAULTS}
    if not model.config.causal:
        raise ValueError("gptlab serve needs a causal model: causal=False is only for demonstrations")
    limits = limits or Limits()
    if limits.max_context is not None and limits.max_context > model.config.block_size:
        raise SettingError(f"{{max_context}} {limits.max_context} is more than the model's context window "
                           f"({model.config.block_size}): give at most {model.config.block_size}",
                           max_context="max_context")
    scheduler = Scheduler(model, tokenizer, max_batch, max_context=limits.max_context,
                          max_waiting=limits.max_waiting, prefill_chunk=limits.prefill_chunk,
                          speculation=speculation, prefix_cache_bytes=prefix_cache_bytes)
    served = Served(model, tokenizer, name, scheduler, api_key, limits, max_choices=2 * max_batch,
                    created=int(time.time()), defaults=defaults)
    # No /docs pages: they load scripts from a CDN, and nothing this server shows may fetch anything.
    app = FastAPI(title=f"gptlab: {name}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served, app.state.chat = served, ChatServing.of(template, tokenizer)
    app.add_middleware(Guard, allowed=allowed_hosts)  # inside Starlette's own fault handler, so it answers
    app.state.metrics = instrument(app, scheduler, routes.routes) if metrics else None  # outside Guard
    add_error_handlers(app)
    app.include_router(routes)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The decode thread runs while the app does."""
    app.state.served.scheduler.start()
    yield
    app.state.served.scheduler.close()


# The routes read what they serve from the app's state: `served` (model, tokenizer, limits, decode thread)
# and `chat` (the run's chat template).
routes = APIRouter()


@routes.get("/", response_class=HTMLResponse)
async def page(request: Request) -> HTMLResponse:
    served: Served = request.app.state.served
    return HTMLResponse(playground(served.model.config, served.name, served.limits.max_tokens,
                                   served.api_key is not None, request.app.state.chat.refusal()))


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    served = authorize(request)
    return {"object": "list", "data": [model_card(served)]}


@routes.get("/v1/models/{model_id}")
async def one_model(model_id: str, request: Request) -> dict[str, Any]:
    served = authorize(request)
    check_model(model_id, served)
    return model_card(served)


@routes.post("/v1/completions", response_model=None)
async def completions(request: Request) -> JSONResponse | StreamingResponse:
    served = authorize(request)
    body = with_defaults(parse(CompletionRequest, await read_json(request)), served.defaults)
    check_model(body.model, served)
    return await respond(await start_completion(body, served), body.stream, request)


@routes.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    served = authorize(request)
    body = with_defaults(parse(ChatRequest, await read_json(request)), served.defaults)
    check_model(body.model, served)
    return await respond(start_chat(body, served, request.app.state.chat), body.stream, request)


@routes.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    return tokenizer_card(authorize(request))


@routes.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    served = authorize(request)
    body = parse(TokenizeRequest, await read_json(request))
    check_model(body.model, served)
    try:
        ids = served.tokenizer.encode(body.prompt) if body.add_special_tokens else \
            served.tokenizer.encode_array(body.prompt).tolist()
    except ValueError as err:
        raise APIError(400, f"prompt: {err}", "prompt", "unencodable_prompt") from None
    return {"count": len(ids), "max_model_len": served.max_context, "tokens": ids}


@routes.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    served = authorize(request)
    body = parse(DetokenizeRequest, await read_json(request))
    check_model(body.model, served)
    vocab_size = served.tokenizer.vocab_size
    bad = next((i for i in body.tokens if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside this model's vocabulary of {vocab_size} tokens",
                       "tokens", "invalid_token")
    return {"prompt": served.tokenizer.decode(body.tokens)}


@routes.get("/metrics")
async def metrics_page(request: Request) -> Response:
    exporter: Metrics | None = request.app.state.metrics
    if exporter is None:  # served without metrics: as if the route did not exist
        raise HTTPException(404, "Not Found")
    authorize(request)
    body, content_type = exporter.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)


@routes.post("/v1/attention")
async def attention(request: Request) -> dict[str, Any]:
    served = authorize(request)
    body = parse(AttentionRequest, await read_json(request))
    return await attention_row(body, served, request.app.state.chat)


async def respond(job: Completion, stream: bool, request: Request) -> JSONResponse | StreamingResponse:
    """A queued request's answer: its server-sent events, or its whole JSON once every choice ended."""
    if stream:
        first = await job.first_event(request)  # a refusal while queued is still a real status
        if first is None:  # the client left while its request waited: nobody reads this
            return JSONResponse({}, status_code=499)
        return StreamingResponse(job.stream(first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await job.collect(request))


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's error object: ours, FastAPI's validation, routing (404, 405).
    Faults (any other exception) are `guard.Guard`'s: logged, and a generic 500."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return api_error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        return api_error_response(APIError(400, f"{param}: {first['msg']}", param, "invalid_value"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return api_error_response(APIError(err.status_code, f"{request.method} {request.url.path}: "
                                           f"{err.detail}", None, code))


def api_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def authorize(request: Request) -> Served:
    """What the app serves; a 401 unless the server has no key or the request carries it as a bearer
    token."""
    served: Served = request.app.state.served
    if served.api_key is None:
        return served
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer KEY` with "
                       "the server's key", None, "invalid_api_key")
    return served


def check_model(name: str | None, served: Served) -> None:
    if name is not None and name != served.name:
        raise APIError(404, f"model {name!r} does not exist: this server serves {served.name!r}",
                       "model", "model_not_found")


def tokenizer_card(served: Served) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the special tokens' text (lm-eval reads eos_token to stop generations)."""
    tokenizer = served.tokenizer
    bos_id = getattr(tokenizer, "bos_id", None)  # only an imported tokenizer has a BOS
    return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": served.max_context,
            "eos_token": None if tokenizer.eot_id is None else tokenizer.decode([tokenizer.eot_id]),
            "bos_token": None if bos_id is None else tokenizer.decode([bos_id]), "pad_token": None}


def model_card(served: Served) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "gptlab",
            "context_window": served.max_context}


async def read_json(request: Request) -> Any:
    """The request's body as JSON: 415 unless it says it is JSON, 413 past MAX_BODY bytes (declared or
    sent), 400 when it is not JSON, nests too deep or holds a lone surrogate (`schemas.check_body`)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type {media_type or 'missing'!r}: send the body as application/json",
                       None, "unsupported_media_type")
    declared = request.headers.get("content-length", "0")
    too_large = APIError(413, f"the request body is larger than {MAX_BODY:,} bytes", None, "body_too_large")
    if not declared.isdigit():
        raise APIError(400, f"Content-Length {declared!r} is not a number", None, "invalid_header")
    if int(declared) > MAX_BODY:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise too_large
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", None, "invalid_json") from None
    except RecursionError:  # the decoder recurses once per level: a body of 100,000 "[" ends here
        raise APIError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep", None,
                       "too_deep") from None
    check_body(data)  # lone surrogates, and nesting the decoder allowed but past MAX_DEPTH
    return data


async def attention_row(body: AttentionRequest, served: Served, chat: ChatServing) -> dict[str, Any]:
    """Where the last token of `body.text` (its last block_size tokens) attends in one layer and head;
    `bytes` gives each token's own bytes, so a page can join the pieces of one character. With
    `body.messages`, the text follows the conversation rendered as the chat route renders it."""
    text = body.text
    try:
        if body.messages is None:
            ids = served.tokenizer.encode(text)
        else:
            text, ids = chat_text_ids(chat, served, body.messages, body.text)
    except ValueError as err:
        raise APIError(400, f"text: {err}", "text", "unencodable_prompt") from None
    window = ids[-served.model.config.block_size:]
    if not window:
        raise APIError(400, "text encodes to no tokens: give a non-empty text", "text", "empty_prompt")

    def compute() -> Any:
        return attention_maps(served.model, served.tokenizer, text, window, body.layer, body.head)

    try:
        maps = await asyncio.wrap_future(served.scheduler.call(compute))  # between two decode steps
    except ValueError as err:  # check_index's SettingError names the argument it refuses: layer or head
        param = "layer" if "layer" in getattr(err, "settings", {}).values() else "head"
        raise APIError(400, str(err), param, "invalid_value") from None
    return {"tokens": maps.labels, "bytes": [list(served.tokenizer.token_bytes(t)) for t in window],
            "weights": [round(float(w), 5) for w in maps.weights[0, 0, -1]],
            "layer": body.layer, "head": body.head, "dropped": len(ids) - len(window)}
