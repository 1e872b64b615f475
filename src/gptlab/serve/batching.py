"""Continuous batching: one decode thread, a batch of rows that requests join and leave at any step.

`generate` decodes a fixed batch: every row starts together and the batch lasts as long as its
longest row. A server cannot wait for a batch to fill or to drain, so here each row of the batch has
its own cache slot in a `SlotCache` (one ring of block_size positions per row, with its own count):
- a new row is prefilled alone into a one-row `KVCache`, exactly as `generate` prefills a prompt, and
  copied into a free slot; it samples its first token with the others at the next step;
- every step samples one token per row (each row with its own `torch.Generator`, seeded by its
  request, through `sampling.next_token` on its own (1, V) logits, so it draws what `generate` draws
  for that prompt alone), then runs the newest token of every row in one batched forward pass;
- a row that ends (end-of-text, a stop string, max_tokens) or whose client went away leaves at once:
  the last row moves into its slot, so the active rows are always the first ones of the cache.
- learned positions restart a row's window as `generate` does (`window_start`): the row's kept
  tokens but the newest are prefilled alone again, and the newest runs with the batch.

A batched step computes the same logits as a one-row step up to float rounding (~1e-6: other kernel
paths, a mask instead of none), so a row's tokens equal `generate`'s alone unless two candidates
are that close; the tests compare greedy and seeded samples with `generate` alone.

Text is cut exactly as `stream_text` cuts it: each row's tokens go through `generate.text_chunks`.

Shape legend: L layers, B rows (slots), Hkv key/value heads, S slots per row (block_size), hs head size.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from gptlab.cache import EMPTY, KVCache
from gptlab.config import ModelConfig, SamplingConfig
from gptlab.generate import Chunk, text_chunks, window_start
from gptlab.model import GPT
from gptlab.sampling import next_token
from gptlab.tokenizer import Tokenizer


class SlotCache:
    """The keys and values of up to `slots` independent rows, each a ring of block_size slots.

    It implements the part of `KVCache` that `GPT.forward` uses (`advance`, `positions`, `update`,
    `mask`) for steps of one new token per row over the first `active` rows. Each row keeps its own
    count of tokens and its own next position, so rows that joined at different steps never need
    padding; a row's queries see its keys at positions p - block_size < j <= p, as in `KVCache`.
    """

    def __init__(self, config: ModelConfig, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.window = config.block_size
        shape = (config.n_layer, slots, config.kv_heads, self.window, config.head_size)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hs)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, Hkv, S, hs)
        self.slot_positions = torch.full((slots, self.window), EMPTY, device=device)  # (B, S)
        self.fed = [0] * slots  # tokens held by each row since it was loaded
        self.next_position = [0] * slots
        self.active = 0  # rows 0 .. active - 1 take part in a step
        self.positions = torch.zeros(0, 1, dtype=torch.long, device=device)  # of the new tokens, (B, 1)
        self.mask: torch.Tensor | None = None  # (B, 1, 1, S)
        self._write = self.positions[:, 0]  # the slot each row's new key goes to, (B,)
        self._used = 0  # slots of the longest row

    def load(self, row: int, cache: KVCache) -> None:
        """Make `row` hold what a one-row KVCache holds after one prefill (which never wraps)."""
        n = cache.fed
        self.keys[:, row, :, :n] = cache.keys[:, 0, :, :n]
        self.values[:, row, :, :n] = cache.values[:, 0, :, :n]
        self.slot_positions[row].fill_(EMPTY)
        self.slot_positions[row, :n] = cache.slot_positions[0, :n]
        self.fed[row] = n
        self.next_position[row] = int(cache.positions[0, -1]) + 1 if n else 0

    def move(self, source: int, target: int) -> None:
        """Copy row `source` into row `target` (the last active row fills a freed slot)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]
        self.slot_positions[target] = self.slot_positions[source]
        self.fed[target], self.next_position[target] = self.fed[source], self.next_position[source]

    def advance(self, n_new: int) -> torch.Tensor:
        """Take one new token per active row: their positions (B, 1) and their mask in `self.mask`."""
        assert n_new == 1, "a SlotCache step takes one token per row; prefill rows with a KVCache"
        rows, device = self.active, self.slot_positions.device
        fed = self.fed[:rows]
        self._write = torch.tensor([f % self.window for f in fed], device=device)  # (B,)
        self.positions = torch.tensor(self.next_position[:rows], device=device)[:, None]  # (B, 1)
        self.slot_positions[torch.arange(rows, device=device), self._write] = self.positions[:, 0]
        for row in range(rows):
            self.fed[row] += 1
            self.next_position[row] += 1
        self._used = min(max(fed) + 1, self.window)
        keys_at = self.slot_positions[:rows, None, :self._used]  # (B, 1, S)
        queries_at = self.positions[:, :, None]  # (B, 1, 1)
        visible = (keys_at <= queries_at) & (keys_at > queries_at - self.window)  # (B, 1, S)
        self.mask = visible.unsqueeze(1)  # (B, 1, 1, S): the same for every head
        return self.positions

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values (B, Hkv, 1, hs); return the held ones (B, Hkv, S, hs)."""
        rows = self.active
        held_keys, held_values = self.keys[layer, :rows], self.values[layer, :rows]  # (B, Hkv, S, hs)
        index = torch.arange(rows, device=keys.device)
        held_keys[index, :, self._write] = keys[:, :, 0]  # (B, Hkv, hs) into each row's own slot
        held_values[index, :, self._write] = values[:, :, 0]
        return held_keys[:, :, :self._used], held_values[:, :, :self._used]


@dataclass(frozen=True)
class Event:
    """What the decode thread reports for one choice: a token and the text it released, or the end.

    `top` holds the `logprobs` most likely tokens and their log-probabilities under the model's raw
    distribution (softmax of the logits, before temperature, top-k and top-p), as OpenAI reports them.
    The last event of a choice has `finish_reason` ("eot", "stop", "length") or `error` set.
    """

    index: int
    text: str
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None


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
    """One choice being decoded: its window of token ids, its sampler and where its events go."""

    index: int
    ids: list[int]
    sampling: SamplingConfig
    generator: torch.Generator | None
    logprobs: int | None
    emit: Callable[[Event], None]
    ticket: Ticket
    start: int = 0  # the first token of the window (moved only by learned positions)
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (1, V) for the next token
    feed: Feed = field(default_factory=Feed)
    chunks: Iterator[Chunk] | None = None
    slot: int = -1


class Ticket:
    """A request's handle on its rows: `cancel()` frees their slots at the next step."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """The decode thread: owns the model and a SlotCache of `max_batch` rows; requests join at any step.

    `submit` queues rows and returns at once; events arrive through each row's `emit` callback, called
    on the decode thread. `call` runs a function on the decode thread between steps (work that must
    not overlap decoding, such as recording attention with hooks on the same model).
    """

    def __init__(self, model: GPT, tokenizer: Tokenizer, max_batch: int = 64) -> None:
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, model.config
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.max_batch = max_batch
        self.cache = SlotCache(self.config, max_batch, self.device, self.dtype)
        self.prefill_cache = KVCache(self.config, 1, self.config.block_size, self.device, self.dtype)
        self.rows: list[Row] = []  # the active rows, row i in slot i
        self.waiting: deque[Row] = deque()
        self.calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.steps = 0  # batched steps run, for tests and benchmarks
        self.largest_batch = 0
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gptlab-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after the current step; rows still running get an error event."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)
        for row in [*self.rows, *self.waiting]:
            row.emit(Event(row.index, "", error="the server is shutting down"))

    def submit(self, rows: list[Row]) -> None:
        """Queue rows; they join the batch at the next step with free slots."""
        with self._wake:
            self.waiting.extend(rows)
            self._wake.notify()

    def call(self, func: Callable[[], Any]) -> Future:
        """Run `func` on the decode thread between two steps; its result or exception goes to the Future."""
        future: Future = Future()
        with self._wake:
            self.calls.append((func, future))
            self._wake.notify()
        return future

    @property
    def active(self) -> int:
        """How many rows hold a slot now."""
        return len(self.rows)

    def _run(self) -> None:
        with torch.inference_mode():  # as generate's Decoder: logits never enter autograd
            while True:
                with self._wake:
                    while not (self._stopping or self.rows or self.waiting or self.calls):
                        self._wake.wait()
                    if self._stopping:
                        return
                    calls, self.calls = list(self.calls), deque()
                for func, future in calls:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(func())
                        except Exception as err:  # the caller reports it; the thread lives on
                            future.set_exception(err)
                try:
                    self._iteration()
                except Exception as err:  # a fault fails the rows in flight, never the server
                    for row in self.rows:
                        row.emit(Event(row.index, "", error=f"decoding failed: {err!r}"))
                    self.rows = []

    def _iteration(self) -> None:
        """Admit waiting rows, sample one token per row, drop finished rows, run the batched step."""
        self._admit()
        done = [row for row in self.rows if row.ticket.cancelled.is_set() or self._sample(row)]
        for row in done:
            self._remove(row)
        if not self.rows:
            return
        for row in self.rows:
            start = window_start(self.config, row.start, len(row.ids))
            if start != row.start:  # learned positions: the window restarts (generate.window_start)
                row.start = start
                self._prefill(row.slot, row.ids[start:-1])
        self.cache.active = len(self.rows)
        newest = torch.tensor([[row.ids[-1]] for row in self.rows], device=self.device)  # (B, 1)
        logits = self.model(newest, cache=self.cache, last_only=True)[0][:, -1]  # (B, V)
        for row in self.rows:
            row.logits = logits[row.slot:row.slot + 1]
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(self.rows))

    def _admit(self) -> None:
        """Move waiting rows into free slots, prefilling each alone as `generate` prefills a prompt."""
        while len(self.rows) < self.max_batch:
            with self._wake:
                if not self.waiting:
                    return
                row = self.waiting.popleft()
            if row.ticket.cancelled.is_set():
                continue
            row.chunks = text_chunks(row.feed, self.tokenizer, row.sampling.stop)
            if row.sampling.max_new_tokens == 0:
                self._finish(row, next(row.chunks))
                continue
            row.slot = len(self.rows)
            self.rows.append(row)
            row.logits = self._prefill(row.slot, row.ids)

    def _prefill(self, slot: int, ids: list[int]) -> torch.Tensor | None:
        """Run `ids` alone into a one-row KVCache, copy it into `slot`; the logits after the last id."""
        cache = self.prefill_cache
        cache.reset(torch.zeros(1, dtype=torch.long, device=self.device))
        logits = None
        if ids:  # empty only when a learned window of one token restarts: the newest runs with the batch
            idx = torch.tensor([ids], device=self.device)  # (1, T)
            logits = self.model(idx, cache=cache, last_only=True)[0][:, -1]  # (1, V)
        self.cache.load(slot, cache)
        return logits

    def _sample(self, row: Row) -> bool:
        """Choose the row's next token, report it; whether the row is over."""
        assert row.logits is not None and row.chunks is not None
        token = int(next_token(row.logits, row.sampling, row.generator))
        row.generated.append(token)
        row.ids.append(token)
        row.feed.tokens.append(token)
        chunk = next(row.chunks)
        eot = token == self.tokenizer.eot_id
        if not eot:
            row.emit(Event(row.index, chunk.text, token, *self._logprobs(row, token)))
        # text_chunks answers a stopping token with an empty chunk; its next chunk is then the last one.
        stopped = eot or (chunk.text == "" and self._stop_found(row))
        if stopped or len(row.generated) == row.sampling.max_new_tokens:
            self._finish(row, next(row.chunks))  # with nothing left to feed, "length" unless stopped
            return True
        return False

    def _stop_found(self, row: Row) -> bool:
        """Whether a stop string has appeared in the row's text (the test text_chunks applies)."""
        text = self.tokenizer.decode(row.generated)
        return any(s in text for s in row.sampling.stop)

    def _logprobs(self, row: Row, token: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        """The chosen token's log-probability and the `row.logprobs` likeliest, under the raw model."""
        if row.logprobs is None:
            return None, None
        logp = row.logits.float().log_softmax(dim=-1)[0]  # (V,)
        top = logp.topk(min(row.logprobs, logp.numel()))
        return float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    def _finish(self, row: Row, last: Chunk) -> None:
        row.emit(Event(row.index, last.text, finish_reason=last.stop_reason,
                       completion_tokens=len(row.generated)))

    def _remove(self, row: Row) -> None:
        """Free the row's slot: the last active row moves into it."""
        last = self.rows.pop()
        if last is not row:
            self.cache.move(last.slot, row.slot)
            last.slot = row.slot
            self.rows[row.slot] = last  # its logits are its own tensor, so they move with it
