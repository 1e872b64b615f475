"""The server's prefix cache (gptlab.serve.prefix_cache): a prompt that starts with tokens an earlier row held
reuses their keys and values and gets the logits and tokens of a fresh prefill, for every position scheme
with grouped-query attention; the cache keeps to its byte budget, least recently used first, at token
granularity; the command's flag reaches the scheduler, and /metrics counts queries, hits and bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import CHARS, Recorder, row, run_until  # noqa: E402
from test_batching import model as model  # noqa: E402, F401  (the tiny random model's fixture)
from torch.testing import assert_close

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.config import POSITIONS, ModelConfig, SamplingConfig
from gptlab.kv_cache import KVCache, kv_cache_bytes
from gptlab.model import GPT
from gptlab.serve.batching import Scheduler
from gptlab.serve.prefix_cache import PrefixCache, shared_prefix
from gptlab.text.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

FIRST = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
LONGER = [*FIRST, 3, 1, 4, 1, 5]  # FIRST and more: reuses all of FIRST and what FIRST's row generated
OTHER = [1, 2, 3, 4, 5, 6, 7, 12, 0, 2]  # shares its first 7 tokens with FIRST


def served(scheduler: Scheduler, prompt: list[int], sampling: SamplingConfig) -> Recorder:
    """One row through the scheduler until it ends, every token's log-probabilities recorded."""
    submitted, recorder = row(prompt, sampling, logprobs=CHARS.vocab_size)
    scheduler.submit([submitted])
    run_until(scheduler, lambda: recorder.ended)
    return recorder


def logprobs(recorder: Recorder) -> torch.Tensor:
    """Every token's log-probability of every id, (T, V), from a row's events."""
    return torch.tensor([[lp for _, lp in sorted(event.top or [])] for event in recorder.events[:-1]])


@pytest.mark.parametrize(("positions", "changes"), [*((p, {}) for p in POSITIONS),
                                                    ("rope", {"ngram_embeddings": (2, 3)})])
def test_a_reused_prefix_gives_the_logits_and_tokens_of_a_fresh_prefill(
        positions: str, changes: dict[str, Any], model: Callable[..., GPT]) -> None:
    """With n-gram embeddings too: a reused row's next tokens read their predecessors' ids."""
    gpt = model(positions=positions, block_size=32, n_head=4, n_kv_head=2, **changes)  # grouped-query
    cached = Scheduler(gpt, CHARS, max_batch=2, prefill_chunk=4, prefix_cache_bytes=1 << 20)
    fresh = Scheduler(gpt, CHARS, max_batch=2, prefill_chunk=4)
    greedy = SamplingConfig(temperature=0, max_new_tokens=5)
    held = [FIRST + served(cached, FIRST, greedy).tokens[:-1]]  # what each row left in the cache
    assert cached.prefix.hits == 0 and len(cached.prefix.entries) == 1
    for prompt, at_least, sampling in [(LONGER, len(FIRST), greedy),
                                       (OTHER, 7, SamplingConfig(temperature=1.0, seed=3, max_new_tokens=6)),
                                       (FIRST[:5], 4, greedy)]:  # a prefix of a kept entry: all but its last
        hits = cached.prefix.hits
        again, alone = served(cached, prompt, sampling), served(fresh, prompt, sampling)
        shared = max(shared_prefix(torch.tensor(h), torch.tensor(prompt)) for h in held)
        assert cached.prefix.hits - hits == min(shared, len(prompt) - 1) >= at_least
        held.append(prompt + again.tokens[:-1])
        assert again.tokens == alone.tokens
        assert_close(logprobs(again), logprobs(alone), atol=1e-5, rtol=1e-5)
        assert again.events[-1].finish_reason == alone.events[-1].finish_reason == "length"


def test_a_row_that_moved_its_window_or_wrapped_its_ring_is_not_kept(model: Callable[..., GPT]) -> None:
    """Learned positions restart the window past block_size, and a row at the window slides its ring:
    neither holds its tokens at positions 0 .., so neither is kept."""
    for positions in ("learned", "rope"):
        scheduler = Scheduler(model(positions=positions), CHARS, max_batch=1, prefix_cache_bytes=1 << 20)
        served(scheduler, [1, 2, 3], SamplingConfig(temperature=0, max_new_tokens=20))  # 23 tokens > 16
        assert scheduler.prefix.entries == {} and scheduler.prefix.bytes == 0


def cache_holding(config: ModelConfig, ids: list[int]) -> KVCache:
    """A one-row cache whose keys and values at position i are i + 1 (so copies can be told apart)."""
    cache = KVCache(config, 1, 32)
    fill = torch.arange(1, len(ids) + 1, dtype=torch.float32)[None, None, :, None]  # (1, 1, n, 1)
    keys = fill.expand(config.n_layer, config.kv_heads, len(ids), config.head_size)  # (L, Hkv, n, hs)
    cache.load(0, torch.tensor(ids), keys, -keys)
    return cache


def test_the_budget_least_recently_used_first_and_token_granularity(tiny_config: Callable[..., Any]) -> None:
    config = tiny_config(block_size=32)
    per_token = kv_cache_bytes(config, 1, 1, torch.float32)
    kept = PrefixCache(10 * per_token)
    assert kept.bytes == 0  # nothing reserved up front
    kept.keep([1, 2, 3, 4], cache_holding(config, [1, 2, 3, 4]), 0)
    kept.keep([1, 2, 3, 4, 5, 6], cache_holding(config, [1, 2, 3, 4, 5, 6]), 0)  # replaces its prefix
    assert list(kept.entries) == [(1, 2, 3, 4, 5, 6)] and kept.bytes == 6 * per_token
    kept.keep([1, 2], cache_holding(config, [1, 2]), 0)  # already held: only marked as used
    kept.keep([7, 8, 9], cache_holding(config, [7, 8, 9]), 0)
    assert kept.bytes == 9 * per_token
    kept.keep([5, 6], cache_holding(config, [5, 6]), 0)  # 11 tokens: the least recently used goes
    assert list(kept.entries) == [(7, 8, 9), (5, 6)] and kept.bytes == 5 * per_token
    kept.keep(list(range(1, 14)), cache_holding(config, list(range(1, 14))), 0)  # larger than the budget
    assert list(kept.entries) == [tuple(range(1, 11))] and kept.bytes == 10 * per_token  # its first 10

    target = KVCache(config, 2, 32)
    assert kept.reuse([1, 2, 3, 9, 9], target, 1) == 3  # the longest shared prefix, token by token
    assert target.fed == [0, 3] and kept.queried == 5 and kept.hits == 3
    assert_close(target.keys[:, 1, :, :3], cache_holding(config, [1, 2, 3]).keys[:, 0, :, :3])
    assert kept.reuse([1, 2, 3], KVCache(config, 1, 32), 0) == 2  # the last token is always run
    assert kept.reuse([4, 1], KVCache(config, 1, 32), 0) == 0
    assert shared_prefix(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])) == 2


def char_run(root: Path) -> Path:
    """A run folder of a tiny random char model (no training: the server's plumbing is what is tested)."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=16))
    save_checkpoint(root / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    return root


def served_apps(run: Path, flag_sets: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The app `gptlab serve RUN FLAGS` builds for each set of flags, without serving it."""
    import gptlab.serve.server
    from gptlab.cli import main

    apps: list[Any] = []
    monkeypatch.setattr(gptlab.serve.server, "run_app", lambda app, sock: (sock.close(), apps.append(app)))
    threads = str(torch.get_num_threads())  # the command sets it: leave it as it is
    for flags in flag_sets:
        assert main(["serve", str(run), "--port", "0", "--max-batch", "2", "--threads", threads, *flags]) == 0
    return apps


def test_the_flag_reaches_the_scheduler_and_metrics_count_queries_hits_and_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    httpx = pytest.importorskip("httpx")
    from test_metrics import moved, scrape, serving

    off, on = served_apps(char_run(tmp_path), [["--prefix-cache-mb", "0"], []], monkeypatch)
    assert off.state.served.scheduler.prefix.budget == 0
    assert on.state.served.scheduler.prefix.budget == 256 * 2**20
    with serving(on) as url:
        before = scrape(url)
        body = {"prompt": "the cat sat on the mat", "max_tokens": 4, "temperature": 0}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        after = scrape(url)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert moved(before, after, "gptlab_prefix_cache_queries_total") == 2 * prompt_tokens
    assert moved(before, after, "gptlab_prefix_cache_hits_total") == prompt_tokens - 1
    assert after[("gptlab_prefix_cache_bytes", frozenset())] > 0
