"""`gptlab serve`'s bounds: a full queue is a 429, a request's deadline (queued: a 503, running: the end
of its completion), clients that leave while queued never start, the context limit, and the KV cache's
worst case sized against free memory. A real uvicorn server with one row, on 127.0.0.1 (see test_serve)."""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve import MAX_TOKENS, NAME, Live, start_server, wait_for  # noqa: E402

from gptlab.config import ModelConfig  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.serve.schemas import Limits  # noqa: E402
from gptlab.serve.sizing import HEADROOM, plan_memory  # noqa: E402

LONG = {"prompt": "the cat", "max_tokens": MAX_TOKENS, "temperature": 1.0}


@pytest.fixture(scope="module")
def one_row(trained_run: Path) -> Iterator[Live]:
    """A server of one row and one waiting row: a second request waits, a third is refused."""
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    app = create_app(LM.from_model(model, tokenizer), NAME, max_batch=1,
                     limits=Limits(max_tokens=MAX_TOKENS, max_waiting=1, prefill_chunk=5))
    url, server, thread = start_server(app)
    yield Live(url, app.state.served)
    server.should_exit = True
    thread.join(timeout=10)


def send_raw(url: str, body: dict) -> socket.socket:
    """A POST over a bare socket, so the test can close it while the request waits."""
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_queued_clients_that_leave_never_start_and_a_full_queue_is_a_429(one_row: Live) -> None:
    scheduler = one_row.served.scheduler
    assert scheduler.prefill_chunk == 5  # the limit reaches the scheduler
    with httpx.stream("POST", f"{one_row.url}/v1/completions", json={**LONG, "stream": True}) as running:
        lines = running.iter_lines()  # kept: a dropped iterator would close the response
        assert next(lines).startswith("data: ")
        admitted = scheduler.admitted  # the running request's row
        for stream in (True, False):
            waiting = send_raw(one_row.url, {**LONG, "stream": stream})
            assert wait_for(lambda: len(scheduler.waiting) == 1), "the second request did not queue"
            refused = httpx.post(f"{one_row.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            assert int(refused.headers["retry-after"]) >= 1
            waiting.close()
            assert wait_for(lambda: len(scheduler.waiting) == 0, 3.0), f"stream={stream}: it stayed queued"
    assert wait_for(lambda: scheduler.active == 0, 3.0)
    assert scheduler.admitted == admitted  # neither queued request ever got the slot


@pytest.mark.slow
def test_the_deadline_ends_running_rows_and_refuses_queued_ones(one_row: Live) -> None:
    served, scheduler = one_row.served, one_row.served.scheduler
    limits = served.limits
    with httpx.stream("POST", f"{one_row.url}/v1/completions", json={**LONG, "stream": True}) as running:
        lines = running.iter_lines()  # kept: a dropped iterator would close the response
        assert next(lines).startswith("data: ")
        served.limits = dataclasses.replace(limits, request_timeout=0.3)  # for the requests below only
        try:
            for stream in (False, True):
                late = httpx.post(f"{one_row.url}/v1/completions", json={**LONG, "stream": stream},
                                  timeout=30)
                assert late.status_code == 503, (stream, late.text)
                assert int(late.headers["retry-after"]) >= 1 and "deadline" in late.json()["error"]["message"]
        finally:
            served.limits = limits
    assert wait_for(lambda: scheduler.active == 0, 3.0)
    served.limits = dataclasses.replace(limits, request_timeout=0.5)
    try:
        cut = httpx.post(f"{one_row.url}/v1/completions", json=LONG, timeout=30).json()
    finally:
        served.limits = limits
    assert cut["choices"][0]["finish_reason"] == "length"
    assert 0 < cut["usage"]["completion_tokens"] < MAX_TOKENS
    assert len(cut["choices"][0]["text"]) == cut["usage"]["completion_tokens"]  # char model: what it decoded


def test_max_context_bounds_prompt_and_max_tokens(trained_run: Path) -> None:
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    with pytest.raises(ValueError, match="more than the model's context window"):
        create_app(LM.from_model(model, tokenizer), NAME, limits=Limits(max_context=25))
    app = create_app(LM.from_model(model, tokenizer), NAME, limits=Limits(max_context=16))
    assert app.state.served.scheduler.max_context == 16
    url, server, thread = start_server(app)
    try:
        fits = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 9})  # 7 + 9
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 9
        over = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 10})
        assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
        assert "16" in over.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["context_window"] == 16
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# SmolLM2-135M's shape: 30 layers, 9 query and 3 key/value heads of 64, a context of 8192.
SMOLLM2 = ModelConfig(vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576)


def row_bytes(config: ModelConfig, tokens: int, itemsize: int) -> int:
    """A key and a value per layer, key/value head and token: the naive count for one row."""
    return 2 * config.n_layer * config.kv_heads * (config.n_embd // config.n_head) * tokens * itemsize


def test_the_memory_plan_fits_the_reference_model_and_says_what_to_lower() -> None:
    weights, free = 540_000_000, 24_000_000_000  # 135M float32 parameters; a 24 GB machine
    plan = plan_memory(SMOLLM2, torch.float32, weights, free)  # neither flag: a batch that fits
    per_row = row_bytes(SMOLLM2, 8192, 4)
    assert plan.chosen and plan.max_context == 8192 and 1 <= plan.max_batch < 64
    assert weights + plan.max_batch * per_row <= HEADROOM * free < weights + (plan.max_batch + 1) * per_row
    assert plan.cache_bytes == plan.max_batch * per_row
    small = plan_memory(SMOLLM2, torch.bfloat16, weights, free, max_context=1024)  # fits as given
    assert (small.max_batch, small.max_context, small.chosen) == (64, 1024, False)
    with pytest.raises(ValueError) as refused:
        plan_memory(SMOLLM2, torch.float32, weights, free, max_batch=64)
    message = str(refused.value)
    assert "\n" not in message and "max_batch to" in message and "max_context to" in message
    rows = int(message.split("max_batch to ")[1].split()[0])
    tokens = int(message.split("max_context to ")[1].split()[0].rstrip(":,"))
    for batch, context in ((rows, 8192), (64, tokens)):  # each advice fits, one more does not
        assert plan_memory(SMOLLM2, torch.float32, weights, free, batch, context).max_batch == batch
    with pytest.raises(ValueError):
        plan_memory(SMOLLM2, torch.float32, weights, free, rows + 1, 8192)
    with pytest.raises(ValueError):
        plan_memory(SMOLLM2, torch.float32, weights, free, 64, tokens + 1)
    with pytest.raises(ValueError, match="max_context to"):  # not even one row of 8192 fits in 1 GB
        plan_memory(SMOLLM2, torch.float32, weights, 1_000_000_000)
    assert plan_memory(SMOLLM2, torch.float32, weights, None).max_batch == 64  # unknown memory: no check
