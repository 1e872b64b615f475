"""GET /metrics (gptlab.serve.prometheus): the scheduler's reports driven step by step, then a real server
scraped before and after it serves completions (streamed and not), a chat and refusals. Every scrape is
read with prometheus-client's own parser; counters must move by exactly what the replies' usage and
statuses say. The key guards the route, and `gptlab serve --no-metrics` removes it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_batching import CHARS, WINDOW, row, run_until  # noqa: E402
from test_batching import model as model  # noqa: E402, F401  (the tiny random model's fixture)
from test_chat_cli import build_chat_run  # noqa: E402
from test_serve import start_server  # noqa: E402

from gptlab.cli import main  # noqa: E402
from gptlab.config import SamplingConfig  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.kv_cache import kv_cache_bytes  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.serve.batching import Scheduler  # noqa: E402
from gptlab.serve.prometheus import Metrics  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ASKED = [{"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_run(tmp_path_factory.mktemp("metrics"))


@contextmanager
def serving(app: Any) -> Iterator[str]:
    url, server, thread = start_server(app)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    """Every sample of GET /metrics, parsed by prometheus-client: (name, labels) -> value."""
    reply = httpx.get(f"{url}/metrics", headers=headers)
    assert reply.status_code == 200 and reply.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(reply.text) for sample in family.samples}


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in after, f"{name}{labels} is not among the metrics"
    return after[key] - before.get(key, 0.0)


def test_the_decode_thread_reports_rows_tokens_and_latencies(model: Callable[..., GPT]) -> None:
    """Two rows, one slot: the gauges follow the queue and the cache, the counters the rows' usage."""
    scheduler = Scheduler(model(), CHARS, max_batch=1)
    metrics = Metrics(scheduler)
    scheduler.observer = metrics
    value = metrics.registry.get_sample_value
    first, first_events = row([1, 2, 3], SamplingConfig(temperature=0, max_new_tokens=5))
    second, second_events = row([4, 5], SamplingConfig(temperature=1.0, max_new_tokens=4, seed=1))
    scheduler.submit([first, second])
    assert (value("gptlab_rows_running"), value("gptlab_rows_waiting"), value("gptlab_kv_cache_bytes")) == \
        (0, 2, 0)
    scheduler.iterate()
    assert (value("gptlab_rows_running"), value("gptlab_rows_waiting")) == (1, 1)
    # one row of slots enough for 3 + 5 tokens, rounded up to a step of slots, at most the window
    assert value("gptlab_kv_cache_bytes") == kv_cache_bytes(scheduler.config, 1, WINDOW, torch.float32)
    assert value("gptlab_prompt_tokens_total") == 3
    run_until(scheduler, lambda: second_events.ended)
    generated = sum(e.completion_tokens for e in [*first_events.events, *second_events.events])
    assert generated == 9 and value("gptlab_prompt_tokens_total") == 5
    assert value("gptlab_generation_tokens_total") == generated
    assert value("gptlab_time_to_first_token_seconds_count") == 2
    assert value("gptlab_inter_token_latency_seconds_count") == generated - 2
    assert value("gptlab_time_to_first_token_seconds_sum") > 0
    assert value("gptlab_inter_token_latency_seconds_sum") > 0
    assert (value("gptlab_rows_running"), value("gptlab_rows_waiting"), value("gptlab_kv_cache_bytes")) == \
        (0, 0, 0)  # an idle server frees its cache


def streamed_usage(url: str, body: dict[str, Any]) -> dict[str, int]:
    """The usage chunk of a streamed completion that asked for it."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def test_counters_move_by_what_the_server_served(chat_run: Path) -> None:
    lm = load(chat_run)
    model, tokenizer = lm.model, lm.tokenizer
    with serving(create_app(LM.from_model(model, tokenizer), "chat", max_batch=4)) as url:
        before = scrape(url)
        whole = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 7,
                                                          "temperature": 0}, timeout=30).json()["usage"]
        streamed = streamed_usage(url, {"prompt": "a dog sat", "max_tokens": 9, "temperature": 1.0, "seed": 3,
                                        "stream": True, "stream_options": {"include_usage": True}})
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASKED, "max_tokens": 12,
                                                              "temperature": 0}, timeout=30).json()["usage"]
        scored = httpx.post(f"{url}/v1/completions", json={"prompt": "the mat", "max_tokens": 0, "echo": True,
                                                           "logprobs": 1}, timeout=30).json()["usage"]
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "the", "max_tokens": -1})
        assert refused.status_code == 400
        assert httpx.get(f"{url}/v1/models/other").status_code == 404
        assert httpx.get(f"{url}/nowhere").status_code == 404
        assert httpx.get(f"{url}/v1/completions").status_code == 405
        assert httpx.get(f"{url}/v1/models", headers={"Host": "rebound.example"}).status_code == 421
        after = scrape(url)
    usages = [whole, streamed, chat, scored]  # lm-eval scores prompts with max_tokens 0: they count
    assert moved(before, after, "gptlab_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert moved(before, after, "gptlab_generation_tokens_total") == generated
    requests = {("/v1/completions", "200"): 3, ("/v1/completions", "400"): 1, ("/v1/completions", "405"): 1,
                ("/v1/chat/completions", "200"): 1, ("/v1/models/{model_id}", "404"): 1,
                ("/v1/models", "421"): 1, ("unmatched", "404"): 1,
                ("/metrics", "200"): 1}  # the first scrape; not the second, yet
    for (endpoint, status), count in requests.items():
        assert moved(before, after, "gptlab_requests_total", endpoint=endpoint, status=status) == count
    assert scored["completion_tokens"] == 0  # so three rows sampled a first token
    assert moved(before, after, "gptlab_time_to_first_token_seconds_count") == 3
    assert moved(before, after, "gptlab_inter_token_latency_seconds_count") == generated - 3
    assert moved(before, after, "gptlab_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert moved(before, after, "gptlab_inter_token_latency_seconds_sum") > 0
    for gauge in ("gptlab_rows_running", "gptlab_rows_waiting", "gptlab_kv_cache_bytes"):
        assert (gauge, frozenset()) in after


def test_the_api_key_guards_metrics(chat_run: Path) -> None:
    lm = load(chat_run)
    model, tokenizer = lm.model, lm.tokenizer
    with serving(create_app(LM.from_model(model, tokenizer), "chat", max_batch=1, api_key="s3cret")) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = httpx.get(f"{url}/metrics", headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        samples = scrape(url, {"Authorization": "Bearer s3cret"})
    assert samples[("gptlab_requests_total", frozenset({("endpoint", "/metrics"), ("status", "401")}))] == 2


def test_serve_no_metrics_answers_404(chat_run: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The command's flag reaches the app: GET /metrics is a 404, as a route that does not exist."""
    import gptlab.serve.server

    apps: list[Any] = []

    def keep(app: Any, sock: Any) -> None:  # instead of serving until Ctrl-C
        sock.close()
        apps.append(app)

    monkeypatch.setattr(gptlab.serve.server, "run_app", keep)
    threads = str(torch.get_num_threads())  # the command sets it: leave it as it is
    for flags in (["--no-metrics"], []):
        assert main(["serve", str(chat_run), "--port", "0", "--max-batch", "1", "--threads", threads,
                     *flags]) == 0
    announced = [line for line in capsys.readouterr().out.splitlines() if line.startswith("serving ")]
    assert ["metrics at /metrics" in line for line in announced] == [False, True], announced
    without, with_metrics = apps
    with serving(without) as url:
        reply = httpx.get(f"{url}/metrics")
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
    with serving(with_metrics) as url:
        assert ("gptlab_generation_tokens_total", frozenset()) in scrape(url)
