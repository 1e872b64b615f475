"""POST /v1/chat/completions with the official `openai` client against a real server: the reply equals
`stream_text` of the rendered conversation (an independent path), streamed and not, n > 1, logprobs with
bytes checked against the plain forward pass, usage only when asked, bad messages named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_chat_cli import END, build_chat_run  # noqa: E402
from test_serve import Live, start_server  # noqa: E402

from gptlab.config import SamplingConfig  # noqa: E402
from gptlab.generate import stream_text  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.text.chat_template import NativeTemplate  # noqa: E402

ASKED = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def chat_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    lm = load(build_chat_run(tmp_path_factory.mktemp("chat")))
    model, tokenizer = lm.model, lm.tokenizer
    app = create_app(LM.from_model(model, tokenizer), "chat", max_batch=4)
    url, server, thread = start_server(app)
    yield Live(url, app.state.served)
    server.should_exit = True
    thread.join(timeout=10)


def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def alone(live: Live, messages: list[dict], sampling: SamplingConfig) -> tuple[str, list[int], str | None]:
    """Text, token ids and stop reason of `stream_text` on the rendered conversation, cut at <|end|>."""
    prompt = NativeTemplate().render(messages, add_generation_prompt=True)
    sampling = sampling.replace(stop=(*sampling.stop, END))
    chunks = list(stream_text(live.served.model, live.served.tokenizer, prompt, sampling))
    return ("".join(c.text for c in chunks), [c.token for c in chunks if c.token is not None],
            chunks[-1].stop_reason)


def test_greedy_reply_with_logprobs_and_bytes(chat_live: Live) -> None:
    reply = client(chat_live).chat.completions.create(model="chat", messages=ASKED, temperature=0,
                                                      max_tokens=12, logprobs=True, top_logprobs=3)
    text, ids, reason = alone(chat_live, ASKED, SamplingConfig(temperature=0, max_new_tokens=12))
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == text and reason == "stop" and choice.finish_reason == "stop"
    tokenizer = chat_live.served.tokenizer
    prompt = tokenizer.encode(NativeTemplate().render(ASKED, add_generation_prompt=True))
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(ids)
    content = choice.logprobs.content  # the reply's tokens; the <|end|> that ended it is not listed
    assert [e.bytes for e in content] == [list(tokenizer.token_bytes(t)) for t in ids[:-1]]
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == text
    # Log-probabilities from one plain forward pass over the prompt and the reply.
    with torch.no_grad():
        logits = chat_live.served.model(torch.tensor([prompt + ids]))[0][0]  # (T, V)
    logp = logits[len(prompt) - 1:-1].log_softmax(-1)  # (reply tokens, V)
    chosen = logp[torch.arange(len(ids) - 1), torch.tensor(ids[:-1])]
    assert_close(torch.tensor([e.logprob for e in content]), chosen, atol=1e-4, rtol=0)
    for entry, row in zip(content, logp, strict=False):
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert_close(torch.tensor([t.logprob for t in entry.top_logprobs]), row.topk(3).values,
                     atol=1e-4, rtol=0)


def test_streamed_n_choices_and_usage_only_when_asked(chat_live: Live) -> None:
    for include_usage in (False, True):
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        stream = client(chat_live).chat.completions.create(model="chat", messages=ASKED, temperature=1.0,
                                                           seed=5, n=2, max_tokens=10, stream=True, **options)
        chunks = list(stream)
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        texts, roles, finishes = ["", ""], [None, None], [None, None]
        for chunk in chunks:
            for c in chunk.choices:
                roles[c.index] = roles[c.index] or c.delta.role
                texts[c.index] += c.delta.content or ""
                finishes[c.index] = c.finish_reason or finishes[c.index]
        for index in range(2):  # choice i is seeded with seed + i
            sampling = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=5 + index)
            text, _, _ = alone(chat_live, ASKED, sampling)
            assert texts[index] == text and roles[index] == "assistant" and finishes[index] is not None
        usages = [c.usage for c in chunks if c.usage is not None]
        assert len(usages) == include_usage
        if include_usage:
            assert chunks[-1].usage is usages[0] and chunks[-1].choices == []


HI = {"role": "user", "content": "hi"}
BAD = [({"messages": [HI, {"role": "tool", "content": "x"}]}, "messages[1].role"),
       ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
       ({"messages": [{"role": "user"}]}, "messages[0].content"),
       ({"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages[0].extra"),
       ({"messages": []}, "messages"),
       ({}, "messages"),
       ({"messages": [HI], "top_logprobs": 2}, "top_logprobs"),
       ({"messages": [HI], "max_tokens": 2, "max_completion_tokens": 3},
        "max_completion_tokens"),
       ({"messages": [{"role": "user", "content": "hi " * 200}]}, "messages")]


def test_bad_requests_are_400s_naming_the_field(chat_live: Live) -> None:
    for body, param in BAD:
        reply = httpx.post(f"{chat_live.url}/v1/chat/completions", json=body)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == param, (body, error)
        assert error["message"], body
    assert chat_live.served.scheduler.active == 0


def test_a_model_without_the_template_tokens_refuses_chat(trained_run: Path) -> None:
    from fastapi.testclient import TestClient

    lm = load(trained_run)

    model, tokenizer = lm.model, lm.tokenizer
    with TestClient(create_app(LM.from_model(model, tokenizer), "char", allowed_hosts=None)) as http:
        reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the"}]})
        assert reply.status_code == 400 and "not fine-tuned for chat" in reply.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "the", "max_tokens": 2}).status_code == 200
        assert "not fine-tuned for chat" in http.get("/").text  # the page's chat mode says why it is off
