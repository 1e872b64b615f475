"""`GET /metrics`: what the server has done and holds, in Prometheus' text format (prometheus-client).

Each app counts in a registry of its own, never prometheus-client's global one, so that several apps in
one process (the tests do this) keep apart. Three sources fill it:
- `RequestCounter`, an ASGI middleware outside the others, counts every response by its route's
  template (`/v1/models/{model_id}`, never the path a client sent, which would let clients add labels
  without end) and status, refusals included (400, 401, 404, 405, 421, 429);
- the decode thread reports each row it takes from the queue, each token it samples, each prompt it
  looks up in the prefix cache and each draft it verifies (`rows.Observer`): prompt and generated
  tokens, time to first token and between tokens, prefix cache queries and hits, drafted and accepted
  tokens;
- running and waiting rows and the bytes of the KV cache and the prefix cache are read from the
  scheduler when scraped, which costs the decode thread nothing.
Names follow Prometheus' conventions (seconds and bytes, `_total` on counters); docs/serve.md maps each
to vLLM's and llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.routing import BaseRoute, Match, Route

from gptlab.serve.batching import Scheduler
from gptlab.serve.guard import ASGIApp, Message, Receive, Scope, Send
from gptlab.serve.rows import Observer, Row

if TYPE_CHECKING:
    from fastapi import FastAPI

# Seconds, at a CPU's pace: the demo model's benchmark (docs/serve.md) gives a first token after 10 ms
# (1 client) to 250 ms (64), a token every 2 to 25 ms; a 135M model is about ten times slower, and a
# request behind a long queue waits tens of seconds.
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics(Observer):
    """One app's metrics; the scheduler reports to it as its `observer`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        into = self.registry
        self.requests = Counter("gptlab_requests", "HTTP responses by route template and status",
                                ["endpoint", "status"], registry=into)
        self.prompt_tokens = Counter("gptlab_prompt_tokens", "Prompt tokens of the rows taken from the "
                                     "queue (usage's prompt_tokens, once per choice)", registry=into)
        self.generation_tokens = Counter("gptlab_generation_tokens", "Tokens sampled, end tokens included "
                                         "(usage's completion_tokens)", registry=into)
        self.first_token = Histogram("gptlab_time_to_first_token_seconds", "Seconds from a row's queueing "
                                     "to its first token", registry=into, buckets=FIRST_TOKEN_BUCKETS)
        self.inter_token = Histogram("gptlab_inter_token_latency_seconds", "Seconds between a row's "
                                     "consecutive tokens", registry=into, buckets=TOKEN_BUCKETS)
        Gauge("gptlab_rows_running", "Rows holding a slot of the batch (prefilling or decoding)",
              registry=into).set_function(lambda: scheduler.active)
        Gauge("gptlab_rows_waiting", "Rows queued for a free slot", registry=into).set_function(
            lambda: len(scheduler.waiting))
        Gauge("gptlab_kv_cache_bytes", "Bytes the KV cache holds (it grows and shrinks with the rows)",
              registry=into).set_function(lambda: cache_bytes(scheduler))
        self.prefix_queries = Counter("gptlab_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", registry=into)
        self.prefix_hits = Counter("gptlab_prefix_cache_hits", "Prompt tokens found in the prefix cache, "
                                   "whose prefill was skipped", registry=into)
        Gauge("gptlab_prefix_cache_bytes", "Bytes the prefix cache holds (within its budget)",
              registry=into).set_function(lambda: scheduler.prefix.bytes)
        self.drafted = Counter("gptlab_speculative_draft_tokens", "Tokens drafted by prompt lookup and "
                               "verified", registry=into)
        self.accepted = Counter("gptlab_speculative_accepted_tokens", "Drafted tokens the model accepted",
                                registry=into)

    def admitted(self, row: Row) -> None:
        self.prompt_tokens.inc(len(row.ids))

    def sampled(self, row: Row, seconds: float) -> None:
        self.generation_tokens.inc()
        (self.first_token if len(row.generated) == 1 else self.inter_token).observe(seconds)

    def looked_up(self, row: Row, reused: int) -> None:
        self.prefix_queries.inc(len(row.ids))
        self.prefix_hits.inc(reused)

    def speculated(self, row: Row, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The metrics and their content type, in the format the Accept header asks for (Prometheus'
        text format unless it asks for OpenMetrics)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


def cache_bytes(scheduler: Scheduler) -> int:
    cache = scheduler.cache  # read once: the decode thread may put a resized one in its place
    return cache.keys.nbytes + cache.values.nbytes


def instrument(app: FastAPI, scheduler: Scheduler, routes: Sequence[BaseRoute]) -> Metrics:
    """Metrics for an app and its scheduler, responses labelled by the templates of `routes`: call it
    after adding the other middleware, so that its counter is the outermost and sees their refusals."""
    metrics = Metrics(scheduler)
    scheduler.observer = metrics
    app.add_middleware(RequestCounter, requests=metrics.requests,
                       routes=[route for route in routes if isinstance(route, Route)])
    return metrics


class RequestCounter:
    """ASGI middleware: counts each response by its route's template and its status."""

    def __init__(self, app: ASGIApp, requests: Counter, routes: Sequence[Route]) -> None:
        self.app, self.requests, self.routes = app, requests, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        endpoint = self.template(scope)  # matched here, so that refusals before routing (421) have one too

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)

    def template(self, scope: Scope) -> str:
        """The path template of the route a request is for, else of one that takes another method (a
        405), else "unmatched"."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path
            if match is Match.PARTIAL and partial is None:
                partial = route.path
        return partial or "unmatched"
