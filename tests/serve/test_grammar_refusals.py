"""Grammars the engine (llguidance) gives up on, through the server: never a 200 that is empty and says
"length". One that matches no text is a 400 naming the field before anything is queued; one the engine
gives up on while it runs is a 400 naming the field and the engine's reason when nothing was sent yet
(streamed or not), an error event ending a stream already under way, and logged either way. Choices past
the engine's parser limit (2,000 alternatives) work. Each test runs without and with speculative decoding."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

from test_chat_cli import build_chat_run  # noqa: E402
from test_engine_limits import NOTHING, SELF_REF, TOO_MANY  # noqa: E402
from test_serve import Live, start_server  # noqa: E402
from test_structured_serve import ASKED, complete  # noqa: E402

from gptlab.inference.loading import load  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.serve.schemas import Limits  # noqa: E402
from gptlab.speculative import SpeculationConfig  # noqa: E402

pytestmark = pytest.mark.slow  # a live server per case: each takes seconds

# The same limit met on the first token, and later: `{"n":"c` is written before "at" meets it.
FIRST = {"anyOf": [{"const": [i]} for i in range(2001)]}
LATER = {"type": "object", "properties": {"n": {"enum": ["cat", "mat"]}, "a": TOO_MANY["prefixItems"][1]},
         "required": ["n", "a"], "additionalProperties": False}


@pytest.fixture(scope="module", params=[None, SpeculationConfig()], ids=["plain", "speculative"])
def live(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Live]:
    """test_structured_serve's server: a random chat model of a few hundred BPE tokens."""
    app = create_app(load(build_chat_run(tmp_path_factory.mktemp("refusals"))), "chat", max_batch=8,
                     limits=Limits(max_tokens=512), speculation=request.param)
    url, server, thread = start_server(app)
    yield Live(url, app.state.served)
    server.should_exit = True
    thread.join(timeout=10)


def events(live: Live, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]], str]:
    """A streamed completion: its status, the JSON of each event, and the raw text."""
    with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60,
                      json={"prompt": "the cat", "max_tokens": 100, "stream": True, **body}) as reply:
        raw = reply.read().decode()
    data = [line[6:] for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return reply.status_code, [json.loads(d) for d in data], raw


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": NOTHING}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": SELF_REF}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REF}}},
     "response_format.json_schema.schema"),
])
def test_a_grammar_matching_no_text_is_a_400_before_anything_is_queued(live: Live, body: dict,
                                                                       param: str) -> None:
    admitted = live.served.scheduler.admitted
    reply = complete(live, **body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and "matches no text" in error["message"]
    assert live.served.scheduler.admitted == admitted


def test_the_engine_giving_up_at_the_first_token_is_a_400_naming_the_field(
        live: Live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gptlab.serve")
    whole = complete(live, max_tokens=50, structured_outputs={"json": FIRST})
    status, _, raw = events(live, {"structured_outputs": {"json": FIRST}})
    chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
        "messages": ASKED, "max_tokens": 50, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": FIRST}}})
    for reply, param in ((whole, "structured_outputs.json"), (chat, "response_format.json_schema.schema")):
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == param, error
        assert error["message"].startswith(f"{param}: the JSON schema: the grammar engine gave up after 0 "
                                           "tokens") and "max is 2000" in error["message"], error
    assert status == 400 and "max is 2000" in json.loads(raw)["error"]["message"]
    assert sum("max is 2000" in r.getMessage() for r in caplog.records) == 3


def test_a_stream_under_way_ends_with_an_error_event(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gptlab.serve")
    status, data, raw = events(live, {"structured_outputs": {"json": LATER}, "seed": 1})
    assert status == 200 and "data: [DONE]" not in raw
    assert "".join(d["choices"][0]["text"] for d in data[:-1]).startswith('{"n":"')
    assert all(d["choices"][0]["finish_reason"] is None for d in data[:-1])
    error = data[-1]["error"]
    assert error["param"] == "structured_outputs.json" and "max is 2000" in error["message"], error
    whole = complete(live, max_tokens=100, structured_outputs={"json": LATER})
    message = whole.json()["error"]["message"]
    assert whole.status_code == 400 and re.search(r"gave up after [1-9]\d* tokens", message), message
    assert sum("max is 2000" in r.getMessage() for r in caplog.records) == 2


def test_choices_past_the_parser_limit_work(live: Live) -> None:
    choices = [f"option {i}" for i in range(2500)]
    reply = complete(live, max_tokens=20, seed=2, structured_outputs={"choice": choices}).json()
    assert reply["choices"][0]["text"] in choices and reply["choices"][0]["finish_reason"] == "stop"
