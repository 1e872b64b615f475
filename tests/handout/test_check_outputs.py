"""`gptlab check --html DIR` and `--csv FILE` follow the rule of every command that writes (docs/train.md):
refuse what the command did not write, up front, before any check runs and with nothing written; write
again what it did, so the same command twice just works. The checks are stubbed: these are the
command's own decisions."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.files import HTML_MARK
from gptlab.handout.learner import isolate, server
from gptlab.handout.learner.bugs import write_reference
from gptlab.handout.learner.grade import Names
from gptlab.handout.learner.isolate import FileReport
from gptlab.handout.properties import Check


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files `gptlab check` checks, each given one passing check (no server, no child)."""
    seen: list[Path] = []

    def stub(path: Path, names: Names, timeout_s: float, memory_mb: int, **_: Any) -> FileReport:
        seen.append(path)
        return FileReport(path, [Check("§2.1", "retrieval", True)])

    monkeypatch.setattr(isolate, "check_file", stub)
    monkeypatch.setattr(server, "FORK_SERVER", False)
    return seen


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def test_html_refuses_a_page_it_did_not_write(tmp_path: Path, checked: list[Path],
                                              capsys: pytest.CaptureFixture) -> None:
    learner = write_reference(tmp_path / "ref.py")
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "ref.html").write_text("<p>my notes on the reference</p>\n", encoding="utf-8")
    before = snapshot(tmp_path)
    assert main(["check", str(learner), "--html", str(pages)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"gptlab: error: --html {pages}: {pages / 'ref.html'} exists")
    assert checked == [] and snapshot(tmp_path) == before


def test_html_writes_its_own_pages_again(tmp_path: Path, checked: list[Path],
                                         capsys: pytest.CaptureFixture) -> None:
    learner = write_reference(tmp_path / "ref.py")
    pages = tmp_path / "pages"
    for _ in range(2):
        assert main(["check", str(learner), "--html", str(pages)]) == 0
        assert f"wrote 1 page to {pages}" in capsys.readouterr().out
    assert HTML_MARK in (pages / "ref.html").read_text(encoding="utf-8")
    assert checked == [learner, learner]


def test_html_given_a_file_is_refused_before_any_check(tmp_path: Path, checked: list[Path],
                                                       capsys: pytest.CaptureFixture) -> None:
    learner = write_reference(tmp_path / "ref.py")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n", encoding="utf-8")
    assert main(["check", str(learner), "--html", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gptlab: error: argument --html: {notes} is a file")
    assert checked == [] and notes.read_text(encoding="utf-8") == "not a folder\n"


@pytest.mark.parametrize("kind", ["folder", "notes"])
def test_csv_that_is_a_folder_or_not_its_own_is_refused_before_any_check(
        tmp_path: Path, checked: list[Path], capsys: pytest.CaptureFixture, kind: str) -> None:
    learner = write_reference(tmp_path / "ref.py")
    grades = tmp_path / "grades.csv"
    if kind == "folder":
        grades.mkdir()
    else:
        grades.write_text("student,grade\nada,A\n", encoding="utf-8")
    before = snapshot(tmp_path)
    assert main(["check", str(learner), "--csv", str(grades)]) == 2
    err = capsys.readouterr().err
    named = f"argument --csv: {grades} is a folder" if kind == "folder" else f"--csv {grades}"
    assert err.count("\n") == 1 and err.startswith(f"gptlab: error: {named}")
    assert checked == [] and snapshot(tmp_path) == before and grades.is_dir() == (kind == "folder")


def test_csv_it_wrote_is_written_again(tmp_path: Path, checked: list[Path]) -> None:
    learner = write_reference(tmp_path / "ref.py")
    grades = tmp_path / "grades.csv"
    for _ in range(2):
        assert main(["check", str(learner), "--csv", str(grades)]) == 0
    with grades.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["file"], row["score"]) for row in rows] == [(str(learner), "100.0")]
