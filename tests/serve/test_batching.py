"""The server's scheduler (gptlab.serve.batching) driven step by step, without a server: each row's
tokens and log-probabilities against `generate` alone on the naive recompute loop, chunked prefill,
the queue bound, deadlines, cancellation while waiting, a cache sized to its rows, padded vocabularies
and several stop ids."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

from conftest import TwoStops
from gptlab.config import POSITIONS, ModelConfig, SamplingConfig
from gptlab.generate import Decoder, generate
from gptlab.kv_cache import kv_cache_bytes
from gptlab.model import GPT
from gptlab.sampling import sampler
from gptlab.serve.batching import Event, QueueFull, Row, Scheduler, Ticket
from gptlab.text.tokenizer import ByteTokenizer, CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 16
CHARS = CharTokenizer.train("abcdefghijklm")  # 13 ids, as tiny_config's vocabulary


@pytest.fixture
def model(tiny_config: Callable[..., ModelConfig]) -> Callable[..., GPT]:
    """`model(**changes)`: a tiny random model whose every part moves the logits (as test_generate's)."""

    def make(**changes: object) -> GPT:
        torch.manual_seed(0)
        built = GPT(tiny_config(**{"block_size": WINDOW, **changes})).eval()
        with torch.no_grad():
            for p in built.parameters():
                p.normal_(0.0, 0.4)
        return built

    return make


class Recorder:
    """Every event of one row, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def ended(self) -> bool:
        return any(e.finish_reason or e.error for e in self.events)


def row(prompt: list[int], sampling: SamplingConfig, logprobs: int | None = None,
        deadline: float | None = None) -> tuple[Row, Recorder]:
    recorder = Recorder()
    submitted = Row(0, list(prompt), sampling, sampler(sampling), logprobs, recorder, Ticket(),
                    deadline=deadline)
    return submitted, recorder


def run_until(scheduler: Scheduler, done: Callable[[], bool], limit: int = 1000) -> None:
    for _ in range(limit):
        if done():
            return
        scheduler.iterate()
    raise AssertionError("the scheduler did not finish in time")


# --------------------------------------------------------- the one KVCache as the server uses it

@pytest.mark.slow
@pytest.mark.parametrize("positions", POSITIONS)
def test_rows_joining_at_different_steps_get_the_naive_loops_tokens_and_logprobs(
        positions: str, model: Callable[..., GPT]) -> None:
    """Grouped-query heads (n_kv_head < n_head), prompts longer than a prefill chunk, rows joining while
    others decode and running 40 tokens past a 16-token window (learned positions restart it): every
    row's tokens equal generate(use_cache=False) alone, and its log-probabilities that loop's logits."""
    gpt = model(positions=positions, n_head=4, n_kv_head=2)
    scheduler = Scheduler(gpt, CHARS, max_batch=3, prefill_chunk=4)  # three rows: a fourth waits
    cases = [([1, 2, 3], SamplingConfig(temperature=0, max_new_tokens=40)),
             ([4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1],
              SamplingConfig(temperature=1.0, seed=3, max_new_tokens=30)),
             ([7] * 14, SamplingConfig(temperature=0.8, top_k=5, seed=5, max_new_tokens=25)),
             ([2, 9], SamplingConfig(temperature=1.0, top_p=0.8, seed=7, max_new_tokens=35))]
    recorders = []
    for step, (prompt, sampling) in enumerate(cases):
        submitted, recorder = row(prompt, sampling, logprobs=CHARS.vocab_size)
        scheduler.submit([submitted])
        recorders.append(recorder)
        for _ in range(3 * step + 1):  # each row joins a batch that has been decoding a while
            scheduler.iterate()
    run_until(scheduler, lambda: all(r.ended for r in recorders))
    assert scheduler.largest_batch == 3 and scheduler.admitted == 4
    for (prompt, sampling), recorder in zip(cases, recorders, strict=True):
        alone = torch.cat(list(generate(gpt, [prompt], sampling, generator=sampler(sampling),
                                        use_cache=False)), dim=1)[0].tolist()
        assert recorder.tokens == alone
        naive = Decoder(gpt, [prompt], use_cache=False)
        for event in recorder.events[:-1]:
            expected = naive.logits()[0].log_softmax(-1)  # (V,)
            got = torch.tensor([logprob for _, logprob in sorted(event.top)])  # every id's, by id
            assert_close(got, expected, atol=1e-5, rtol=1e-5)
            naive.append(torch.tensor([[event.token]]))
        assert recorder.events[-1].finish_reason == "length"


def test_chunked_prefill_lets_running_rows_decode_between_the_chunks(model: Callable[..., GPT]) -> None:
    gpt = model(positions="rope", block_size=64)
    scheduler = Scheduler(gpt, CHARS, max_batch=4, prefill_chunk=4)
    running, seen = row([1, 2], SamplingConfig(temperature=0, max_new_tokens=60))
    scheduler.submit([running])
    run_until(scheduler, lambda: len(seen.tokens) == 3)
    prompt = [(3 * i) % 13 for i in range(30)]
    long, first = row(prompt, SamplingConfig(temperature=0, max_new_tokens=5))
    scheduler.submit([long])
    before = len(seen.tokens)
    run_until(scheduler, lambda: bool(first.tokens))
    # 29 tokens in chunks of 4 take 8 iterations, each with a batched step of the running row.
    assert len(seen.tokens) - before >= 8
    run_until(scheduler, lambda: first.ended)
    alone = torch.cat(list(generate(gpt, [prompt], long.sampling, use_cache=False)), dim=1)[0].tolist()
    assert first.tokens == alone


def test_a_full_queue_refuses_the_whole_submit(model: Callable[..., GPT]) -> None:
    scheduler = Scheduler(model(), CHARS, max_batch=1, max_waiting=2)
    sampling = SamplingConfig(temperature=0, max_new_tokens=3)
    scheduler.submit([row([1], sampling)[0], row([2], sampling)[0]])
    with pytest.raises(QueueFull) as refused:
        scheduler.submit([row([3], sampling)[0]])
    assert refused.value.retry_after > 0 and "queue is full" in str(refused.value)
    assert len(scheduler.waiting) == 2


def test_deadlines_end_running_rows_and_keep_waiting_rows_from_starting(model: Callable[..., GPT]) -> None:
    scheduler = Scheduler(model(), CHARS, max_batch=1)
    sampling = SamplingConfig(temperature=0, max_new_tokens=50)
    running, seen = row([1, 2], sampling, deadline=time.monotonic() + 3600)
    late, late_events = row([3], sampling, deadline=time.monotonic() - 1)  # waits behind the running row
    scheduler.submit([running, late])
    run_until(scheduler, lambda: len(seen.tokens) == 5)
    assert [e.status for e in late_events.events if e.error] == [503] and not late_events.tokens
    running.deadline = time.monotonic() - 1
    scheduler.iterate()
    last = seen.events[-1]
    assert last.finish_reason == "deadline" and last.completion_tokens == len(seen.tokens) == 5
    assert scheduler.admitted == 1 and scheduler.active == 0


def test_rows_cancelled_while_waiting_are_never_admitted(model: Callable[..., GPT]) -> None:
    scheduler = Scheduler(model(), CHARS, max_batch=1)
    sampling = SamplingConfig(temperature=0, max_new_tokens=4)
    first, seen = row([1], sampling)
    second, unseen = row([2], sampling)
    scheduler.submit([first, second])
    scheduler.iterate()
    second.ticket.cancel()
    run_until(scheduler, lambda: seen.ended and not scheduler.waiting)
    for _ in range(3):
        scheduler.iterate()
    assert scheduler.admitted == 1 and unseen.events == []


def test_the_cache_holds_what_the_rows_need_and_is_freed_when_idle(model: Callable[..., GPT]) -> None:
    gpt = model(positions="rope", block_size=1024, n_head=4, n_kv_head=1)
    scheduler = Scheduler(gpt, CHARS, max_batch=64)
    cache = scheduler.cache
    rows = [row([1, 2, 3], SamplingConfig(temperature=0, max_new_tokens=90)) for _ in range(3)]
    scheduler.submit([r for r, _ in rows])
    scheduler.iterate()
    assert (cache.size, cache.capacity) == (4, 128)  # 3 rows (a power of two), 93 tokens: not 64 x 1024
    held = cache.keys.nbytes + cache.values.nbytes
    assert held == kv_cache_bytes(gpt.config, 4, 128, torch.float32)
    run_until(scheduler, lambda: all(recorder.ended for _, recorder in rows))
    scheduler.iterate()
    assert cache.size == 0


# ------------------------------------------------------ padded vocabularies and several stop ids

def test_a_padded_vocabulary_is_never_sampled_nor_listed(model: Callable[..., GPT]) -> None:
    """A byte tokenizer (256 ids) on a model of 300: at temperature 2, 200 tokens would meet the 44
    padded ids many times over if they were not masked."""
    gpt = model(vocab_size=300, positions="rope")
    scheduler = Scheduler(gpt, ByteTokenizer(), max_batch=2)
    sampling = SamplingConfig(temperature=2.0, seed=1, max_new_tokens=200)
    submitted, seen = row([65, 66], sampling, logprobs=300)
    scheduler.submit([submitted])
    run_until(scheduler, lambda: seen.ended)
    assert len(seen.tokens) == 200 and max(seen.tokens) < 256
    assert all(len(e.top) == 256 and max(i for i, _ in e.top) < 256 for e in seen.events[:-1])


def test_the_scheduler_stops_at_either_stop_id(model: Callable[..., GPT]) -> None:
    gpt = model(positions="rope")
    sampling = SamplingConfig(temperature=1.0, seed=2, max_new_tokens=40)
    free = torch.cat(list(generate(gpt, [[1, 2]], sampling)), dim=1)[0].tolist()
    stop = free[5]
    end = free.index(stop)
    never = next(i for i in range(13) if i not in free)
    for stops in ((stop, never), (never, stop)):
        scheduler = Scheduler(gpt, TwoStops("abcdefghijklm", stops))
        submitted, seen = row([1, 2], sampling)
        scheduler.submit([submitted])
        run_until(scheduler, lambda seen=seen: seen.ended)
        assert seen.tokens == free[:end] and seen.events[-1].finish_reason == "eot"
