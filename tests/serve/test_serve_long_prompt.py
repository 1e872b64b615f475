"""A prompt longer than the context window: `gptlab serve` refuses it with a 400 naming the window, as
OpenAI's API does, where `gptlab sample` reads its end after a note
(tests/cli/test_long_prompts_and_samples.py)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve import Live  # noqa: E402
from test_serve import live as live  # noqa: E402, F401  (the module's server fixture)

LONG = "the cat sat on the mat. a dog sat on the rug. "  # 46 characters: past trained_run's window of 24


def test_a_prompt_past_the_window_is_a_400_naming_the_window(live: Live) -> None:
    reply = httpx.post(f"{live.url}/v1/completions", json={"prompt": LONG, "max_tokens": 2})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert error["message"] == ("prompt is 46 tokens long; this model's context window is 24 tokens: "
                                "shorten it")
    fits = httpx.post(f"{live.url}/v1/completions", json={"prompt": LONG[-24:], "max_tokens": 2})
    assert fits.status_code == 200
