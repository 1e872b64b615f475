"""Attention maps (handout §2.2): the maps are the model's own weights and predictions, drawn as PNG grids
and as an offline HTML page whose controls are driven in a real headless Chromium."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gptlab.cli import main
from gptlab.inference.loading import load
from gptlab.inspection.attention_view import attention_maps, save_attention_html
from gptlab.inspection.tokens import token_label
from gptlab.text.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from browser import Chromium

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the cat sat on"  # in the characters of conftest's INSPECT_TEXT, which `trained_run` learned
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_attention_maps_are_the_models_weights_and_predictions(trained_run: Path,
                                                               written_out_attention: Any) -> None:
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    ids = tokenizer.encode(PROMPT)
    idx = torch.tensor([ids])
    maps = attention_maps(model, tokenizer, PROMPT, ids, layer=1, head=0)
    assert (maps.layers, maps.heads, maps.labels[:4]) == ([1], [0], ["t", "h", "e", "\u2423"])
    x = model.transformer.h[1].ln_1(model.transformer.h[0](model.embed(idx)))  # layer 1's attention input
    assert_close(maps.weights[0, 0], written_out_attention(model, 1, x)[1][0, 0])
    assert_close(maps.probs, F.softmax(model(idx)[0][0], dim=-1))
    with pytest.raises(ValueError, match=r"^head 2 does not exist: the model has 2, numbered 0\.\.1"):
        attention_maps(model, tokenizer, PROMPT, ids, head=2)


@pytest.mark.slow
def test_attention_png_grid_and_single_map_are_valid_images(trained_run: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    grid, single = tmp_path / "grid.png", tmp_path / "single.png"
    assert main(["attention", str(trained_run), "--prompt", PROMPT, "--out", str(grid)]) == 0
    assert main(["attention", str(trained_run), "--prompt", PROMPT, "--out", str(single), "--layer", "1",
                 "--head", "0"]) == 0
    assert grid.read_bytes()[:8] == single.read_bytes()[:8] == PNG_SIGNATURE
    pixels, one = imread(grid), imread(single)
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    assert pixels.shape[0] > one.shape[0] and pixels.shape[1] > one.shape[1]  # 2 x 2 maps against 1
    assert pixels[..., :3].std() > 0.05  # something is drawn


def test_html_page_is_self_contained_and_escapes_its_data(tmp_path: Path, random_gpt: Any) -> None:
    model, tokenizer = random_gpt(vocab_size=256, block_size=32), ByteTokenizer()
    prompt = '</script><b>"x"\n</b>'
    ids = tokenizer.encode(prompt)
    maps = attention_maps(model, tokenizer, prompt, ids)
    page = tmp_path / "page.html"
    save_attention_html(maps, tokenizer, page)
    text = page.read_text(encoding="utf-8")
    assert text.count("</script>") == 2  # the data block's and the code's: the prompt's own is escaped
    assert not re.search(r"https?://|<link|\bsrc=|@import|url\(", text)  # nothing to fetch
    inline = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
    data = json.loads(inline.group(1))
    assert data["labels"] == maps.labels and data["labels"][-5] == "\\n"
    assert_close(torch.tensor(data["weights"]), maps.weights, atol=5e-5, rtol=0)
    assert [row[0][0] for row in data["predictions"]] == [token_label(tokenizer, int(t)) for t in
                                                         maps.probs.argmax(-1)]


ROW = ("Array.from(document.querySelectorAll('#map tbody tr')[{}].cells).slice(1)"
       ".map(c => Number(c.dataset.weight))")  # one query's weights as the map shows them
SHOWN = "[document.getElementById('map').dataset.layer, document.getElementById('map').dataset.head]"


@pytest.mark.slow  # starts a headless Chromium
def test_html_page_controls_change_the_head_in_headless_chromium(trained_run: Path, tmp_path: Path,
                                                                 browser: Chromium) -> None:
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    ids = tokenizer.encode(PROMPT)
    maps = attention_maps(model, tokenizer, PROMPT, ids)
    page = tmp_path / "attention.html"
    save_attention_html(maps, tokenizer, page)
    browser.open(page)
    last = len(ids) - 1
    assert browser.js(SHOWN) == ["0", "0"]
    assert_close(torch.tensor(browser.js(ROW.format(last))), maps.weights[0, 0, last], atol=1e-4, rtol=0)
    browser.press("#head", "ArrowDown")  # the next head, picked with the keyboard
    assert browser.js(SHOWN) == ["0", "1"]
    assert_close(torch.tensor(browser.js(ROW.format(last))), maps.weights[0, 1, last], atol=1e-4, rtol=0)
    browser.press("#layer", "ArrowDown")
    assert browser.js(SHOWN) == ["1", "1"]
    assert_close(torch.tensor(browser.js(ROW.format(2))), maps.weights[1, 1, 2], atol=1e-4, rtol=0)
    assert not torch.allclose(maps.weights[1, 1], maps.weights[0, 0], atol=1e-3)  # so the change shows
    browser.hover("#tokens span[data-pos='4']")  # the "c" of "cat"
    assert browser.js("document.getElementById('focus').textContent").startswith("position 4 (c) attends")
    shown = browser.js("Array.from(document.querySelectorAll('#predictions li')).map(li => li.textContent)")
    top = maps.probs[4].topk(len(shown))
    assert shown == [f"{token_label(tokenizer, int(t))}  {100 * float(p):.1f}%"
                     for p, t in zip(top.values, top.indices, strict=True)]
    strip = browser.js("Array.from(document.querySelectorAll('#tokens span')).map(s => s.title)")
    assert strip[:5] == [f"weight {float(w):.4f}" for w in maps.weights[1, 1, 4, :5]]
    assert not [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    screenshot = browser.call("Page.captureScreenshot", format="png")["data"]
    assert base64.b64decode(screenshot)[:8] == PNG_SIGNATURE  # the page rendered



def test_attention_command_refuses_unknown_formats(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["attention", str(trained_run), "--prompt", PROMPT, "--out", "map.svg"]) == 2
    assert "--out map.svg must end in .png (a picture) or .html" in capsys.readouterr().err

