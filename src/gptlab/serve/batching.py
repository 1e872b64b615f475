"""Continuous batching: one decode thread, a batch of rows that requests join and leave at any step.

`generate` decodes a fixed batch: every row starts together and the batch lasts as long as its
longest row. A server cannot wait for a batch to fill or to drain, so here each row of one `KVCache`
keeps its own count of tokens and its own positions, and each iteration of the decode thread
- ends rows past their deadline and drops waiting rows whose client left or whose deadline passed;
- admits waiting rows into free rows of the cache (`admitted` counts them);
- samples one token per row that has logits (each row with its own `torch.Generator`, seeded by its
  request, through `sampling.next_token` on its own (1, V) logits, so it draws what `generate` draws
  for that prompt alone) and ends rows at a stop id, a stop string or max_tokens; a row with a grammar
  (structured output) chooses only among the tokens its matcher allows and ends when the grammar does
  (`structured.generation.choose`), so constrained and free rows share one batched step; a row whose
  grammar the engine gives up on ends with an error event naming the engine's reason (status 400: the
  request's grammar is at fault), logged;
- prefills at most `prefill_chunk` prompt tokens (chunked prefill: a 4k-token prompt takes several
  iterations, and the other rows decode a token in each of them instead of waiting for it);
- runs the newest token of every row in one batched forward pass. A row joins that step once all of
  its prompt but the last token is in the cache; a row still prefilling runs a stand-in token there
  that the cache forgets again (`KVCache.rewind`), so the rows in use are always the first ones and
  need no reordering. A row that leaves gets the last row moved into its place.
- with speculative decoding (`speculation`, rows whose request did not turn it off), a row that drafts
  tokens by prompt lookup runs its newest token and the draft in a pass of its own (a stand-in in the
  batched step), and its next sampling keeps the accepted ones and the model's own token
  (`serve.speculation`); the cache forgets the rest. Rows without a draft decode as before, in the
  same steps; a lone row that drafts needs no batched pass at all.
- with a prefix cache (`prefix_cache_bytes`), a row that leaves hands its tokens' keys and values to it,
  and a row that joins starts from the longest prefix of its prompt kept there (`serve.prefix_cache`).
- learned positions restart a row's window as `generate` does (`window_start`): the row's kept
  tokens are prefilled again, in chunks like a prompt.

Memory follows need: a row needs min(block_size, max_context, prompt + max_tokens) slots (draft_tokens
more for a row that slides past the window while speculating: `max_slots`), and the cache is resized
(rows to a power of two, slots to a multiple of SLOT_STEP) when a row joins that it cannot hold,
shrunk when it is four times what the rows need, and freed when the server is idle.

A batched step computes the same logits as a one-row step up to float rounding (~1e-6: other kernel
paths, a mask instead of none, a prompt run in chunks), so a row's tokens equal `generate`'s alone
unless two candidates are that close; the tests compare greedy and seeded samples with `generate`.
Ids a padded model vocabulary has beyond the tokenizer's are never sampled nor listed.

Text is cut exactly as `stream_text` cuts it: each row's tokens go through `generate.text_chunks`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from gptlab.generate import Chunk, text_chunks, window_start
from gptlab.kv_cache import KVCache
from gptlab.model import GPT
from gptlab.sampling import next_token, within_vocabulary
from gptlab.serve.prefix_cache import PrefixCache
from gptlab.serve.rows import Event, Feed, Observer, QueueFull, Row, Ticket
from gptlab.serve.speculation import draft_for, verified
from gptlab.speculative import SpeculationConfig, SpeculationStats
from gptlab.structured.generation import choose, settled
from gptlab.text.tokenizer import Tokenizer

# The rows' types live in `serve.rows`; they are named here too, where callers have always found them.
__all__ = ["SLOT_STEP", "Event", "Feed", "Observer", "QueueFull", "Row", "Scheduler", "Ticket"]

SLOT_STEP = 64  # the cache's slots per row grow in steps of this many
log = logging.getLogger("gptlab.serve")


class Scheduler:
    """The decode thread: owns the model and one KVCache sized to its rows; requests join at any step.

    `submit` queues rows and returns at once (or raises QueueFull); events arrive through each row's
    `emit` callback, called on the decode thread. `call` runs a function on the decode thread between
    steps (work that must not overlap decoding, such as recording attention with hooks on the model).
    `max_context` (default and at most block_size) caps a row's tokens, prompt and generated: below
    block_size a row ends ("length") when it holds that many; at block_size it slides as generate does.
    `speculation`: prompt lookup for the rows that ask for it; `prefix_cache_bytes`: the prefix cache's
    budget (0: none).
    """

    def __init__(self, model: GPT, tokenizer: Tokenizer, max_batch: int = 64, *,
                 max_context: int | None = None, max_waiting: int = 256, prefill_chunk: int = 256,
                 speculation: SpeculationConfig | None = None, prefix_cache_bytes: int = 0) -> None:
        for name, value in (("max_batch", max_batch), ("max_context", max_context or 1),
                            ("prefill_chunk", prefill_chunk)):
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} must be at least 0")
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, model.config
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.max_batch, self.max_waiting, self.prefill_chunk = max_batch, max_waiting, prefill_chunk
        self.max_context = min(max_context or self.config.block_size, self.config.block_size)
        self.speculation, self.speculation_stats = speculation, SpeculationStats()
        # A row that slides past the window holds a ring of max_context slots, and draft_tokens more when
        # speculating: a verified chunk then only overwrites keys out of every later query's window.
        self.slides = self.max_context == self.config.block_size and self.config.positions != "learned"
        self.max_slots = self.max_context + (speculation.draft_tokens if speculation and self.slides else 0)
        self.cache = KVCache(self.config, 0, self._slots(0), self.device, self.dtype)  # grows with the rows
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.rows: list[Row] = []  # the active rows, row i in slot i
        self.waiting: deque[Row] = deque()
        self.calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.admitted = 0  # rows that got a slot
        self.steps = 0  # batched steps run, for tests and benchmarks
        self.largest_batch = 0
        self.observer = Observer()  # metrics replace it before the thread starts
        self.step_seconds = 0.05  # a running average of one iteration's time, for QueueFull's estimate
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gptlab-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after the current step; rows still running or waiting get an error event."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)
        for row in [*self.rows, *self.waiting]:
            row.emit(Event(row.index, "", error="the server is shutting down"))

    def submit(self, rows: list[Row]) -> None:
        """Queue rows; they join the batch at the next step with free slots. All or none: QueueFull
        when the queue would hold more than max_waiting rows."""
        with self._wake:
            if len(self.waiting) + len(rows) > self.max_waiting:
                raise QueueFull(f"the server's queue is full ({len(self.waiting)} of {self.max_waiting} "
                                "rows waiting): try again later", self._retry_after())
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

    def _retry_after(self) -> float:
        """Seconds until a slot is likely free: the running row nearest its max_tokens, at today's pace,
        times the batches of waiting rows ahead."""
        left = min((r.sampling.max_new_tokens - len(r.generated) for r in self.rows), default=1)
        rounds = 1 + len(self.waiting) // self.max_batch
        return max(1.0, round(left * self.step_seconds * rounds, 1))

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
                began = time.monotonic()
                try:
                    self.iterate()
                except Exception as err:  # a fault fails the rows in flight, never the server
                    for row in self.rows:
                        row.emit(Event(row.index, "", error=f"decoding failed: {err!r}"))
                    self.rows = []
                    self.cache = KVCache(self.config, 0, self._slots(0), self.device, self.dtype)
                self.step_seconds = 0.9 * self.step_seconds + 0.1 * (time.monotonic() - began)

    @torch.inference_mode()
    def iterate(self) -> None:
        """One iteration of the decode thread (see the module docstring); tests call it directly."""
        now = time.monotonic()
        self._drop_waiting(now)
        self._admit()
        for row in list(self.rows):
            if row.ticket.cancelled.is_set():
                self._remove(row)
            elif row.deadline is not None and now >= row.deadline:
                assert row.chunks is not None, "_admit gives every row its chunks"
                self._finish(row, next(row.chunks), "deadline")
                self._remove(row)
            elif row.logits is not None and self._sample(row):
                self._remove(row)
        for row in self.rows:
            start = window_start(self.config, row.start, len(row.ids))
            if start != row.start:  # learned positions: the window restarts (generate.window_start)
                row.start, row.pending, row.logits = start, row.ids[start:], None
                self.cache.clear(row.slot)
        self._fit()
        if self.rows:
            self._prefill()
            self._decode()

    def _drop_waiting(self, now: float) -> None:
        """Forget waiting rows whose client left; fail those whose deadline passed (they never start)."""
        with self._wake:
            waiting, self.waiting = self.waiting, deque()
            for row in waiting:
                if row.ticket.cancelled.is_set():
                    continue
                if row.deadline is not None and now >= row.deadline:
                    row.emit(Event(row.index, "", error="the request's deadline passed while it waited for "
                                   "a free slot: try again later", status=503))
                    continue
                self.waiting.append(row)

    def _admit(self) -> None:
        """Move waiting rows into free rows of the cache; their prompts are prefilled by `_prefill`."""
        while len(self.rows) < self.max_batch:
            with self._wake:
                if not self.waiting:
                    return
                row = self.waiting.popleft()
            if row.ticket.cancelled.is_set():
                continue
            self.observer.admitted(row)
            row.chunks = text_chunks(row.feed, self.tokenizer, row.sampling.stop)
            if row.sampling.max_new_tokens == 0:
                self._finish(row, next(row.chunks))
                continue
            row.ids = row.ids[-self.max_context:]
            row.pending, row.logits, row.order = list(row.ids), None, next(self._order)
            row.need = min(self.max_slots, len(row.ids) + row.sampling.max_new_tokens)
            row.slot = len(self.rows)
            self.rows.append(row)
            self.admitted += 1
            self._fit()
            self.cache.clear(row.slot)
            if self.prefix.budget:
                reused = self.prefix.reuse(row.ids, self.cache, row.slot)
                row.pending = row.ids[reused:]
                self.observer.looked_up(row, reused)

    def _fit(self) -> None:
        """Size the cache to the rows: grow to hold them, shrink when it is four times what they need,
        free it when there are none (a resize copies what the rows hold)."""
        rows = 1 << max(len(self.rows) - 1, 0).bit_length() if self.rows else 0  # a power of two
        rows = min(rows, self.max_batch)
        slots = self._slots(max((row.need for row in self.rows), default=0))
        size, capacity = self.cache.size, self.cache.capacity
        if rows > size or slots > capacity:
            self.cache.resize(max(rows, size), max(slots, capacity))
        elif rows * slots * 4 <= size * capacity and (rows, slots) != (size, capacity):
            self.cache.resize(rows, slots)

    def _slots(self, need: int) -> int:
        """Slots per row for rows that need at most `need`: a multiple of SLOT_STEP, at most max_slots
        (so that only a row that slides past max_context = block_size ever wraps its ring)."""
        return min(max(-(-need // SLOT_STEP), 1) * SLOT_STEP, self.max_slots)

    def _prefill(self) -> None:
        """Feed at most prefill_chunk prompt tokens, oldest prompts first, all but each prompt's last
        (that one runs with the batched step, which gives the row its first logits)."""
        budget = self.prefill_chunk
        for row in sorted((r for r in self.rows if len(r.pending) > 1), key=lambda r: r.order):
            n = min(budget, len(row.pending) - 1)
            self.cache.select(row.slot, row.slot + 1)
            self.model(torch.tensor([row.pending[:n]], device=self.device), cache=self.cache, last_only=True)
            del row.pending[:n]
            budget -= n
            if budget == 0:
                break

    def _decode(self) -> None:
        """The batched step: each row's newest token (a stand-in for rows still prefilling or drafting), one
        pass; then each row with a draft runs its newest token and the draft in a pass of its own."""
        ready = [len(row.pending) == 1 for row in self.rows]
        if not any(ready):
            return
        drafting = [go and self._draft(row) for row, go in zip(self.rows, ready, strict=True)]
        plain = [go and not drafts for go, drafts in zip(ready, drafting, strict=True)]
        if any(plain):
            # Rows join at the end, so prompts still prefilling are mostly after the last ready row.
            rows = self.rows[:max(i for i, go in enumerate(plain) if go) + 1]
            # A stand-in's key goes to the slot the row's next chunk (prompt or draft) overwrites; rewind
            # forgets it.
            newest = [row.pending[0] if go else 0 for row, go in zip(rows, plain, strict=False)]
            self.cache.select(0, len(rows))
            logits = self.model(torch.tensor(newest, device=self.device)[:, None], cache=self.cache,
                                last_only=True)[0][:, -1]  # (B, V)
            logits = within_vocabulary(logits, self.tokenizer.vocab_size)
            for row, go in zip(rows, plain, strict=False):
                if go:
                    row.pending, row.logits = [], logits[row.slot:row.slot + 1]  # (1, V)
                else:
                    self.cache.rewind(row.slot)
        for row, drafts in zip(self.rows, drafting, strict=True):
            if drafts:  # the newest token and the draft, through the cache: logits after each
                self.cache.select(row.slot, row.slot + 1)
                chunk = torch.tensor([row.pending + row.draft], device=self.device)  # (1, 1 + d)
                row.logits = within_vocabulary(self.model(chunk, cache=self.cache)[0][0],
                                               self.tokenizer.vocab_size)  # (1 + d, V)
                row.pending = []
        self.steps += 1
        self.largest_batch = max(self.largest_batch, sum(ready))

    def _draft(self, row: Row) -> bool:
        """Draft tokens by prompt lookup for a ready row that speculates (`row.draft`, with `row.masks` under
        a grammar); whether it has any. The newest token and the draft never cross the ring's end, and the
        draft and the model's token after it fit in max_tokens and, for a row that cannot slide (learned
        positions, or a max_context below the window), in max_context: such a row ends at its last
        verified token."""
        if self.speculation is None or not row.speculative:
            return False
        capacity, fed = self.cache.capacity, self.cache.fed[row.slot]
        room = min(capacity - fed % capacity - 1, row.sampling.max_new_tokens - len(row.generated) - 1)
        if not self.slides:  # the row ends at max_context, or restarts its window (learned positions)
            room = min(room, self.max_context - (len(row.ids) - row.start) - 1)
        row.draft, row.masks = draft_for(row.ids, room, self.speculation, row.matcher)
        return bool(row.draft)

    def _sample(self, row: Row) -> bool:
        """Choose the row's next token (after a verified draft, tokens) and report each; whether the row
        is over."""
        assert row.logits is not None and row.chunks is not None
        tokens = self._choose(row)
        logits, draft, row.logits, row.draft, row.masks = row.logits, row.draft, None, [], []
        if tokens is None:  # the row's grammar ends it here: complete, unable to go on, or given up on
            assert row.matcher is not None
            problem = row.matcher.gave_up(len(row.generated))
            if problem is not None:
                log.warning("structured output refused: %s", problem)
                row.emit(Event(row.index, "", error=problem, status=400,  # the request's grammar: its fault
                               completion_tokens=len(row.generated)))
            else:
                self._finish(row, next(row.chunks), "stop" if row.matcher.complete else "length")
            return True
        if draft:  # the cache keeps the newest token and the accepted drafted ones, the last token is next
            self.cache.rewind(row.slot, len(draft) + 1 - len(tokens))
            self.speculation_stats.record(len(draft), len(tokens) - 1)
            self.observer.speculated(row, len(draft), len(tokens) - 1)
        for i, token in enumerate(tokens):
            if self._take(row, token, logits[i:i + 1]):
                return True
        return False

    def _take(self, row: Row, token: int, logits: torch.Tensor) -> bool:
        """Append a chosen token to the row and report it, given the logits (1, V) it was chosen from;
        whether the row is over."""
        assert row.chunks is not None
        row.generated.append(token)
        row.ids.append(token)
        row.feed.tokens.append(token)
        now = time.monotonic()
        self.observer.sampled(row, now - row.clock)
        row.clock = now
        row.pending = [token]
        chunk = next(row.chunks)
        eot = token in self.tokenizer.stop_ids or (row.matcher is not None and token in row.matcher.end_ids)
        if not eot:
            row.emit(Event(row.index, chunk.text, token, *self._logprobs(row, logits, token)))
        # text_chunks answers a stopping token with an empty chunk; its next chunk is then the last one.
        stopped = eot or (chunk.text == "" and self._stop_found(row))
        # Below block_size, max_context is where a row ends; at block_size the window slides instead.
        full = self.max_context < self.config.block_size and len(row.ids) - row.start >= self.max_context
        if stopped or full or len(row.generated) == row.sampling.max_new_tokens:
            complete = row.matcher is not None and (row.matcher.complete or settled(row.matcher))
            # with nothing left to feed, "length" unless stopped (or the grammar is complete)
            self._finish(row, next(row.chunks), "stop" if complete else None)
            return True
        return False

    def _choose(self, row: Row) -> list[int] | None:
        """The row's next token from its logits (after a draft, the tokens its verification keeps), within
        its grammar if it has one (then None when the grammar ends the row). A token the grammar engine
        does not follow is never kept: the row ends there, incomplete."""
        assert row.logits is not None
        if row.draft:
            return verified(row.logits, row.draft, row.masks, row.matcher, row.sampling, row.generator)
        if row.matcher is None:
            return [int(next_token(row.logits, row.sampling, row.generator))]
        token = choose(row.logits, row.matcher, row.sampling, row.generator)
        return None if token is None or not row.matcher.advance(token) else [token]

    def _stop_found(self, row: Row) -> bool:
        """Whether a stop string has appeared in the row's text (the test text_chunks applies)."""
        text = self.tokenizer.decode(row.generated)
        return any(s in text for s in row.sampling.stop)

    def _logprobs(self, row: Row, logits: torch.Tensor,
                  token: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        """The chosen token's log-probability and the `row.logprobs` likeliest, under the raw model."""
        if row.logprobs is None:
            return None, None
        logp = logits.float().log_softmax(dim=-1)[0]  # (V,)
        top = logp.topk(min(row.logprobs, self.tokenizer.vocab_size, logp.numel()))
        return float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    def _finish(self, row: Row, last: Chunk, reason: str | None = None) -> None:
        row.emit(Event(row.index, last.text, finish_reason=reason or last.stop_reason,
                       completion_tokens=len(row.generated)))

    def _remove(self, row: Row) -> None:
        """Free the row's slot (its tokens' keys and values kept in the prefix cache when they sit at
        positions 0 ..): the last active row moves into it."""
        fed = self.cache.fed[row.slot]
        if self.prefix.budget and row.start == 0 and 0 < fed <= self.cache.capacity:
            # a draft after a stop token may have left more tokens in the cache than the row kept, and
            # no prompt reuses more than the window
            self.prefix.keep(row.ids[:min(fed, self.config.block_size)], self.cache, row.slot)
        last = self.rows.pop()
        if last is not row:
            self.cache.move(last.slot, row.slot)
            last.slot = row.slot
            self.rows[row.slot] = last  # its logits are its own tensor, so they move with it
        self.cache.clear(len(self.rows))
