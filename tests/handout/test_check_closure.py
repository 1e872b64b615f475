"""What a submission sees of its folder under `gptlab check`: its own local import closure (the modules
and packages it imports, found from its import statements), never a classmate's file, whether read by a
relative path, through $PWD or imported."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.handout.learner.bugs import write_reference
from gptlab.handout.learner.closure import local_imports
from gptlab.handout.learner.grade import Names
from gptlab.handout.learner.isolate import check_file

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the isolation is tested on POSIX")

CHEATS = {  # five lines or fewer that take the next file's implementation
    "a relative path": 'exec(open("b_honest.py").read())\n',
    "$PWD": 'import os\nexec(open(os.path.join(os.environ["PWD"], "submissions", "b_honest.py")).read())\n',
}


def grades(path: Path) -> dict[str, tuple[str, str]]:
    """File name -> (score, error) of a --csv file."""
    with path.open(newline="", encoding="utf-8") as handle:
        return {Path(row["file"]).name: (row["score"], row["error"]) for row in csv.DictReader(handle)}


@pytest.mark.slow  # the command end to end: a server and two children
@pytest.mark.parametrize("way", list(CHEATS))
def test_a_submission_cannot_take_a_classmates_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    way: str) -> None:
    folder = tmp_path / "submissions"
    folder.mkdir()
    write_reference(folder / "b_honest.py")
    cheat = folder / "a_cheat.py"
    cheat.write_text(CHEATS[way], encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))  # as a shell sets it: the folder the course grades in
    assert main(["check", "submissions/a_cheat.py", "submissions/b_honest.py", "--csv", "grades.csv",
                 "--no-learning", "--timeout", "120"]) == 1
    graded = grades(tmp_path / "grades.csv")
    assert graded["b_honest.py"] == ("100.0", "")
    score, error = graded[cheat.name]
    assert score == "0.0" and error.startswith("submissions/a_cheat.py: import failed"), error


PACKAGE = {  # a learner's file over a package of their own, as CS336's cs336_basics/ or minGPT's mingpt/
    "student.py": "from cs336_basics import attention\n",
    "cs336_basics/__init__.py": "from .model import attention\n",
    "cs336_basics/model.py": "from cs336_basics.nn_utils import softmax\nfrom scaling import scale\n\n"
                             "def attention(q, k, v):\n"
                             "    weights = softmax(q @ k.transpose(-2, -1) / scale(q.size(-1)))\n"
                             "    return weights @ v, weights\n",
    "cs336_basics/nn_utils.py": "def softmax(x):\n    return x.softmax(dim=-1)\n",
    "scaling.py": "import math\n\ndef scale(d):\n    return math.sqrt(d)\n",
}


@pytest.mark.slow  # one child, and the server's start when it is the first
def test_a_submission_laid_out_as_a_package_imports_it(tmp_path: Path) -> None:
    for name, text in PACKAGE.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    report = check_file(tmp_path / "student.py", Names(), timeout_s=120, learning=False)
    assert report.error is None, report.error
    assert [c for c in report.checks if c.passed] and not [c for c in report.checks if c.passed is False]


@pytest.mark.slow  # the command end to end: a server and a child
def test_a_submission_importing_another_of_the_batch_is_one_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    honest = write_reference(tmp_path / "b_honest.py")
    copier = tmp_path / "a_copier.py"
    copier.write_text("from b_honest import *  # noqa\n", encoding="utf-8")
    assert main(["check", str(copier), str(honest), "--no-learning", "--timeout", "120"]) == 1
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].startswith(f"  ERROR {copier}: ") and str(honest) in errors[0], out
    assert "1 of 2 files passed" in out


def test_the_closure_is_what_the_file_imports_and_nothing_else(tmp_path: Path) -> None:
    tree = {
        **PACKAGE,
        "student.py": PACKAGE["student.py"] + "import os, math\nimport notes.ideas\n\n"
                                              "def later():\n    from tools import helper  # noqa\n",
        "cs336_basics/unused.py": "import classmate\n",  # in the package, but imported by nothing
        "notes/ideas.py": "from . import sketch\n",  # a namespace package: a folder, no __init__.py
        "notes/sketch.py": "",
        "tools/__init__.py": "from .helper import *  # noqa\n",
        "tools/helper.py": "from ..scaling import scale  # above the top package: left out\n",
        "classmate.py": "secret = 42\n",
        "math.py": "",  # a local file named like the standard library's: Python would import it too
        "broken.py": "def (\n",
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    found = {str(path.relative_to(tmp_path)) for path in local_imports(tmp_path / "student.py")}
    assert found == {"cs336_basics/__init__.py", "cs336_basics/model.py", "cs336_basics/nn_utils.py",
                     "scaling.py", "notes", "notes/ideas.py", "notes/sketch.py", "tools/__init__.py",
                     "tools/helper.py", "math.py"}
    assert local_imports(tmp_path / "broken.py") == set()
