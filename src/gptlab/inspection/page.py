"""The HTML page of `gptlab attention FILE.html`: one file with its style, script and data inline.

Nothing is fetched (no CDN, no fonts, no network), so the page works offline and from an e-mail.
The page is built from the package data files static/attention.html, .css and .js (the style and
script are inlined into the HTML's __STYLE__ and __SCRIPT__ slots here).
`attention_view.save_attention_html` fills __TITLE__ (escaped text) and __DATA__ (JSON with every "<"
escaped): the prompt, token labels, the layers and heads shown, their weights (L', H', T, T) and the
top next-token predictions at each position. The element ids (layer, head, map, tokens, focus,
predictions) are what the browser test drives.
"""

from __future__ import annotations

import re
from importlib.resources import files


def static_text(filename: str, closing: str | None) -> str:
    """A file of static/, checked not to hold the tag that would close its element early."""
    text = (files("gptlab.inspection") / "static" / filename).read_text(encoding="utf-8")
    assert closing is None or closing not in text.lower(), f"static/{filename} holds {closing}"
    return text


def attention_page() -> str:
    """The page template with its style and script inlined; __TITLE__ and __DATA__ are left to fill."""
    slots = {"STYLE": static_text("attention.css", "</style"),
             "SCRIPT": static_text("attention.js", "</script")}
    # One pass: the style and script are never scanned for slots again.
    return re.sub("__(STYLE|SCRIPT)__", lambda m: slots[m.group(1)], static_text("attention.html", None))


PAGE = attention_page()
