"""The ASGI application of `gptlab serve`: OpenAI's completions API over the continuous batcher.

Routes: `GET /` (the playground page), `GET /v1/models`, `POST /v1/completions` (streamed as
server-sent events, one chunk per token, ending with `data: [DONE]`) and `POST /v1/attention` (the
attention weights the playground shows, from `gptlab.inspection`).

Request bodies are read here rather than by FastAPI, so that every refusal is one of OpenAI's error
objects with a 4xx status and the field named: a body over 1 MB is a 413 before it is parsed, bad
JSON a 400, a bad field a 400 (`schemas`). A prompt must encode to 1 .. block_size tokens: the server
refuses a longer one instead of silently keeping its end as `generate` does. With an API key, every
/v1 route wants `Authorization: Bearer KEY` (401 otherwise); the page itself is open, and asks for
the key. A client that goes away cancels its rows, which leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from gptlab.inspection.attention_view import attention_maps
from gptlab.model import GPT
from gptlab.sampling import sampler
from gptlab.serve.batching import Event, Row, Scheduler, Ticket
from gptlab.serve.page import playground
from gptlab.serve.schemas import (
    APIError,
    AttentionRequest,
    CompletionRequest,
    parse,
    sampling_config,
)
from gptlab.tokenizer import Tokenizer

MAX_BODY = 1 << 20  # bytes: a larger body is a 413
FINISH_REASONS = {"eot": "stop", "stop": "stop", "length": "length"}  # gptlab's stop reasons, OpenAI's names


@dataclass
class Served:
    """What the routes share: the model, its name, the decode thread and the server's limits."""

    model: GPT
    tokenizer: Tokenizer
    name: str
    scheduler: Scheduler
    api_key: str | None
    max_tokens: int  # the largest max_tokens a request may ask for
    max_choices: int  # the most rows (prompts x n) one request may start
    created: int


def create_app(model: GPT, tokenizer: Tokenizer, name: str, *, api_key: str | None = None,
               max_batch: int = 64, max_tokens: int = 1024) -> FastAPI:
    """The server's ASGI app for one model; its decode thread runs while the app's lifespan does."""
    if not model.config.causal:
        raise ValueError("gptlab serve needs a causal model: causal=False is only for demonstrations")
    served = Served(model, tokenizer, name, Scheduler(model, tokenizer, max_batch), api_key, max_tokens,
                    max_choices=2 * max_batch, created=int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.scheduler.start()
        yield
        served.scheduler.close()

    # No /docs pages: they load scripts from a CDN, and nothing this server shows may fetch anything.
    app = FastAPI(title=f"gptlab: {name}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    add_error_handlers(app)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(playground(model.config, name, max_tokens, api_key is not None))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request, served)
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{model_id}")
    async def one_model(model_id: str, request: Request) -> dict[str, Any]:
        authorize(request, served)
        check_model(model_id, served)
        return model_card(served)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        authorize(request, served)
        body = parse(CompletionRequest, await read_json(request))
        check_model(body.model, served)
        job = start_completion(body, served)
        if body.stream:
            return StreamingResponse(job.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await job.collect(request))

    @app.post("/v1/attention")
    async def attention(request: Request) -> dict[str, Any]:
        authorize(request, served)
        body = parse(AttentionRequest, await read_json(request))
        return await attention_row(body, served)

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: ours, FastAPI's validation, routing (404, 405), and faults."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

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

    @app.exception_handler(Exception)
    async def fault(request: Request, err: Exception) -> JSONResponse:
        return api_error_response(APIError(500, f"internal error: {err!r}", None, None, "server_error"))


def api_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def authorize(request: Request, served: Served) -> None:
    """A 401 unless the server has no key or the request carries it as a bearer token."""
    if served.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer KEY` with "
                       "the key given to `gptlab serve --api-key`", None, "invalid_api_key")


def check_model(name: str | None, served: Served) -> None:
    if name is not None and name != served.name:
        raise APIError(404, f"model {name!r} does not exist: this server serves {served.name!r}",
                       "model", "model_not_found")


def model_card(served: Served) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "gptlab",
            "context_window": served.model.config.block_size}


async def read_json(request: Request) -> Any:
    """The request's body as JSON: 413 past MAX_BODY bytes (declared or sent), 400 when it is not JSON."""
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
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", None, "invalid_json") from None


def encode_prompt(text: str, served: Served, param: str) -> list[int]:
    """The token ids of a prompt, or a 400 when the tokenizer cannot encode it or it does not fit."""
    try:
        ids = served.tokenizer.encode(text)
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param, "unencodable_prompt") from None
    window = served.model.config.block_size
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens: give a non-empty prompt", param, "empty_prompt")
    if len(ids) > window:
        raise APIError(400, f"{param} is {len(ids)} tokens long; this model's context window is {window} "
                       "tokens: shorten it", param, "context_length_exceeded")
    return ids


def start_completion(body: CompletionRequest, served: Served) -> Completion:
    """Validate every choice, then queue them all on the decode thread (nothing is queued on a 400)."""
    prompts = body.prompts
    if len(prompts) * body.n > served.max_choices:
        raise APIError(400, f"{len(prompts)} prompt(s) x n={body.n} is more than the {served.max_choices} "
                       "choices one request may ask for", "n", "too_many_choices")
    sampling = sampling_config(body, body.seed, served.max_tokens)
    encoded = [encode_prompt(p, served, "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]")
               for i, p in enumerate(prompts)]
    job = Completion(body, served, prompts, sum(map(len, encoded)))
    device = next(served.model.parameters()).device
    rows = []
    for index in range(len(prompts) * body.n):
        # Choice i is seeded with seed + i, so a request with one choice is `generate` with its seed.
        seed = secrets.randbits(63) if body.seed is None else (body.seed + index) % 2**63
        choice = sampling.replace(seed=seed)
        rows.append(Row(index, list(encoded[index // body.n]), choice, sampler(choice, device),
                        body.logprobs, job.emit, job.ticket))
    served.scheduler.submit(rows)
    return job


class Completion:
    """One request's choices as they decode: their events arrive on an asyncio queue from the decode
    thread, and become OpenAI's JSON, streamed or at the end."""

    def __init__(self, body: CompletionRequest, served: Served, prompts: list[str],
                 prompt_tokens: int) -> None:
        self.body, self.served, self.prompts = body, served, prompts
        self.choices = len(prompts) * body.n
        self.prompt_tokens = prompt_tokens
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.ticket = Ticket()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.offsets = [len(prompts[i // body.n]) for i in range(self.choices)]  # text_offset, per choice

    def emit(self, event: Event) -> None:
        """Called on the decode thread: hand the event to this request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is stopping
            self.ticket.cancel()

    async def events_until_done(self) -> AsyncIterator[Event]:
        """Every event of every choice, until each choice has ended; cancels the rows if abandoned."""
        ended = 0
        try:
            while ended < self.choices:
                event = await self.events.get()
                if event.error is not None:
                    raise APIError(503, event.error, None, "decoding_failed", "server_error")
                ended += event.finish_reason is not None
                yield event
        finally:
            self.ticket.cancel()  # a no-op for rows that ended; frees the slots of the others

    def choice(self, event: Event) -> dict[str, Any]:
        """One event as an OpenAI choice (a stream chunk's, or a part of a whole completion's)."""
        logprobs = None
        if event.logprob is not None:
            text = self.served.tokenizer.decode([event.token])
            decode = self.served.tokenizer.decode
            logprobs = {"tokens": [text], "token_logprobs": [finite(event.logprob)],
                        "top_logprobs": [{decode([t]): finite(lp) for t, lp in event.top or []}],
                        "text_offset": [self.offsets[event.index]]}
            self.offsets[event.index] += len(text)
        return {"text": event.text, "index": event.index, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS.get(event.finish_reason or "")}

    def envelope(self, choices: list[dict[str, Any]], completion_tokens: int | None = None) -> dict[str, Any]:
        reply: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                 "model": self.served.name, "choices": choices}
        if completion_tokens is not None:
            reply["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": self.prompt_tokens + completion_tokens}
        return reply

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token, a last chunk per choice, usage, then [DONE]."""
        completion_tokens, ready = 0, []
        try:
            async for event in self.events_until_done():
                completion_tokens += event.completion_tokens
                ready.append(sse(self.envelope([self.choice(event)])))
                if self.events.empty():  # one write for the chunks that arrived together
                    yield "".join(ready)
                    ready = []
        except APIError as err:  # the status is sent already: report in the stream, as OpenAI does
            yield sse(err.body())
            return
        yield "".join(ready) + sse(self.envelope([], completion_tokens)) + "data: [DONE]\n\n"

    async def collect(self, request: Request) -> dict[str, Any]:
        """The whole completion; a client that disconnects first cancels its rows."""
        watcher = asyncio.create_task(cancel_on_disconnect(request, self.ticket))
        texts, logprobs = [""] * self.choices, [empty_logprobs() for _ in range(self.choices)]
        reasons: list[str | None] = [None] * self.choices
        completion_tokens = 0
        try:
            async for event in self.events_until_done():
                part = self.choice(event)
                texts[event.index] += event.text
                reasons[event.index] = part["finish_reason"] or reasons[event.index]
                completion_tokens += event.completion_tokens
                for key, values in (part["logprobs"] or {}).items():
                    logprobs[event.index][key] += values
        finally:
            watcher.cancel()
        choices = [{"text": texts[i], "index": i, "logprobs": logprobs[i] if self.body.logprobs is not None
                    else None, "finish_reason": reasons[i]} for i in range(self.choices)]
        return self.envelope(choices, completion_tokens)


def empty_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a token of probability 0 gets the most negative float instead."""
    return logprob if math.isfinite(logprob) else -3.4e38


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def cancel_on_disconnect(request: Request, ticket: Ticket) -> None:
    """Poll the connection while a whole completion is computed; cancel its rows when it closes."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)
    ticket.cancel()


async def attention_row(body: AttentionRequest, served: Served) -> dict[str, Any]:
    """Where the last token of `body.text` (its last block_size tokens) attends in one layer and head."""
    try:
        ids = served.tokenizer.encode(body.text)
    except ValueError as err:
        raise APIError(400, f"text: {err}", "text", "unencodable_prompt") from None
    window = ids[-served.model.config.block_size:]
    if not window:
        raise APIError(400, "text encodes to no tokens: give a non-empty text", "text", "empty_prompt")

    def compute() -> Any:
        return attention_maps(served.model, served.tokenizer, body.text, window, body.layer, body.head)

    try:
        maps = await asyncio.wrap_future(served.scheduler.call(compute))  # between two decode steps
    except ValueError as err:
        param = "layer" if "--layer" in str(err) else "head"
        raise APIError(400, str(err).replace(f"--{param}", param), param, "invalid_value") from None
    return {"tokens": maps.labels, "weights": [round(float(w), 5) for w in maps.weights[0, 0, -1]],
            "layer": body.layer, "head": body.head, "dropped": len(ids) - len(window)}
