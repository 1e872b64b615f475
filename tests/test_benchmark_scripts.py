"""Every script in benchmarks/ still starts: its --help runs (nothing else imports these scripts, so a
module they import that moves or a name that goes would otherwise be found only by the next measurement)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.name)
def test_each_benchmark_answers_help(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")


def test_there_are_benchmarks_to_check() -> None:
    assert len(BENCHMARKS) >= 10
