"""`gptlab check` and `gptlab break` from the outside: the learner's file runs in a child process with
limits, every failure of it is one line naming the file, and the reports (text, JSON, Gradescope, CSV)
say what the checks found. The checks themselves are tested in test_grade.py, the gallery in
test_break.py."""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.handout.learner import child, isolate
from gptlab.handout.learner.child import import_and_grade
from gptlab.handout.learner.formats import csv_rows, gradescope_results, json_records, text_lines
from gptlab.handout.learner.grade import LearnerError, Names
from gptlab.handout.learner.isolate import FileReport, check_file
from gptlab.handout.properties import Check

# A correct attention in a learner's own style (einsum, the mask keeps where True), and the classic
# wrong-axis softmax: the rows then sum to one over the queries, not the keys (§3.2).
CORRECT = '''\
import math
import torch

def attention(q, k, v, mask=None):
    scores = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ v, weights
'''
WRONG_AXIS = CORRECT.replace("softmax(dim=-1)", "softmax(dim=-2)")

# Gradescope's results.json fields and their values, from its autograder specification
# (https://gradescope-autograders.readthedocs.io/en/latest/specs/, "Output format").
GRADESCOPE_TOP = {"score", "execution_time", "output", "output_format", "test_output_format",
                  "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests", "leaderboard"}
GRADESCOPE_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output", "output_format",
                   "tags", "visibility", "extra_data"}
GRADESCOPE_VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


def assert_gradescope(results: dict[str, Any]) -> None:
    """results holds only fields of Gradescope's format, with values of the kinds it names."""
    assert set(results) <= GRADESCOPE_TOP, set(results) - GRADESCOPE_TOP
    assert isinstance(results["tests"], list) and results["tests"]
    for test in results["tests"]:
        assert set(test) <= GRADESCOPE_TEST, set(test) - GRADESCOPE_TEST
        assert isinstance(test["name"], str) and isinstance(test["output"], str)
        assert isinstance(test["score"], float) and isinstance(test["max_score"], float)
        assert 0 <= test["score"] <= test["max_score"]
        assert test["status"] == ("passed" if test["score"] == test["max_score"] else "failed")
        assert test["visibility"] in GRADESCOPE_VISIBILITY
    assert results["visibility"] in GRADESCOPE_VISIBILITY
    assert results["score"] == sum(test["score"] for test in results["tests"])  # "overrides total of tests"


def learner_file(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


ROWS = Check("§3.2", "attention rows sum to one", False, "1 for every row (max |diff| <= 1e-06)",
             "[0.5, 1.5] (max |diff| = 5.0e-01)", 0.5, 1e-6, cause="softmax over the wrong axis: use dim=-1")
RETRIEVAL = Check("§2.1", "retrieval output y", True, "[2.000000, 1.500000] (max |diff| <= 1e-06)",
                  "[2.000000, 1.500000] (max |diff| = 0.0e+00)", 0.0, 1e-6)
FUSED = Check("§4.2", "fused = separate projections", None, note="no weights to read: nn.MultiheadAttention")


# ---------------------------------------------------------------------------------------------
# Reports, from hand-made results


def test_text_report_is_one_line_per_check_and_verbose_adds_the_numbers() -> None:
    report = FileReport(Path("mine.py"), [RETRIEVAL, ROWS, FUSED])
    assert text_lines(report) == [
        "mine.py",
        "  PASS  §2.1  retrieval output y",
        "  FAIL  §3.2  attention rows sum to one: expected 1 for every row (max |diff| <= 1e-06), measured "
        "[0.5, 1.5] (max |diff| = 5.0e-01); likely cause: softmax over the wrong axis: use dim=-1",
        "  SKIP  §4.2  fused = separate projections: no weights to read: nn.MultiheadAttention",
        "  1 passed, 1 failed, 1 skipped",
    ]
    verbose = text_lines(report, verbose=True)
    assert verbose[2:4] == ["        expected [2.000000, 1.500000] (max |diff| <= 1e-06); computed "
                            "[2.000000, 1.500000] (max |diff| = 0.0e+00)",
                            "        measured deviation 0 (tolerance 1e-06)"]
    assert "        measured deviation 0.5 (tolerance 1e-06)" in verbose


def test_an_error_is_one_line_and_verbose_adds_the_learners_traceback() -> None:
    trace = 'Traceback (frames in mine.py only):\n  File "mine.py", line 3\nNameError: torh\n'
    report = FileReport(Path("mine.py"), [], "mine.py: import failed at line 3: NameError: torh", trace)
    assert text_lines(report) == ["mine.py", "  ERROR mine.py: import failed at line 3: NameError: torh"]
    assert text_lines(report, verbose=True)[2:] == ["    Traceback (frames in mine.py only):",
                                                    '      File "mine.py", line 3', "    NameError: torh"]


def test_gradescope_results_follow_the_format_and_never_score_a_skip() -> None:
    good = FileReport(Path("a/mine.py"), [RETRIEVAL, ROWS, FUSED])
    broken = FileReport(Path("b/mine.py"), [], "b/mine.py: syntax error at line 2: invalid syntax", "x = (\n")
    one = gradescope_results([good])
    assert_gradescope(one)
    assert [(t["name"], t["score"], t["status"]) for t in one["tests"]] == [
        ("§2.1 retrieval output y", 1.0, "passed"), ("§3.2 attention rows sum to one", 0.0, "failed")]
    assert "likely cause: softmax over the wrong axis" in one["tests"][1]["output"]
    assert "§4.2 fused = separate projections: no weights to read" in one["output"]
    both = gradescope_results([good, broken])
    assert_gradescope(both)
    assert both["score"] == 1.0 and len(both["tests"]) == 3
    assert both["tests"][2]["name"] == "mine.py: the file can be imported and checked"
    assert both["tests"][2]["output"] == "b/mine.py: syntax error at line 2: invalid syntax\n\nx = ("


def test_json_and_csv_records() -> None:
    inf = Check("§3.2", "rank 4", False, "shape (2, 2, 3, 4)", "shape (2, 3, 4)", float("inf"), 1e-6)
    reports = [FileReport(Path("a.py"), [RETRIEVAL, inf, FUSED]),
               FileReport(Path("b.py"), [], "b.py: stopped at the time limit of 1 s")]
    records = json.loads(json.dumps(json_records(reports), allow_nan=False))  # strict JSON: no Infinity
    assert [(r["file"], r["status"]) for r in records] == [
        ("a.py", "pass"), ("a.py", "fail"), ("a.py", "skip"), ("b.py", "error")]
    assert records[1]["deviation"] == "inf" and records[1]["section"] == "§3.2"
    assert records[3]["error"] == "b.py: stopped at the time limit of 1 s"
    assert csv_rows(reports) == [
        {"file": "a.py", "passed": 1, "failed": 1, "skipped": 1, "score": 50.0, "error": ""},
        {"file": "b.py", "passed": 0, "failed": 0, "skipped": 0, "score": 0.0,
         "error": "b.py: stopped at the time limit of 1 s"}]


# ---------------------------------------------------------------------------------------------
# The learner's file, imported and graded in this process (what the child does, without its limits)


def test_a_syntax_error_is_one_line_naming_the_file(tmp_path: Path) -> None:
    path = learner_file(tmp_path, "syntax_slip.py", "import torch\ndef attention(q, k, v)\n    return q\n")
    outcome = import_and_grade(path, Names(), "syntax_slip.py")
    assert outcome["checks"] == [] and "\n" not in outcome["error"]
    assert outcome["error"].startswith("syntax_slip.py: syntax error at line 2: ")
    assert "gptlab" not in outcome["traceback"]


def test_an_import_error_names_the_line_and_keeps_only_the_learners_frames(tmp_path: Path) -> None:
    path = learner_file(tmp_path, "typo_import.py", "import math\nimport torhc\n")
    outcome = import_and_grade(path, Names(), "typo_import.py")
    assert outcome["error"] == ("typo_import.py: import failed at line 2: ModuleNotFoundError: No module "
                                "named 'torhc'")
    assert outcome["traceback"] == (
        f'Traceback (frames in typo_import.py only):\n  File "{path}", line 2, in <module>\n'
        "    import torhc\nModuleNotFoundError: No module named 'torhc'\n")


def test_exit_at_import_is_one_line(tmp_path: Path) -> None:
    path = learner_file(tmp_path, "script_like.py", "import sys\nsys.exit('usage: train.py DATA')\n")
    assert import_and_grade(path, Names(), "script_like.py")["error"] == (
        "script_like.py: the file called exit() at line 2 on import: keep script code under "
        "`if __name__ == \"__main__\":`")


def test_grades_failures_are_one_line_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = learner_file(tmp_path, "broken_heads.py", "def attention(q, k, v):\n    return q / 0\n")

    def learner_error(namespace: dict[str, Any], names: Names, **_: Any) -> list[Check]:
        try:
            namespace["attention"](1, 2, 3)
        except ZeroDivisionError as err:
            raise LearnerError("attention raised ZeroDivisionError: division by zero") from err
        return []

    monkeypatch.setattr(child, "grade", learner_error)
    outcome = import_and_grade(path, Names(), "broken_heads.py")
    assert outcome["error"] == "broken_heads.py: attention raised ZeroDivisionError: division by zero"
    lines = [line for line in outcome["traceback"].splitlines() if line.strip("~^ ")]  # 3.11's markers aside
    assert lines[1:] == [f'  File "{path}", line 2, in attention', "    return q / 0",
                         "ZeroDivisionError: division by zero"]

    monkeypatch.setattr(child, "grade", lambda namespace, names, **_: namespace["attention"](1, 2, 3))
    assert import_and_grade(path, Names(), "broken_heads.py")["error"] == (
        "broken_heads.py: the learner's code crashed (ZeroDivisionError: division by zero) at line 2 while "
        "being checked")

    monkeypatch.setattr(child, "grade", lambda namespace, names, **_: {}["gptlab's own slip"])
    outcome = import_and_grade(path, Names(), "broken_heads.py")
    assert outcome["error"].startswith("broken_heads.py: gptlab's checks crashed (KeyError: ")
    assert "child.py" in outcome["traceback"]  # a bug of gptlab's keeps its whole traceback, for a report

    monkeypatch.setattr(child, "grade", lambda namespace, names, **_: [RETRIEVAL, FUSED])
    outcome = import_and_grade(path, Names(), "broken_heads.py")
    assert outcome["checks"] == [dataclasses.asdict(RETRIEVAL), dataclasses.asdict(FUSED)]
    assert outcome["error"] is None


# ---------------------------------------------------------------------------------------------
# The command line


def test_usage_mistakes_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(tmp_path / "missing.py")]) == 2
    assert capsys.readouterr().err == f"gptlab: error: {tmp_path / 'missing.py'}: no such file\n"
    notes = learner_file(tmp_path, "notes.txt", "attention")
    assert main(["check", str(notes)]) == 2
    assert "is not a Python file" in capsys.readouterr().err
    assert main(["check", str(learner_file(tmp_path, "a.py", "")), "--timeout", "0"]) == 2
    assert capsys.readouterr().err.startswith("gptlab: error: argument --timeout: 0 is not a finite number")


def test_help_teaches_the_names_and_says_it_is_not_a_sandbox(capsys: pytest.CaptureFixture) -> None:
    assert main(["check", "--help"]) == 0
    text = capsys.readouterr().out
    for words in ("attention(q, k, v[, mask])", "MultiHeadAttention", "Block", "--model EXPR",
                  "NOT a sandbox", "gptlab check submissions/*.py --csv grades.csv"):
        assert words in text


@pytest.mark.slow
def test_the_command_writes_every_format_and_exits_1_on_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Wiring only, with the child replaced; test_a_folder_of_submissions runs the real thing."""
    results = {"good.py": FileReport(Path("good.py"), [RETRIEVAL, FUSED]),
               "bad.py": FileReport(Path("bad.py"), [RETRIEVAL, ROWS]),
               "gone.py": FileReport(Path("gone.py"), [], "gone.py: import failed at line 1: ImportError: x")}
    seen: list[tuple[Names, float, int]] = []

    def fake_check_file(path: Path, names: Names, timeout_s: float, memory_mb: int,
                        pictures: bool = False, learning: bool = True, **_: Any) -> FileReport:
        seen.append((names, timeout_s, memory_mb))
        return results[path.name]

    monkeypatch.setattr(isolate, "check_file", fake_check_file)
    files = [str(learner_file(tmp_path, name, "")) for name in results]
    grades, scope = tmp_path / "out" / "grades.csv", tmp_path / "results" / "results.json"
    assert main(["check", *files, "--csv", str(grades), "--gradescope", str(scope), "--heads", "Heads",
                 "--timeout", "7", "--memory-mb", "900"]) == 1
    assert seen == [(Names(heads="Heads"), 7.0, 900)] * 3
    with grades.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["file"], r["passed"], r["failed"], r["score"]) for r in rows] == [
        ("good.py", "1", "0", "100.0"), ("bad.py", "1", "1", "50.0"), ("gone.py", "0", "0", "0.0")]
    assert_gradescope(json.loads(scope.read_text()))
    assert capsys.readouterr().out.endswith("\n1 of 3 files passed every check that applies\n")

    assert main(["check", files[0], "--json"]) == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["pass", "skip"]


def test_break_lists_writes_and_trains_through_the_gallery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from gptlab.handout.learner import bugs, side_by_side

    assert main(["break", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [*bugs.BUGS, "reference"]
    assert main(["break", "mask-zero", "--write", str(tmp_path / "exercise.py")]) == 0
    assert (tmp_path / "exercise.py").read_text() == bugs.bug_text("mask-zero")
    assert main(["break", "reference", "--write", str(tmp_path / "answer.py")]) == 0
    assert (tmp_path / "answer.py").read_text() == bugs.reference_text()
    capsys.readouterr()
    for args in (["no-such-bug", "--write", "x.py"], ["mask-zero"], ["reference", "--train"]):
        assert main(["break", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gptlab: error: ") and err.count("\n") == 1
    calls = []
    fake = lambda *args: calls.append(args) or ["one", "two"]  # noqa: E731
    monkeypatch.setattr(side_by_side, "train_side_by_side", fake)
    assert main(["break", "mask-zero", "--train", "--seconds", "3", "--out", str(tmp_path)]) == 0
    assert calls == [("mask-zero", 3.0, tmp_path)] and capsys.readouterr().out == "one\ntwo\n"


# ---------------------------------------------------------------------------------------------
# Child processes: the real isolation (each one costs a torch import, ~2 s)


@pytest.mark.slow  # three child processes
def test_a_folder_of_submissions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "submissions"
    folder.mkdir()
    learner_file(folder, "ada.py", CORRECT)
    learner_file(folder, "bob.py", WRONG_AXIS)
    learner_file(folder, "cy.py", "def attention(q, k, v):\n    return (q @ k.T).softmax(-1) @ v\nprint(\n")
    grades, scope = tmp_path / "grades.csv", tmp_path / "results.json"
    code = main(["check", *map(str, sorted(folder.glob("*.py"))), "--csv", str(grades), "--gradescope",
                 str(scope)])
    out = capsys.readouterr().out
    assert code == 1
    with grades.open(newline="") as handle:
        rows = {Path(row["file"]).name: row for row in csv.DictReader(handle)}
    assert list(rows) == ["ada.py", "bob.py", "cy.py"]
    assert rows["ada.py"]["failed"] == "0" and int(rows["ada.py"]["passed"]) >= 4, out
    assert rows["ada.py"]["score"] == "100.0" and rows["ada.py"]["error"] == ""
    assert int(rows["bob.py"]["failed"]) >= 1 and rows["bob.py"]["error"] == ""
    assert rows["cy.py"]["error"].endswith("cy.py: syntax error at line 3: '(' was never closed")
    assert any(line.startswith("  FAIL  §3.2") for line in out.splitlines()), out
    assert "Traceback" not in out
    assert_gradescope(json.loads(scope.read_text()))


@pytest.mark.slow  # runs into a 10 s time limit
def test_an_endless_loop_is_stopped_at_the_time_limit(tmp_path: Path) -> None:
    # Endless for the test's purpose; the guard turns a broken limit into a wrong error instead of a hang.
    path = learner_file(tmp_path, "spin.py", "import time\nprint('training...')\n"
                        "end = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"
                        "raise SystemExit('never stopped')\n")
    start = time.monotonic()
    report = check_file(path, Names(), timeout_s=10)
    assert 10 <= time.monotonic() - start < 20
    assert report.checks == [] and report.error == (
        f"{path}: stopped at the time limit of 10 s: an endless loop, or training at import? Keep script "
        "code under `if __name__ == \"__main__\":` (raise the limit with --timeout)")
    assert report.traceback.endswith("training...\n")  # the learner's code ran, and was stopped


@pytest.mark.slow  # one child process
def test_an_allocation_without_bound_is_stopped_at_the_memory_limit(tmp_path: Path) -> None:
    # Untouched pages (bytes(n) is calloc: mapped zero pages), so a broken limit costs address space, not RAM;
    # the guard turns that case into a different error instead of a long wait.
    path = learner_file(tmp_path, "hoard.py", "hoard = []\nwhile True:\n"
                        "    hoard.append(bytes(100 * 2**20))\n"
                        "    if len(hoard) > 100:\n        raise SystemExit('10 GB and no limit')\n")
    start = time.monotonic()
    report = check_file(path, Names(), timeout_s=30, memory_mb=1500)
    assert time.monotonic() - start < 20
    assert report.checks == [] and report.error == (
        f"{path}: ran out of memory at line 3 on import (MemoryError): the limit is 1500 MB beyond the torch "
        "import (raise it with --memory-mb)")
