"""The files `gptlab check` writes beside its report, and what it may replace: the CSV of grades and the
pages. The rule of every command that writes (docs/train.md): what the command wrote before (a CSV with
its header, a page with its `generator` tag) is written again, so the same command twice just works;
anything else is refused before any check runs. The CSV is rewritten whole, atomically, as each file is
graded, so whatever ends the command (a crash, SIGTERM, kill -9) it holds every file graded so far.
Torch-free, so that the command refuses before it starts its check server."""

from __future__ import annotations

import csv
import io
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gptlab.files import atomic_write

CSV_COLUMNS = ("file", "passed", "failed", "skipped", "score", "error")


def page_file(folder: Path, learner_file: Path) -> Path:
    """Where the page of `learner_file` goes in `folder`: NAME.html, NAME the file's stem."""
    return folder / f"{learner_file.stem}.html"


def grades_written_by_check(path: Path) -> bool:
    """Whether the existing file `path` is a CSV of grades that gptlab check wrote (its header row first)."""
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            return handle.readline().rstrip("\r\n") == ",".join(CSV_COLUMNS)
    except (OSError, UnicodeDecodeError):
        return False


class GradesCsv:
    """The CSV of a batch's grades: the header at once, then every row in the files' order, the file
    rewritten atomically as each row comes (from any thread), so it never holds half a row."""

    def __init__(self, path: Path, files: int) -> None:
        self.path = path
        self._rows: list[Mapping[str, Any] | None] = [None] * files
        self._lock = threading.Lock()
        self._write()

    def add(self, index: int, row: Mapping[str, Any]) -> None:
        """The row of the batch's file number `index` (counted from 0), written at once."""
        with self._lock:
            self._rows[index] = row
            self._write()

    def _write(self) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(row for row in self._rows if row is not None)
        atomic_write(self.path, lambda tmp: tmp.write_text(text.getvalue(), encoding="utf-8", newline=""))
