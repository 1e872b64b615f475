"""The playground page of `gptlab serve` in a real headless Chromium, against a real server: type a prompt,
press Generate, read the streamed tokens from the page, click one for its alternatives and attention.
And the page as served: built from its package data files, with the server's values escaped."""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import Live, alone, start_server  # noqa: E402
from test_serve_tokens import THE, successor_model  # noqa: E402

from gptlab.config import ModelConfig, SamplingConfig  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.inspection.attention_view import attention_maps  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.serve.page import playground  # noqa: E402

if TYPE_CHECKING:
    from browser import Chromium

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SPANS = "Array.from(document.querySelectorAll('{}')).map(s => {})"  # one value per element shown
HOSTILE = 'a </script><script>document.title="owned"</script><!-- \'q\' & "q" </style>'  # a model's name


@pytest.fixture
def live(trained_run: Path) -> Iterator[tuple[str, object]]:
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    app = create_app(LM.from_model(model, tokenizer), "tiny")
    url, server, thread = start_server(app)
    yield url, app.state.served
    server.should_exit = True
    thread.join(timeout=10)


def shown_label(text: str) -> str:
    """The page's `visible`: a space as an open box, line breaks and tabs escaped, nothing as "∅"."""
    return text.replace(" ", "\u2423").replace("\n", "\\n").replace("\t", "\\t") or "\u2205"


def click(browser: Chromium, selector: str) -> None:
    """Press and release the mouse over the middle of an element, as a reader would."""
    box = json.loads(browser.js(f"JSON.stringify(document.querySelector({json.dumps(selector)})"
                                ".getBoundingClientRect())"))
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    for kind in ("mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)


class Elements(HTMLParser):
    """Every element of a page as (tag, attributes, text directly inside it), as a browser would read it."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict, str]] = []
        self.open: list[int] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.found.append((tag, dict(attrs), ""))
        if tag not in ("meta", "input", "br"):  # void elements hold no text
            self.open.append(len(self.found) - 1)

    def handle_endtag(self, tag: str) -> None:
        if self.open and self.found[self.open[-1]][0] == tag:
            self.open.pop()

    def handle_data(self, data: str) -> None:
        if self.open:
            tag, attrs, text = self.found[self.open[-1]]
            self.found[self.open[-1]] = (tag, attrs, text + data)

    def texts(self, tag: str) -> list[str]:
        return [text for t, _, text in self.found if t == tag]


def packaged(filename: str) -> str:
    """A file of the package's static/ folder, as installed, without its leading and trailing blank lines."""
    return (files("gptlab.serve") / "static" / filename).read_text(encoding="utf-8").strip()


def test_page_is_built_from_its_package_data_files() -> None:
    """The served page inlines static/playground.css and .js unchanged: one response, nothing to fetch."""
    page = Elements(playground(ModelConfig(n_layer=2, n_head=2), "tiny", 64, needs_key=False))
    assert [text.strip() for text in page.texts("style")] == [packaged("playground.css")]
    scripts = [(attrs.get("type"), text.strip()) for tag, attrs, text in page.found if tag == "script"]
    assert scripts[1] == (None, packaged("playground.js"))
    assert len(scripts) == 2 and json.loads(scripts[0][1])["n_layer"] == 2
    key_field = [attrs for tag, attrs, _ in page.found if attrs.get("id") == "key-field"]
    assert key_field == [{"id": "key-field", "hidden": None}]  # shown only by a server that needs a key


def test_a_model_name_with_markup_cannot_break_the_page() -> None:
    """A name holding </script>, a comment and quotes comes back unchanged as text and JSON, and adds no
    element, as Python's HTML parser reads the page (the browser test below checks it in Chromium)."""
    page = Elements(playground(ModelConfig(), HOSTILE, 64, needs_key=True))
    assert page.texts("title") == ["gptlab playground: " + HOSTILE]
    assert page.texts("small") == [HOSTILE]
    scripts = [attrs for tag, attrs, _ in page.found if tag == "script"]
    assert scripts == [{"type": "application/json", "id": "info"}, {}]
    info, script = page.texts("script")
    assert json.loads(info)["name"] == HOSTILE
    assert script.strip() == packaged("playground.js")
    assert [attrs for _, attrs, _ in page.found if attrs.get("id") == "key-field"] == [{"id": "key-field"}]


def wait_until(browser: Chromium, expression: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not browser.js(expression):
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.05)


@pytest.mark.slow  # starts a headless Chromium
def test_playground_streams_tokens_and_shows_alternatives_and_attention(live: tuple,
                                                                         browser: Chromium) -> None:
    url, served = live
    browser.open(url + "/")
    browser.js("document.getElementById('prompt').value = ''")
    browser.js("document.getElementById('prompt').focus()")
    browser.call("Input.insertText", text="the cat")  # typed
    for field, value in (("max-tokens", 20), ("temperature", 0.7), ("seed", 4)):
        browser.js(f"document.getElementById('{field}').value = '{value}'")
    click(browser, "#generate")
    wait_until(browser, "document.getElementById('output').dataset.state === 'done'")
    shown = browser.js(SPANS.format("#output .tok", "s.textContent") + ".join('')")
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=20, seed=4)
    expected, _ = alone(Live(url, served), "the cat", sampling)
    assert shown == expected
    assert browser.js("document.getElementById('status').textContent") == "20 tokens, finish_reason length"
    probs = browser.js(SPANS.format("#output .tok", "Number(s.dataset.prob)"))
    assert len(probs) == 20 and all(0 < p <= 1 for p in probs) and len(set(probs)) > 1

    click(browser, "#output .tok[data-i='2']")
    wait_until(browser, "document.querySelectorAll('#attention span').length > 0")
    alternatives = browser.js(SPANS.format("#alternatives li", "s.textContent"))
    # The same request to the API: the page lists token 2's five alternatives with their probabilities.
    request = {"prompt": "the cat", "max_tokens": 20, "temperature": 0.7, "seed": 4, "logprobs": 5}
    api = httpx.post(f"{url}/v1/completions", json=request).json()["choices"][0]["logprobs"]
    top = api["top_logprobs"][2].items()
    assert alternatives == [f"{shown_label(t)}  {100 * math.exp(lp):.1f}%" for t, lp in top]
    assert_close(torch.tensor(probs), torch.tensor(api["token_logprobs"]).exp(), atol=1e-4, rtol=0)
    context = "the cat" + expected[:2]  # the text whose last token chose token 2
    model, tokenizer = served.model, served.tokenizer
    maps = attention_maps(model, tokenizer, context, tokenizer.encode(context), layer=0, head=0)
    weights = browser.js(SPANS.format("#attention span", "Number(s.dataset.weight)"))
    torch.testing.assert_close(torch.tensor(weights, dtype=torch.float32), maps.weights[0, 0, -1],
                               atol=1e-4, rtol=0)
    assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    screenshot = browser.call("Page.captureScreenshot", format="png")["data"]
    assert base64.b64decode(screenshot)[:8] == PNG_SIGNATURE



@pytest.mark.slow  # starts a headless Chromium
def test_playground_joins_the_pieces_of_a_character(browser: Chromium) -> None:
    model, tokenizer = successor_model(THE)  # a byte model that answers "é>" with "thé."
    app = create_app(LM.from_model(model, tokenizer), "bytes")
    url, server, thread = start_server(app)
    try:
        browser.open(url + "/")
        assert browser.js("document.getElementById('key-field').offsetParent === null")  # no key: not shown
        for field, value in (("prompt", "é>"), ("max-tokens", 5), ("temperature", 0)):
            browser.js(f"document.getElementById('{field}').value = {json.dumps(str(value))}")
        click(browser, "#generate")
        wait_until(browser, "document.getElementById('output').dataset.state === 'done'")
        assert browser.js(SPANS.format("#output .tok", "s.textContent")) == ["t", "h", "é", "."]
        assert browser.js(SPANS.format("#output .tok", "Number(s.dataset.i)")) == [0, 1, 2, 4]
        api = httpx.post(f"{url}/v1/completions", json={"prompt": "é>", "max_tokens": 5, "temperature": 0,
                                                        "logprobs": 5}).json()["choices"][0]["logprobs"]
        assert api["tokens"][2:4] == ["bytes:\\xc3", "bytes:\\xa9"]
        probs = browser.js(SPANS.format("#output .tok", "Number(s.dataset.prob)"))
        p = torch.tensor(api["token_logprobs"]).exp()
        assert_close(torch.tensor(probs), torch.stack([p[0], p[1], p[2] * p[3], p[4]]), atol=1e-4, rtol=0)

        click(browser, "#output .tok[data-i='4']")  # the ".": its query attends over "é>thé"
        wait_until(browser, "document.querySelectorAll('#attention span').length > 0")
        labels = browser.js(SPANS.format("#attention span", "s.textContent"))
        assert labels == ["é", ">", "t", "h", "é"] and "\ufffd" not in browser.js(
            "document.getElementById('attention').textContent")
        reply = httpx.post(f"{url}/v1/attention", json={"text": "é>thé", "layer": 0, "head": 0}).json()
        w = torch.tensor(reply["weights"])
        weights = browser.js(SPANS.format("#attention span", "Number(s.dataset.weight)"))
        assert_close(torch.tensor(weights), torch.stack([w[0] + w[1], w[2], w[3], w[4], w[5] + w[6]]),
                     atol=1e-4, rtol=0)
        assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.slow  # starts a headless Chromium
def test_playground_with_a_key_and_a_name_full_of_markup(browser: Chromium) -> None:
    """A server that needs a key shows the key field; the page sends the key typed there; a model's name
    holding </script> is shown as text and runs nothing."""
    model, tokenizer = successor_model(THE)
    url, server, thread = start_server(create_app(LM.from_model(model, tokenizer), HOSTILE, api_key="s3cret"))
    try:
        browser.open(url + "/")
        assert browser.js("document.title") == "gptlab playground: " + HOSTILE
        assert browser.js("INFO.name") == HOSTILE and browser.js("document.scripts.length") == 2
        assert browser.js("document.getElementById('key-field').offsetParent !== null")  # shown
        for field, value in (("prompt", "é>"), ("max-tokens", 5), ("temperature", 0)):
            browser.js(f"document.getElementById('{field}').value = {json.dumps(str(value))}")
        click(browser, "#generate")
        wait_until(browser, "document.getElementById('output').dataset.state === 'error'")
        status = browser.js("document.getElementById('status').textContent")  # the server's 401, shown
        assert status.startswith("error: missing or wrong API key"), status
        browser.js("document.getElementById('api-key').value = 's3cret'")
        click(browser, "#generate")
        wait_until(browser, "document.getElementById('output').dataset.state === 'done'")
        assert browser.js(SPANS.format("#output .tok", "s.textContent")) == ["t", "h", "é", "."]
        assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.slow  # starts a headless Chromium
def test_playground_chat_mode_shows_the_reply_and_its_probabilities(tmp_path: Path,
                                                                     browser: Chromium) -> None:
    """Chat mode: a sent message gets the API's greedy reply, each token shaded by the API's probability;
    a second message continues the conversation; a click shows where the model looked in the chat."""
    from test_chat_cli import build_chat_run

    from gptlab.text.chat_template import NativeTemplate

    lm = load(build_chat_run(tmp_path / "chat"))

    model, tokenizer = lm.model, lm.tokenizer
    url, server, thread = start_server(create_app(LM.from_model(model, tokenizer), "chat"))
    try:
        browser.open(url + "/")
        click(browser, "#mode-chat")
        assert browser.js("document.getElementById('chat-panel').hidden") is False
        for field, value in (("max-tokens", 12), ("temperature", 0), ("system", "be brief")):
            browser.js(f"document.getElementById('{field}').value = {json.dumps(str(value))}")
        browser.js("document.getElementById('message').focus()")
        browser.call("Input.insertText", text="the cat")
        click(browser, "#generate")
        wait_until(browser, "document.getElementById('chat-log').dataset.state === 'done'")
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
        request = {"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
                   "top_logprobs": 5}
        api = httpx.post(f"{url}/v1/chat/completions", json=request).json()["choices"][0]
        shown = browser.js(SPANS.format("#chat-log .turn.assistant .tok", "s.textContent") + ".join('')")
        assert shown == api["message"]["content"]
        probs = browser.js(SPANS.format("#chat-log .tok", "Number(s.dataset.prob)"))
        starts = browser.js(SPANS.format("#chat-log .tok", "[Number(s.dataset.i), Number(s.dataset.pieces)]"))
        p = torch.tensor([e["logprob"] for e in api["logprobs"]["content"]]).exp()
        expected = torch.stack([p[i:i + n].prod() for i, n in starts])  # a character's pieces joined
        assert_close(torch.tensor(probs), expected, atol=1e-4, rtol=0)

        click(browser, "#chat-log .tok[data-i='0']")  # chosen after the rendered conversation
        wait_until(browser, "document.querySelectorAll('#attention span').length > 0")
        context = NativeTemplate().render(messages, add_generation_prompt=True)
        maps = attention_maps(model, tokenizer, context, tokenizer.encode(context), layer=0, head=0)
        weights = browser.js(SPANS.format("#attention span", "Number(s.dataset.weight)"))
        # The rendered conversation is ASCII: one span per token, its markers among them.
        assert_close(torch.tensor(weights, dtype=torch.float32), maps.weights[0, 0, -1], atol=1e-4, rtol=0)

        browser.js("document.getElementById('message').value = 'a dog'")
        click(browser, "#generate")
        wait_until(browser, "document.querySelectorAll('#chat-log .turn').length === 4 && "
                   "document.getElementById('chat-log').dataset.state === 'done'")
        follow = {**request, "messages": [*messages, {"role": "assistant", "content": shown},
                                          {"role": "user", "content": "a dog"}]}
        second = httpx.post(f"{url}/v1/chat/completions", json=follow).json()["choices"][0]["message"]
        replies = browser.js(SPANS.format("#chat-log .turn.assistant", "s.textContent"))
        assert replies == [shown, second["content"]]
        assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
