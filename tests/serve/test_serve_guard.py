"""What other sites, other users and faults can do to `gptlab serve`: Content-Type and Host checks against
cross-site requests and DNS rebinding, the API key kept off the command line, generic 500s with a
request id, and a model's own sampling defaults. Real uvicorn servers on 127.0.0.1 (see test_serve)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve import NAME, Live, alone, start_server  # noqa: E402
from test_serve import live as live  # noqa: E402, F401  (the module's server fixture)

import gptlab.serve.app as app_module  # noqa: E402
from gptlab.cli import main  # noqa: E402
from gptlab.config import SamplingConfig  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.serve.guard import (  # noqa: E402
    LOOPBACK_NAMES,
    default_allowed_hosts,
    host_name,
    parse_allowed_hosts,
    read_api_key,
)

BODY = {"prompt": "a", "max_tokens": 2}


def test_only_json_bodies_are_read_so_a_cross_site_simple_post_is_refused(live: Live) -> None:
    url = f"{live.url}/v1/completions"
    # What a page on another site can send without a CORS preflight: text/plain (or a form), any body.
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {"Origin": "https://evil.example"}
        if content_type:
            headers["Content-Type"] = content_type
        reply = httpx.post(url, content=b'{"prompt": "a", "max_tokens": 2}', headers=headers)
        assert reply.status_code == 415, (content_type, reply.text)
        assert reply.json()["error"]["code"] == "unsupported_media_type"
        assert "access-control-allow-origin" not in reply.headers  # CORS stays closed
    with_charset = httpx.post(url, content=b'{"prompt": "a", "max_tokens": 2}',
                              headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert with_charset.status_code == 200 and with_charset.json()["usage"]["completion_tokens"] == 2
    preflight = httpx.options(url, headers={"Origin": "https://evil.example",
                                            "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.slow
def test_a_foreign_host_name_is_refused_on_loopback(live: Live) -> None:
    port = live.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.", ""):
        for reply in (httpx.post(f"{live.url}/v1/completions", json=BODY, headers={"Host": host}),
                      httpx.get(live.url, headers={"Host": host})):
            assert reply.status_code == 421, (host, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "invalid_host" and "--allowed-hosts" in error["message"]
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", "[::1]", f"[::1]:{port}"):
        reply = httpx.post(f"{live.url}/v1/completions", json=BODY, headers={"Host": host})
        assert reply.status_code == 200, (host, reply.text)


def test_which_hosts_each_address_answers_to() -> None:
    assert default_allowed_hosts("127.0.0.1") == LOOPBACK_NAMES == default_allowed_hosts("::1")
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("::") is None
    assert default_allowed_hosts("192.168.1.5") == {"192.168.1.5"}
    assert default_allowed_hosts("fe80::1") == {"[fe80::1]"}
    assert parse_allowed_hosts("Box.lan:8000, 10.0.0.2,[::1]:80") == {"box.lan", "10.0.0.2", "[::1]"}
    assert parse_allowed_hosts("*") is None
    with pytest.raises(ValueError, match="empty"):
        parse_allowed_hosts(" , ")
    assert [host_name(h) for h in ("a:1", "[::1]:2", "::1", "A")] == ["a", "[::1]", "::1", "a"]


def test_allowed_hosts_override_and_none_accepts_any(trained_run: Path) -> None:
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    cases = (({"box.lan"}, "localhost", "box.lan:80"), (None, None, "evil.example"))
    for allowed, refused, accepted in cases:
        app = create_app(LM.from_model(model, tokenizer), NAME, allowed_hosts=allowed)
        url, server, thread = start_server(app)
        try:
            assert httpx.get(f"{url}/v1/models", headers={"Host": accepted}).status_code == 200
            if refused:
                assert httpx.get(f"{url}/v1/models", headers={"Host": refused}).status_code == 421
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def test_api_key_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret \nsecond line\n")
    assert read_api_key(key_file, {"GPTLAB_API_KEY": "other"}) == "s3cret"  # the file, first line, stripped
    assert read_api_key(None, {"GPTLAB_API_KEY": "env-key"}) == "env-key"
    assert read_api_key(None, {}) is None
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty: write the key on its first line"):
        read_api_key(key_file, {})
    with pytest.raises(ValueError, match="cannot read it"):
        read_api_key(tmp_path / "missing", {})
    with pytest.raises(ValueError, match="set but empty"):
        read_api_key(None, {"GPTLAB_API_KEY": " "})


def test_the_command_line_refuses_a_key_in_its_arguments(trained_run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(trained_run), "--api-key", "s3cret", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "GPTLAB_API_KEY" in error and "--api-key-file" in error and len(error.strip().splitlines()) == 1
    (tmp_path / "empty").write_text("")
    assert main(["serve", str(trained_run), "--api-key-file", str(tmp_path / "empty"), "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is empty" in error


def test_an_internal_error_is_a_generic_500_with_a_logged_request_id(
        live: Live, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(served: object) -> dict:
        raise RuntimeError("secret detail of /home/user/model")

    monkeypatch.setattr(app_module, "model_card", broken)
    with caplog.at_level(logging.ERROR, logger="gptlab.serve"):
        reply = httpx.get(f"{live.url}/v1/models")
    assert reply.status_code == 500
    request_id = reply.headers["x-request-id"]
    assert request_id.startswith("req-")
    error = reply.json()["error"]
    assert error["message"] == f"internal error (request id {request_id})" and error["type"] == "server_error"
    assert "secret" not in reply.text and "RuntimeError" not in reply.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret detail" in "".join(logging.Formatter().formatException(r.exc_info)
                                                for r in logged if r.exc_info)
    monkeypatch.undo()
    assert httpx.get(f"{live.url}/v1/models").status_code == 200  # the server lives on


def test_sampling_defaults_fill_only_the_fields_a_request_leaves_out(trained_run: Path) -> None:
    lm = load(trained_run)
    # A run's defaults as an imported generation_config.json gives them: max_new_tokens is not a request
    # field's default (max_tokens stays OpenAI's), the sampling fields are.
    lm.defaults = {"temperature": 0.0, "top_k": 3, "max_new_tokens": 2}
    app = create_app(lm, NAME)
    url, server, thread = start_server(app)
    served = Live(url, app.state.served)
    try:
        unset = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 12, "seed": 3})
        greedy, _ = alone(served, "the cat", SamplingConfig(temperature=0.0, top_k=3, max_new_tokens=12))
        assert unset.json()["choices"][0]["text"] == greedy
        given = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 12, "seed": 3,
                                                          "temperature": 1.0, "top_k": None})
        sampled, _ = alone(served, "the cat", SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3))
        assert given.json()["choices"][0]["text"] == sampled and sampled != greedy
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_lone_surrogates_and_deep_nesting_are_400s_naming_the_field(live: Live) -> None:
    def post(path: str, body: bytes) -> httpx.Response:
        return httpx.post(f"{live.url}{path}", content=body, headers={"Content-Type": "application/json"})

    cases = [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["a", "\\udfffb"], "max_tokens": 2}', "prompt[1]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages[0].content[0].text"),
        ("/v1/attention", b'{"text": "a\\ud800b"}', "text"),
        ("/v1/attention", b'{"text": "a", "messages": [{"role": "user", "content": "\\udc00"}]}',
         "messages[0].content"),
        ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "stop": ["x", "\\ud800"]}', "stop[1]"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "user": "\\ud800"}', "user"),
        ("/v1/completions", b'{"prompt": "a", "x\\ud800": 1}', None),
    ]
    for path, body, param in cases:
        reply = post(path, body)
        assert reply.status_code == 400, (path, body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_text", (path, error)
        assert error["type"] == "invalid_request_error" and (param or "the body") in error["message"]
    pair = post("/v1/completions", b'{"prompt": "a\\ud83d\\ude00", "max_tokens": 1}')  # a proper pair: 😀
    assert pair.status_code != 500, pair.text
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/attention"):
        for n in (100_000, 5000, 100):  # past the decoder's recursion limit, and within it
            deep = b"{\"prompt\": " + b"[" * n + b"]" * n + b"}"
            reply = post(path, deep)
            assert reply.status_code == 400, (path, reply.text[:200])
            assert reply.json()["error"]["code"] == "too_deep"
