"""One completion request on its way through the server: its prompts checked and encoded, its rows
queued on the decode thread, and their events turned into OpenAI's JSON, streamed or whole.

With `echo` the prompt comes back before the completion, and with `logprobs` its own tokens' log-probabilities
too (`prompt_logprobs`: one forward pass on the decode thread), as OpenAI's completions API did and as
lm-eval's `local-completions` model scores a continuation: `token_logprobs[0]` is null, as nothing predicts
the first token. A prompt may be token ids, kept as they are.

Per-token text (`logprobs.tokens`, the keys of `top_logprobs`) is each token's own bytes; a token that
is part of a character is written as OpenAI writes it, `bytes:\\xc3` (`token_text`).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gptlab.config import SamplingConfig
from gptlab.model import GPT
from gptlab.sampling import sampler
from gptlab.serve.batching import Scheduler
from gptlab.serve.constraints import check_bias, request_grammar, requested
from gptlab.serve.rows import Event, QueueFull, Row, Ticket
from gptlab.serve.schemas import APIError, CompletionRequest, Limits, SamplingRequest, sampling_config
from gptlab.structured.grammar import Grammar
from gptlab.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fastapi import Request

# gptlab's stop reasons, OpenAI's names: a row cut by its deadline ends as one cut by max_tokens.
FINISH_REASONS = {"eot": "stop", "stop": "stop", "length": "length", "deadline": "length"}
BUSY_RETRY = 5.0  # seconds a client whose request timed out in the queue is told to wait


@dataclass
class Served:
    """What the routes share: the model, its name, the decode thread and the server's limits."""

    model: GPT
    tokenizer: Tokenizer
    name: str
    scheduler: Scheduler
    api_key: str | None
    limits: Limits
    max_choices: int  # the most rows (prompts x n) one request may start
    created: int
    defaults: dict[str, Any]  # sampling values for fields a request leaves out (a model's own)

    @property
    def max_context(self) -> int:
        return self.limits.max_context or self.model.config.block_size


def encode_prompt(prompt: str | list[int], served: Served, param: str, max_tokens: int) -> list[int]:
    """The token ids of a prompt (text, or ids already), or a 400 when the tokenizer cannot encode it, an
    id is outside the vocabulary or it does not fit."""
    if not isinstance(prompt, str):
        vocab = served.tokenizer.vocab_size
        bad = next((i for i in prompt if not 0 <= i < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param} holds token id {bad}, outside this model's vocabulary of {vocab} "
                           "tokens: encode the prompt with this server's /tokenize", param, "invalid_token")
        return check_prompt(list(prompt), served, param, max_tokens)
    try:
        ids = served.tokenizer.encode(prompt)
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param, "unencodable_prompt") from None
    return check_prompt(ids, served, param, max_tokens)


def check_prompt(ids: list[int], served: Served, param: str, max_tokens: int) -> list[int]:
    """The ids of a prompt, or a 400 when they are none or do not fit.

    With max_context below block_size the prompt and max_tokens must fit together; at block_size a
    completion may run past the window, which slides as in `generate`."""
    window, context = served.model.config.block_size, served.max_context
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens: give a non-empty prompt", param, "empty_prompt")
    if len(ids) > window:
        raise APIError(400, f"{param} is {len(ids)} tokens long; this model's context window is {window} "
                       "tokens: shorten it", param, "context_length_exceeded")
    if context < window and len(ids) + max_tokens > context:
        raise APIError(400, f"{param} is {len(ids)} tokens and max_tokens is {max_tokens}, more than this "
                       f"server's context of {context} tokens: shorten the prompt or ask for fewer tokens",
                       param, "context_length_exceeded")
    return ids


async def start_completion(body: CompletionRequest, served: Served) -> Completion:
    """Validate every choice, score the prompts when echoed, then queue every choice on the decode thread
    (nothing is queued on a 400)."""
    prompts = body.prompts
    check_choices(len(prompts) * body.n, served)
    sampling = sampling_config(body, body.seed, served.limits)
    check_bias(sampling, served.tokenizer)
    speculative = speculating(body, served)
    grammar = request_grammar(body, served.tokenizer, served.tokenizer.stop_ids)
    single = len(prompts) == 1 and body.prompt is prompts[0]
    encoded = [encode_prompt(p, served, "prompt" if single else f"prompt[{i}]", sampling.max_new_tokens)
               for i, p in enumerate(prompts)]
    texts = [p if isinstance(p, str) else served.tokenizer.decode(ids)
             for p, ids in zip(prompts, encoded, strict=True)]
    echoes: list[dict[str, list[Any]]] | None = None
    if body.echo:
        top = body.logprobs_count()
        echoes = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}] * len(encoded)
        if top is not None:  # on the decode thread, between two steps, as nothing else may use the model
            echoes = await asyncio.wrap_future(served.scheduler.call(
                lambda: [prompt_logprobs(served.model, served.tokenizer, ids, top) for ids in encoded]))
    job = Completion(body, served, texts, sum(map(len, encoded)), echoes)
    queue_rows(job, encoded, sampling, grammar, speculative)
    return job


def prompt_logprobs(model: GPT, tokenizer: Tokenizer, ids: list[int], top: int) -> dict[str, list]:
    """OpenAI's logprobs of a prompt's own tokens: each one's log-probability given those before it (null
    for the first) and the `top` likeliest tokens in its place, under the raw softmax, as for generated
    tokens."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids], device=device))  # (1, T, V)
    logp = logits[0, :-1].float().log_softmax(-1)  # (T-1, V): row i predicts token i+1
    chosen = logp.gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].tolist()  # (T-1,)
    # the likeliest among the tokenizer's ids: a vocabulary padded past them has no text for the rest
    known = logp[:, :tokenizer.vocab_size]  # (T-1, tokenizer's V)
    best_lp, best_ids = known.topk(min(top, tokenizer.vocab_size), dim=-1)  # (T-1, top) each
    pieces = [tokenizer.token_bytes(t) for t in ids]
    utf8, offsets, offset = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
    for piece in pieces:  # a piece of a character moves the offset only once the character is whole
        offsets.append(offset)
        offset += len(utf8.decode(piece))
    tops = [{token_text(tokenizer.token_bytes(t)): finite(lp) for t, lp in zip(row_ids, row_lp, strict=True)}
            for row_ids, row_lp in zip(best_ids.tolist(), best_lp.tolist(), strict=True)]
    return {"tokens": [token_text(p) for p in pieces], "token_logprobs": [None, *map(finite, chosen)],
            "top_logprobs": [None, *tops], "text_offset": offsets}


def speculating(body: SamplingRequest, served: Served) -> bool:
    """Whether a request's rows draft tokens: when the server speculates, unless the request says
    `"speculative": false`; a 400 for `"speculative": true` on a server that does not."""
    available = served.scheduler.speculation is not None
    if body.speculative and not available:
        raise APIError(400, "speculative: this server was started without speculative decoding (gptlab serve "
                       "--speculative ngram turns it on): leave the field out or set it to false",
                       "speculative", "unsupported_value")
    return available and body.speculative is not False


def check_choices(choices: int, served: Served) -> None:
    if choices > served.max_choices:
        raise APIError(400, f"{choices} choices (prompts x n) are more than the {served.max_choices} one "
                       "request may ask for", "n", "too_many_choices")


def queue_rows(job: Completion, encoded: Sequence[list[int]], sampling: SamplingConfig,
               grammar: Grammar | None = None, speculative: bool = False) -> None:
    """Queue n rows per prompt on the decode thread, all or none (a full queue is a 429); with a grammar
    (structured output), each row follows its own matcher; `speculative`: the rows draft tokens."""
    body, served = job.body, job.served
    device = next(served.model.parameters()).device
    deadline = time.monotonic() + served.limits.request_timeout
    rows = []
    for index in range(len(encoded) * body.n):
        # Choice i is seeded with seed + i, so a request with one choice is `generate` with its seed.
        seed = secrets.randbits(63) if body.seed is None else (body.seed + index) % 2**63
        choice = sampling.replace(seed=seed)
        rows.append(Row(index, list(encoded[index // body.n]), choice, sampler(choice, device),
                        body.logprobs_count(), job.emit, job.ticket, deadline=deadline,
                        matcher=None if grammar is None else grammar.matcher(), speculative=speculative))
    try:
        served.scheduler.submit(rows)
    except QueueFull as full:
        raise APIError(429, "the server's queue is full: retry later", None, "queue_full", "rate_limit_error",
                       retry_after=full.retry_after) from None


def token_text(piece: bytes) -> str:
    """A token's text as OpenAI's logprobs write it: its characters, or `bytes:\\xNN...` for a token
    that is not whole UTF-8 on its own (a piece of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class Completion:
    """One request's choices as they decode: their events arrive on an asyncio queue from the decode
    thread, and become OpenAI's JSON, streamed or at the end.

    The JSON is the completions API's; `serve.chat.ChatCompletion` overrides the few methods that shape it
    (`choice`, `whole_choice`, `envelope`, `opening`, `empty_logprobs`) and shares the rest."""

    ID_PREFIX = "cmpl"

    def __init__(self, body: SamplingRequest, served: Served, prompts: list[str],
                 prompt_tokens: int, echoes: list[dict[str, list]] | None = None) -> None:
        """`echoes`: per prompt, its own tokens' logprobs, to come before the completion's (None: no echo)."""
        self.body, self.served, self.prompts, self.echoes = body, served, prompts, echoes
        self.choices = len(prompts) * body.n
        self.prompt_tokens = prompt_tokens
        asked = requested(body)  # checked already: the field a grammar the engine gives up on is blamed on
        self.constraint = None if asked is None else asked[1]
        self.id = f"{self.ID_PREFIX}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.ticket = Ticket()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event | None] = asyncio.Queue()  # None: the client went away
        self.usage = body.stream_options is not None and body.stream_options.include_usage
        self.offsets = [len(prompts[i // body.n]) for i in range(self.choices)]  # text_offset, per choice
        # Characters completed so far, per choice: a piece of a character moves the offset only once whole.
        self.utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(self.choices)]

    def emit(self, event: Event) -> None:
        """Called on the decode thread: hand the event to this request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is stopping
            self.ticket.cancel()

    async def watch(self, request: Request) -> None:
        """Poll the connection; when it closes, cancel the rows (queued ones never start) and stop waiting."""
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        self.ticket.cancel()
        self.events.put_nowait(None)

    async def first_event(self, request: Request) -> Event | None:
        """The first event of a streamed request, waited for while watching the connection; an error
        before any token (the deadline passed in the queue) is raised as the request's own status."""
        watcher = asyncio.create_task(self.watch(request))
        try:
            event = await self.events.get()
        finally:
            watcher.cancel()
        if event is not None and event.error is not None:
            self.ticket.cancel()
            raise failure(event, self.constraint)
        return event

    async def events_until_done(self, first: Event | None = None) -> AsyncIterator[Event]:
        """Every event of every choice, until each has ended or the client left; cancels the rest."""
        ended = 0
        try:
            event = first if first is not None else await self.events.get()
            while event is not None:
                if event.error is not None:
                    raise failure(event, self.constraint)
                ended += event.finish_reason is not None
                yield event
                if ended == self.choices:
                    return
                event = await self.events.get()
        finally:
            self.ticket.cancel()  # a no-op for rows that ended; frees the slots of the others

    def choice(self, event: Event) -> dict[str, Any] | None:
        """One event as an OpenAI choice (a stream chunk's, or a part of a whole completion's)."""
        logprobs = None
        if event.logprob is not None:
            assert event.token is not None
            piece = self.served.tokenizer.token_bytes(event.token)
            top = {token_text(self.served.tokenizer.token_bytes(t)): finite(lp) for t, lp in event.top or []}
            logprobs = {"tokens": [token_text(piece)], "token_logprobs": [finite(event.logprob)],
                        "top_logprobs": [top], "text_offset": [self.offsets[event.index]]}
            self.offsets[event.index] += len(self.utf8[event.index].decode(piece))
        return {"text": event.text, "index": event.index, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS.get(event.finish_reason or "")}

    def whole_choice(self, index: int, text: str, logprobs: dict[str, list], reason: str | None) -> dict:
        """A choice of the whole completion, from its text, its gathered logprobs and how it ended."""
        wanted = self.body.logprobs_count() is not None
        return {"text": text, "index": index, "logprobs": logprobs if wanted else None,
                "finish_reason": reason}

    def empty_logprobs(self) -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks a stream starts with before any token (none here; chat's name the role)."""
        return []

    def envelope(self, choices: list[dict[str, Any]], completion_tokens: int | None = None,
                 streamed: bool = False) -> dict[str, Any]:
        reply: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                 "model": self.served.name, "choices": choices}
        if completion_tokens is not None:
            reply["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": self.prompt_tokens + completion_tokens}
        return reply

    async def stream(self, first: Event) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token, a last chunk per choice, usage if asked, then [DONE].

        As OpenAI: with include_usage every chunk carries "usage": null and a last one, with no choices,
        the usage; without it no chunk mentions usage."""
        completion_tokens = 0
        ready = [sse({**chunk, "usage": None} if self.usage else chunk) for chunk in self.opening()]
        try:
            async for event in self.events_until_done(first):
                completion_tokens += event.completion_tokens
                part = self.choice(event)
                if part is not None:
                    chunk = self.envelope([part], streamed=True)
                    ready.append(sse({**chunk, "usage": None} if self.usage else chunk))
                if self.events.empty():  # one write for the chunks that arrived together
                    yield "".join(ready)
                    ready = []
        except APIError as err:  # the status is sent already: report in the stream, as OpenAI does
            yield sse(err.body())
            return
        usage = sse(self.envelope([], completion_tokens, streamed=True)) if self.usage else ""
        yield "".join(ready) + usage + "data: [DONE]\n\n"

    async def collect(self, request: Request) -> dict[str, Any]:
        """The whole completion; a client that disconnects first cancels its rows."""
        watcher = asyncio.create_task(self.watch(request))
        texts, logprobs = [""] * self.choices, [self.empty_logprobs() for _ in range(self.choices)]
        if self.echoes is not None:  # the prompt first, and its tokens' logprobs
            n = self.body.n
            texts = [self.prompts[i // n] for i in range(self.choices)]
            logprobs = [{k: list(v) for k, v in self.echoes[i // n].items()} for i in range(self.choices)]
        reasons: list[str | None] = [None] * self.choices
        completion_tokens = 0
        try:
            async for event in self.events_until_done():
                completion_tokens += event.completion_tokens
                part = self.choice(event)
                if part is None:
                    continue
                texts[event.index] += event.text
                reasons[event.index] = part["finish_reason"] or reasons[event.index]
                for key, values in (part["logprobs"] or {}).items():
                    logprobs[event.index][key] += values
        finally:
            watcher.cancel()
        choices = [self.whole_choice(i, texts[i], logprobs[i], reasons[i]) for i in range(self.choices)]
        return self.envelope(choices, completion_tokens)


def failure(event: Event, constraint: str | None = None) -> APIError:
    """The error event of a choice as the request's refusal: a 400 naming the request's `constraint` field
    when the grammar engine gave up on its grammar, else a 503 (with Retry-After) unless it says."""
    status = event.status
    if status == 400 and constraint is not None:
        return APIError(400, f"{constraint}: {event.error}", constraint, "invalid_grammar")
    return APIError(status, event.error or "decoding failed", None, "decoding_failed", "server_error",
                    retry_after=BUSY_RETRY if status == 503 else None)


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a token of probability 0 gets the most negative float instead."""
    return logprob if math.isfinite(logprob) else -3.4e38


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
