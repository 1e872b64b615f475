"""Issue 39 point 5: `gptlab check`'s offline page, one per learner file.

The page of the gallery's reference and of its no-mask bug: self-contained (nothing fetched), one row
per check, the learner's attention weights beside the handout's, and each block's dependence matrix
with a leak from the future outlined and its first block named (none for the reference). The pictures
travel as JSON, as they will from the check process. A real headless Chromium renders the page.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch.testing import assert_close

from gptlab.handout.learner import bugs
from gptlab.handout.learner.build import build, sizes
from gptlab.handout.learner.grade import grade
from gptlab.handout.learner.isolate import FileReport
from gptlab.handout.learner.page import Pictures, leaking_blocks, pictures_for, write_page

if TYPE_CHECKING:
    from browser import Chromium

pytestmark = pytest.mark.usefixtures("one_thread")

FETCHED = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.IGNORECASE)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _checked(name: str, folder: Path) -> tuple[FileReport, Pictures]:
    """Grade the gallery's file `name` (reference or a bug) and compute its pictures, sent through JSON."""
    path = folder / f"page_{name.replace('-', '_')}.py"
    bugs.write_reference(path) if name == "reference" else bugs.write_bug(name, path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    namespace: dict[str, Any] = vars(module)
    checks = grade(namespace)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build(namespace["GPT"], "GPT", sizes(16, 2), namespace)
    pictures = pictures_for(namespace["attention"], model, namespace["Block"])
    return FileReport(path, checks), Pictures.from_record(json.loads(json.dumps(pictures.record())))


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[FileReport, Pictures, Path]]:
    """The reference's and the no-mask bug's report, pictures and page."""
    folder = tmp_path_factory.mktemp("check-page")
    found = {}
    for name in ("reference", "no-mask"):
        report, pictures = _checked(name, folder)
        found[name] = (report, pictures, write_page(report, folder / "pages", pictures))
    return found


def test_the_page_is_self_contained_with_one_row_per_check(pages: dict) -> None:
    for report, _, page in pages.values():
        text = page.read_text(encoding="utf-8")
        assert page.name == f"{report.path.stem}.html"
        assert not FETCHED.search(text) and "http" not in text and "url(" not in text  # nothing to fetch
        assert text.count('<tr class="check ') == len(report.checks) > 30
        for verdict, word in ((True, "pass"), (False, "fail"), (None, "skip")):
            assert text.count(f'<tr class="check {word}">') == sum(c.passed is verdict for c in report.checks)


def test_the_reference_shows_its_weights_and_no_leak(pages: dict) -> None:
    report, pictures, page = pages["reference"]
    text = page.read_text(encoding="utf-8")
    assert [c for c in report.checks if c.passed is False] == []
    assert pictures.attention[0].learner[0] == pytest.approx([0.5, 0.25, 0.25], abs=1e-6)
    for pair in pictures.attention:
        assert_close(torch.tensor(pair.learner), torch.tensor(pair.reference), atol=1e-5, rtol=0)
    assert len(pictures.blocks) == 2 and leaking_blocks(pictures) == []
    assert 'class="leak"' not in text and "no block lets output row i read an input row j &gt; i" in text
    assert text.count('class="future"') == 2 * 28  # the 8 x 8 matrices' cells above the diagonal, all 0


def test_a_missing_mask_is_outlined_in_every_block_beside_its_failures(pages: dict) -> None:
    report, pictures, page = pages["no-mask"]
    text = page.read_text(encoding="utf-8")
    assert leaking_blocks(pictures) == [0, 1]
    assert "first leak from the future: block 0" in text and text.count('class="leak"') > 28
    failed = [row for row in text.split('<tr class="check ')[1:] if row.startswith("fail")]
    assert len(failed) == sum(c.passed is False for c in report.checks) > 0
    assert all('<svg class="heatmap"' in row and 'class="leak"' in row for row in failed)


def test_a_file_that_could_not_be_checked_gets_its_error_and_no_pictures(tmp_path: Path) -> None:
    report = FileReport(tmp_path / "broken.py", [], "broken.py: SyntaxError <here> & there", "Traceback ...")
    text = write_page(report, tmp_path).read_text(encoding="utf-8")
    assert "ERROR broken.py: SyntaxError &lt;here&gt; &amp; there" in text and "Traceback ..." in text
    assert "<svg" not in text and '<tr class="check ' not in text


def test_pictures_from_the_check_process_must_be_matrices() -> None:
    with pytest.raises(ValueError, match="rows of different lengths"):
        Pictures.from_record({"attention": [], "blocks": [[[0.0, 1.0], [2.0]]]})
    with pytest.raises(ValueError, match="not a list of rows"):
        Pictures.from_record({"attention": [], "blocks": ["rm -rf"]})
    assert Pictures.from_record(Pictures().record()) == Pictures()


@pytest.mark.slow  # starts a headless Chromium
def test_the_page_renders_in_headless_chromium_with_nothing_fetched(pages: dict, browser: Chromium) -> None:
    report, _, page = pages["no-mask"]
    browser.open(page)
    assert browser.js("document.querySelectorAll('tr.check').length") == len(report.checks)
    fetching = "[src], [href], link, script, img, iframe, object, embed, image, use"
    assert browser.js(f"document.querySelectorAll('{fetching}').length") == 0  # nothing to fetch
    sizes = browser.js("Array.from(document.querySelectorAll('svg.heatmap')).map(s => "
                       "[s.getBoundingClientRect().width, s.getBoundingClientRect().height])")
    assert len(sizes) > 4 and all(width > 0 and height > 0 for width, height in sizes)
    leaks = browser.js("Array.from(document.querySelectorAll('#blocks rect.leak')).map(r => "
                       "getComputedStyle(r).stroke)")
    assert leaks and set(leaks) == {"rgb(207, 34, 46)"}  # outlined red
    problems = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"
                or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") == "error")]
    assert problems == []
    screenshot = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
    assert base64.b64decode(screenshot)[:8] == PNG_SIGNATURE  # the page rendered
