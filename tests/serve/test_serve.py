"""`gptlab serve` (gptlab.serve): a real uvicorn server on a free local port, spoken to over HTTP with
httpx and with the official `openai` client. Batched rows are held to `generate` alone, token for token."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from gptlab.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from gptlab.config import SamplingConfig  # noqa: E402
from gptlab.generate import stream_text  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.inspection.attention_view import attention_maps  # noqa: E402
from gptlab.serve.app import MAX_BODY, create_app  # noqa: E402
from gptlab.serve.completion import Served  # noqa: E402
from gptlab.serve.schemas import Limits  # noqa: E402

NAME = "tiny"
MAX_TOKENS = 100_000  # the test server's limit: long enough to hold a row while a client goes away


@dataclass
class Live:
    url: str
    served: Served


def start_server(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Run `app` under uvicorn on a free port of 127.0.0.1 in a thread; its URL once it accepts."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@pytest.fixture(scope="module")
def live(trained_run: Path) -> Iterator[Live]:
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    app = create_app(LM.from_model(model, tokenizer), NAME, max_batch=8, limits=Limits(max_tokens=MAX_TOKENS))
    url, server, thread = start_server(app)
    yield Live(url, app.state.served)
    server.should_exit = True
    thread.join(timeout=10)


def alone(live: Live, prompt: str, sampling: SamplingConfig) -> tuple[str, str | None]:
    """The text and stop reason `stream_text` gives for the prompt alone."""
    chunks = list(stream_text(live.served.model, live.served.tokenizer, prompt, sampling))
    return "".join(c.text for c in chunks), chunks[-1].stop_reason


def wait_for(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_models_and_a_completion_with_usage(live: Live) -> None:
    models = httpx.get(f"{live.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["object"] == "list"
    reply = httpx.post(f"{live.url}/v1/completions", json={"prompt": "the cat", "max_tokens": 30,
                                                          "temperature": 0.9, "seed": 7}).json()
    text, reason = alone(live, "the cat", SamplingConfig(temperature=0.9, max_new_tokens=30, seed=7))
    assert reply["choices"][0]["text"] == text and reason == "length"
    assert reply["choices"][0]["finish_reason"] == "length" and reply["model"] == NAME
    assert reply["usage"] == {"prompt_tokens": 7, "completion_tokens": 30, "total_tokens": 37}


# Greedy and seeded samples, with top-k, top-p and stop strings, across the context window (24 tokens),
# where learned positions restart the window: each request must get what it gets alone.
CASES = [("the cat", dict(temperature=0.0, max_tokens=50)),
         ("a", dict(temperature=1.0, seed=3, max_tokens=60)),
         ("my bird sat on a\nthe", dict(temperature=0.8, top_k=5, seed=11, max_tokens=40)),
         ("the dog", dict(temperature=1.0, top_p=0.7, seed=5, max_tokens=45, stop=["rug", "mat"])),
         ("a dog sat on", dict(temperature=0.0, max_tokens=5)),
         ("t", dict(temperature=1.3, seed=2, max_tokens=70, stop="."))]


@pytest.mark.slow
def test_concurrent_requests_join_the_batch_and_get_their_tokens_alone(live: Live) -> None:
    scheduler = live.served.scheduler
    steps, largest = scheduler.steps, scheduler.largest_batch
    scheduler.largest_batch = 0

    async def one(client: httpx.AsyncClient, delay: float, prompt: str, options: dict) -> dict:
        await asyncio.sleep(delay)  # staggered, so later requests join a batch that is decoding
        reply = await client.post(f"{live.url}/v1/completions", json={"prompt": prompt, **options})
        return reply.json()

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, 0.01 * i, p, o) for i, (p, o) in enumerate(CASES * 2)))

    replies = asyncio.run(run_all())
    for (prompt, options), reply in zip(CASES * 2, replies, strict=True):
        stop = options.get("stop", ())
        sampling = SamplingConfig(temperature=options["temperature"], top_k=options.get("top_k"),
                                  top_p=options.get("top_p", 1.0), max_new_tokens=options["max_tokens"],
                                  stop=(stop,) if isinstance(stop, str) else tuple(stop),
                                  seed=options.get("seed"))
        text, reason = alone(live, prompt, sampling)
        assert "choices" in reply, reply
        assert reply["choices"][0]["text"] == text, (prompt, options)
        assert reply["choices"][0]["finish_reason"] == {"eot": "stop"}.get(reason, reason)
    assert any(r["choices"][0]["finish_reason"] == "stop" for r in replies)  # a stop string was met
    assert scheduler.largest_batch > 2  # they were decoded together
    assert scheduler.steps - steps < sum(o["max_tokens"] for _, o in CASES * 2)
    scheduler.largest_batch = max(largest, scheduler.largest_batch)


def test_openai_client_streams_with_logprobs_and_several_choices(live: Live) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [NAME]
    stream = client.completions.create(model=NAME, prompt="the cat", max_tokens=20, temperature=0.7, seed=4,
                                       logprobs=5, stream=True)
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices[0].logprobs]
    assert len(token_chunks) == 20  # one chunk per token
    text = "".join(c.choices[0].text for c in chunks)
    assert text == alone(live, "the cat", SamplingConfig(temperature=0.7, max_new_tokens=20, seed=4))[0]
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it
    # The first token's log-probabilities are the model's raw ones after the prompt.
    model, tokenizer = live.served.model, live.served.tokenizer
    with torch.no_grad():
        logp = model(torch.tensor([tokenizer.encode("the cat")]))[0][0, -1].log_softmax(-1)
    first = token_chunks[0].choices[0].logprobs
    top = logp.topk(5)
    assert list(first.top_logprobs[0]) == [tokenizer.decode([int(t)]) for t in top.indices]
    assert_close(torch.tensor(list(first.top_logprobs[0].values())), top.values, atol=1e-5, rtol=0)
    assert first.text_offset == [7] and token_chunks[1].choices[0].logprobs.text_offset == [8]
    whole = client.completions.create(model=NAME, prompt=["the cat", "a dog"], n=2, max_tokens=8, seed=4,
                                      temperature=0.7)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == text[:len(whole.choices[0].text)]  # choice 0 has the request's seed
    second = alone(live, "a dog", SamplingConfig(temperature=0.7, max_new_tokens=8, seed=7))[0]
    assert whole.choices[3].text == second  # choice i is seeded with seed + i
    assert whole.usage.prompt_tokens == 12 and whole.usage.completion_tokens == 32


def test_the_documented_streaming_loop_runs(live: Live) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    shown = io.StringIO()  # not captured stdout: other tests' logging handlers may write there too
    for chunk in client.completions.create(model=NAME, prompt="the cat", max_tokens=12, temperature=0,
                                           stream=True):
        print(chunk.choices[0].text, end="", file=shown)  # OpenAI's own example: every chunk has a choice
    text, _ = alone(live, "the cat", SamplingConfig(temperature=0.0, max_new_tokens=12))
    assert shown.getvalue() == text


def test_usage_is_streamed_only_when_asked_as_openai_does(live: Live) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=NAME, prompt=["the cat", "a dog"], max_tokens=6, seed=1,
                                            stream=True, stream_options={"include_usage": True}))
    *tokens, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == 12 and last.usage.completion_tokens == 12
    assert all(c.choices and c.usage is None for c in tokens)
    # On the wire every other chunk says "usage": null, as OpenAI's do; without the option none has the key.
    body = {"prompt": "a", "max_tokens": 3, "stream": True}
    cases = (({"include_usage": True}, True), ({"include_usage": False}, False), (None, False))
    for options, null_usage in cases:
        sent = {**body, "stream_options": options} if options is not None else body
        lines = [line for line in httpx.post(f"{live.url}/v1/completions", json=sent).text.split("\n\n")
                 if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
        with_choices = [c for c in chunks if c["choices"]]
        assert all(("usage" in c and c["usage"] is None) == null_usage for c in with_choices), options
        assert len(chunks) - len(with_choices) == int(null_usage)
    refused = httpx.post(f"{live.url}/v1/completions",
                         json={"prompt": "a", "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def raw_post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=body,
                      headers={"Content-Type": "application/json", **(headers or {})})


BAD = [
    (b'{"prompt": "the cat", ', 400, None),  # malformed JSON
    (b'["the cat"]', 400, None),
    (json.dumps({"prompt": "the cat", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "the cat", "max_tokens": True}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": 42}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "the cat", "colour": "blue"}).encode(), 400, "colour"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "the cat", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "the cat", "max_tokens": 10**12}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "the cat", "temperature": -0.1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "the cat", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "the cat", "top_p": 1.5}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "the cat", "top_k": 0}).encode(), 400, "top_k"),
    (json.dumps({"prompt": "the cat", "n": 0}).encode(), 400, "n"),
    (json.dumps({"prompt": "the cat", "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"prompt": "naïve €"}).encode(), 400, "prompt"),  # not in the char vocabulary
    (json.dumps({"prompt": ["the cat", "x" * 3]}).encode(), 400, "prompt[1]"),
    (json.dumps({"prompt": "the cat " * 4}).encode(), 400, "prompt"),  # 32 tokens, context 24
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "the cat", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "the cat", "echo": True, "stream": True}).encode(), 400, "echo"),
    (json.dumps({"prompt": "the cat", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop"),  # over 4
    (json.dumps({"prompt": "the cat", "stop": "x" * 65}).encode(), 400, "stop"),  # over 64 characters
    (json.dumps({"prompt": "a" * (MAX_BODY + 1)}).encode(), 413, None),
]


@pytest.mark.slow
def test_bad_requests_are_4xx_openai_errors_naming_the_field(live: Live) -> None:
    for body, status, param in BAD:
        reply = raw_post(live.url, body)
        assert reply.status_code == status, (body[:60], reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (body[:60], error)
        assert error["message"] and (param is None or param.split("[")[0] in error["message"])
    assert httpx.get(f"{live.url}/v1/nowhere").json()["error"]["code"] == "not_found"
    # The server is alive and its batch empty after all that.
    assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert wait_for(lambda: live.served.scheduler.active == 0, 2.0)  # the last row leaves after its event


def test_a_client_that_goes_away_frees_its_slot_at_once(live: Live) -> None:
    scheduler = live.served.scheduler
    body = {"prompt": "the cat", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 1.0}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        assert scheduler.active == 1
    assert wait_for(lambda: scheduler.active == 0, 2.0), "the streamed row kept its slot"
    # A whole (not streamed) completion: the client closes its socket while the row decodes.
    with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1]))) as sock:
        payload = json.dumps({"prompt": "a dog", "max_tokens": MAX_TOKENS}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        assert wait_for(lambda: scheduler.active == 1, 2.0)
    assert wait_for(lambda: scheduler.active == 0, 2.0), "the whole completion kept its slot"


@pytest.mark.slow  # starts a server
def test_api_key_is_required_when_given(trained_run: Path) -> None:
    openai = pytest.importorskip("openai")
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    app = create_app(LM.from_model(model, tokenizer), NAME, api_key="s3cret")
    url, server, thread = start_server(app)
    try:
        body = {"prompt": "a", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(url).status_code == 200 and 'id="api-key"' in httpx.get(url).text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=NAME, prompt="a", max_tokens=3).usage.completion_tokens == 3
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_attention_endpoint_gives_the_inspection_weights(live: Live) -> None:
    model, tokenizer = live.served.model, live.served.tokenizer
    reply = httpx.post(f"{live.url}/v1/attention", json={"text": "the cat sat", "layer": 1, "head": 0}).json()
    ids = tokenizer.encode("the cat sat")
    maps = attention_maps(model, tokenizer, "the cat sat", ids, layer=1, head=0)
    assert reply["tokens"] == maps.labels and reply["dropped"] == 0
    assert_close(torch.tensor(reply["weights"]), maps.weights[0, 0, -1], atol=1e-5, rtol=0)
    bad = httpx.post(f"{live.url}/v1/attention", json={"text": "the cat", "layer": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "layer"
    assert "layer 9 does not exist" in bad.json()["error"]["message"]


def test_page_is_self_contained(live: Live) -> None:
    import re

    page = httpx.get(live.url).text
    assert not re.search(r"https?://|<link|\bsrc=|@import|url\(", page)  # nothing to fetch
    info = json.loads(re.search(r'<script type="application/json" id="info">(.*?)</script>', page, re.S)[1])
    assert info == {"name": NAME, "n_layer": 2, "n_head": 2, "block_size": 24, "max_tokens": MAX_TOKENS}


@pytest.mark.slow  # starts a second Python process that imports torch
def test_serve_command_prints_its_address_and_stops_on_ctrl_c(trained_run: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "gptlab", "serve", str(trained_run), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving {trained_run} as model 'run' at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "run"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) in (0, 130)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow  # starts a server process
def test_the_serve_command_applies_a_runs_generation_defaults(trained_run: Path, tmp_path: Path) -> None:
    """A run whose generation_config said greedy (temperature 0, as `import-hf` saves it) is served
    greedily to requests that leave temperature out: two seeds give `stream_text`'s greedy text."""
    run = tmp_path / "greedy-run"
    run.mkdir()
    for name in ("best.safetensors", "last.safetensors"):
        checkpoint = load_checkpoint(trained_run / name)
        save_checkpoint(run / name, replace(checkpoint, state={**checkpoint.state,
                                                                "generation": {"temperature": 0.0}}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "gptlab", "serve", str(run), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = process.stdout.readline().split(" at ")[1].split()[0]
        asked = [{"prompt": "the cat", "max_tokens": 12, "seed": seed} for seed in (1, 2)]
        texts = [httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
                 for body in asked]
    finally:
        process.kill()
        process.wait()
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    greedy = "".join(c.text for c in stream_text(model, tokenizer, "the cat",
                                                 SamplingConfig(temperature=0.0, max_new_tokens=12)))
    assert texts == [greedy, greedy]


def test_a_run_is_served_from_python_as_the_command_serves_it(trained_run: Path, tmp_path: Path) -> None:
    """`app_for_run` is the serve command's assembly: the run's model held as asked, named after its folder,
    the batch as planned, the run's generation defaults kept; a refusal names the argument, not the flag."""
    from gptlab.config import SettingError
    from gptlab.serve.server import app_for_run

    run = tmp_path / "greedy-run"
    run.mkdir()
    checkpoint = load_checkpoint(trained_run / "best.safetensors")
    greedy = {**checkpoint.state, "generation": {"temperature": 0.0}}
    save_checkpoint(run / "best.safetensors", replace(checkpoint, state=greedy))
    limits = Limits(max_tokens=50)
    served = app_for_run(run, dtype="bfloat16", max_batch=4, limits=limits)
    state = served.app.state.served
    assert served.name == state.name == "greedy-run" and state.limits is limits
    assert (served.plan.max_batch, served.plan.chosen, state.scheduler.max_batch) == (4, False, 4)
    assert state.defaults == {"temperature": 0.0}
    reference = load(run).model
    for (name, ours), (_, theirs) in zip(state.model.named_parameters(), reference.named_parameters(),
                                         strict=True):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs.to(torch.bfloat16)), name
    with pytest.raises(SettingError, match=r"^max_context 25 is more than the model's context window \(24\)"):
        app_for_run(run, limits=Limits(max_context=25))
