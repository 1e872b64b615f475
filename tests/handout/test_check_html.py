"""`gptlab check --html DIR`: one offline page per file, drawn in the parent from the numbers the child
measured (issue 39, point 5). The page itself is tested in test_check_page.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.handout.learner.bugs import write_bug, write_reference


@pytest.mark.slow  # three checks through the server
def test_html_writes_a_page_per_file_with_the_leak_marked(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    bugged = write_bug("no-mask", tmp_path / "no_mask.py")
    correct = write_reference(tmp_path / "reference.py")
    pages = tmp_path / "pages"
    assert main(["check", str(bugged), str(correct), "--html", str(pages), "--jobs", "2"]) == 1
    learned = capsys.readouterr().out
    assert "PASS  §7.2" in learned
    assert f"wrote 2 pages to {pages}" in learned
    assert main(["check", str(correct), "--no-learning"]) == 0
    assert "§7.2" not in capsys.readouterr().out
    leaky, clean = (pages / "no_mask.html").read_text(), (pages / "reference.html").read_text()
    assert 'class="leak"' in leaky and 'class="leak"' not in clean
    for page in (leaky, clean):
        assert "<svg" in page and "http://" not in page and "https://" not in page
