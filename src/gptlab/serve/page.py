"""The playground page served at `/`: one self-contained HTML response (inline style and script, no fetches
but the server's own API), built from the package data files in `static/`.

The page itself (static/playground.html, .css, .js) has two modes: completion streams `/v1/completions`,
chat keeps a conversation and streams `/v1/chat/completions`; both ask for the five likeliest tokens,
shade every token by its probability, and on a click list the alternatives and ask `/v1/attention`
where the query that chose the token attends (in chat, over the rendered conversation). This file only
fills in the per-server values, each escaped for where it goes.
"""

from __future__ import annotations

import html
import json
import re
from functools import cache
from importlib.resources import files

from gptlab.config import ModelConfig


def playground(config: ModelConfig, name: str, max_tokens: int, needs_key: bool,
               chat_refusal: str | None = None) -> str:
    """The page for a model of this shape; `needs_key` shows the API-key field; `chat_refusal` says why
    the chat mode is off (None: it is on)."""
    info = {"name": name, "n_layer": config.n_layer, "n_head": config.n_head,
            "block_size": config.block_size, "max_tokens": max_tokens}
    note = "" if chat_refusal is None else html.escape(f"chat is off: {chat_refusal}")
    slots = {"NAME": html.escape(name), "HIDE_KEY": "" if needs_key else "hidden", "INFO": script_json(info),
             "CHAT_NOTE": note,
             "STYLE": static_text("playground.css", "</style"),
             "SCRIPT": static_text("playground.js", "</script")}
    pattern = "__(" + "|".join(slots) + ")__"
    # One pass: what a slot is filled with (the script, a model's name) is never scanned for slots again.
    return re.sub(pattern, lambda m: slots[m.group(1)], static_text("playground.html", None))


def script_json(value: object) -> str:
    """JSON to put inside a <script> element: no "<" is left, so no "</script>" or "<!--" can end it."""
    return json.dumps(value).replace("<", "\\u003c")


@cache
def static_text(filename: str, closing: str | None) -> str:
    """A file of static/ (read once per process), checked not to hold the tag that would close it early."""
    text = (files("gptlab.serve") / "static" / filename).read_text(encoding="utf-8")
    assert closing is None or closing not in text.lower(), f"static/{filename} holds {closing}"
    return text
