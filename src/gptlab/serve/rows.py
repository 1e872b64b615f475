"""The rows the decode thread runs (`batching.Scheduler`) and what passes between it and the requests: a
row's settings and state (`Row`), a request's handle to cancel its rows (`Ticket`), the events each row
reports (`Event`), the tokens its text is cut from (`Feed`), the queue's refusal (`QueueFull`), and the
observer that metrics replace (`Observer`, `serve.prometheus`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from gptlab.config import SamplingConfig
from gptlab.generate import Chunk
from gptlab.structured.grammar import Matcher


class QueueFull(Exception):
    """`Scheduler.submit` refused rows: the waiting queue is full. Try again in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Event:
    """What the decode thread reports for one choice: a token and the text it released, or the end.

    `top` holds the `logprobs` most likely tokens and their log-probabilities under the model's raw
    distribution (softmax of the logits, before temperature, top-k and top-p), as OpenAI reports them.
    The last event of a choice has `finish_reason` ("eot", "stop", "length", "deadline") or `error`
    set; `status` is the HTTP status that error deserves.
    """

    index: int
    text: str
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None
    status: int = 503


class Feed:
    """The tokens of one row, handed to `text_chunks` one at a time; empty means the row is over."""

    def __init__(self) -> None:
        self.tokens: deque[int] = deque()

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if not self.tokens:
            raise StopIteration
        return self.tokens.popleft()


@dataclass(eq=False)
class Row:
    """One choice being decoded: its window of token ids, its sampler and where its events go.

    `deadline` is a `time.monotonic()` instant: a row still waiting then never starts (an error
    event, status 503), a running one ends with finish_reason "deadline", keeping its tokens.
    """

    index: int
    ids: list[int]
    sampling: SamplingConfig
    generator: torch.Generator | None
    logprobs: int | None
    emit: Callable[[Event], None]
    ticket: Ticket
    deadline: float | None = None
    start: int = 0  # the first token of the window (moved only by learned positions)
    generated: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # tokens not yet in the cache
    logits: torch.Tensor | None = None  # (1 + d, V) for the next token and after each drafted one
    feed: Feed = field(default_factory=Feed)
    chunks: Iterator[Chunk] | None = None
    slot: int = -1  # its row of the cache
    need: int = 0  # the cache slots it can ever use
    order: int = 0  # admission order: prompts are prefilled oldest first
    clock: float = field(default_factory=time.monotonic)  # when it was queued, then when it last sampled
    matcher: Matcher | None = None  # structured output: the row's place in its grammar
    speculative: bool = False  # whether it drafts tokens (on a server that speculates)
    draft: list[int] = field(default_factory=list)  # tokens its logits verify (in the cache until sampled)
    masks: list[torch.Tensor] = field(default_factory=list)  # what its grammar allows at each (d + 1)


class Ticket:
    """A request's handle on its rows: `cancel()` frees their slots at the next step."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class Observer:
    """What the decode thread reports as it goes, to metrics (`serve.prometheus`), on the decode thread;
    this one ignores it."""

    def admitted(self, row: Row) -> None:
        """`row` left the queue: its prompt is prefilled next (or it ends at once, asking for no tokens)."""

    def sampled(self, row: Row, seconds: float) -> None:
        """`row` sampled a token `seconds` after its previous one (after it was queued, for its first)."""

    def looked_up(self, row: Row, reused: int) -> None:
        """`row`'s prompt was looked up in the prefix cache, which held its first `reused` tokens."""

    def speculated(self, row: Row, drafted: int, accepted: int) -> None:
        """`row` verified `drafted` drafted tokens and kept `accepted` of them."""
