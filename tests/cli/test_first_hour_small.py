"""Issue 42's small points of the first hour: `gptlab --version`, a mistaken flag refused by its command,
`compare --dry-run` without --out, and the README saying how to reach the `gptlab` in .venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gptlab
from gptlab.cli import main

ROOT = Path(__file__).resolve().parents[2]

VERSION_WITHOUT_TORCH = """
import sys
from gptlab.cli import main
print(main(["--version"]), "torch" in sys.modules)
"""


def test_version_prints_the_package_version_without_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"gptlab {gptlab.__version__}\n"
    out = subprocess.run([sys.executable, "-c", VERSION_WITHOUT_TORCH], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == [f"gptlab {gptlab.__version__}", "0 False"]


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What a command line that argparse refuses prints (it must exit 2, printing nothing on stdout)."""
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    return printed.err


def test_a_flag_the_lab_lacks_is_refused_by_the_lab_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(["lab", "--quick"], capsys)
    assert err == ("gptlab lab: error: unrecognized arguments: --quick "
                   "(gptlab lab takes no options, only --help)\n")
    assert "did you mean --lr?" in refusal(["train", "--lrr", "3e-3"], capsys)
    err = refusal(["seq2seq", "train", "--bogus"], capsys)  # a command of a command: that one answers
    assert err.startswith("gptlab seq2seq train: error: unrecognized arguments: --bogus (")
    assert len(err.splitlines()) == 1 and "usage: gptlab [-h]" not in err


@pytest.mark.slow
def test_a_dry_run_needs_no_out_and_training_still_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 200)
    grid = ["--preset", "tiny", "--data", "corpus.txt", "--vary", "norm=layernorm,rmsnorm", "--seeds", "1"]
    assert main(["compare", "--dry-run", *grid, "--jobs", "1"]) == 0
    assert "2 cell(s) x 1 seed(s) = 2 runs, 1 at a time" in capsys.readouterr().out
    assert main(["compare", *grid]) == 2
    assert "compare needs --out FOLDER" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # neither wrote anything


def test_the_readme_says_how_to_reach_gptlab_in_the_venv_right_after_the_setup() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = text.split("## Two commands on a fresh clone", 1)[1].split("\n## ", 1)[0]
    assert "make demo" in setup and "make test" in setup
    assert ". .venv/bin/activate" in setup and ".venv/bin/gptlab" in setup
