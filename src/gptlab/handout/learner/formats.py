"""The reports of `gptlab check`: text for the learner, JSON, Gradescope's results.json, the rows of a CSV
of grades (written by outputs.py).

Text is one line per check: PASS, FAIL or SKIP, the handout section and the check's name; a failure adds
what was expected, what was measured and the most likely cause with its fix, a skip why it does not
apply. A skipped check is never counted as passed: it scores nothing and is out of nothing. Gradescope's
format (https://gradescope-autograders.readthedocs.io/en/latest/specs/) gets one test of one point per
check that applies, and one failed test for a file that could not be checked; the skipped checks are
listed in its top-level output, since a test there would show as passed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptlab.files import atomic_write_text
from gptlab.handout.learner.isolate import FileReport
from gptlab.handout.properties import Check

VERDICT = {True: "PASS", False: "FAIL", None: "SKIP"}


def counts(report: FileReport) -> tuple[int, int, int]:
    """(passed, failed, skipped) checks of one file."""
    verdicts = [check.passed for check in report.checks]
    return verdicts.count(True), verdicts.count(False), verdicts.count(None)


def succeeded(report: FileReport) -> bool:
    """The file was checked, some check applied, and none that applies failed."""
    passed, failed, _ = counts(report)
    return report.error is None and passed > 0 and failed == 0


def check_line(check: Check) -> str:
    """PASS/FAIL/SKIP, section and name; a failure adds expected, measured and cause, a skip its reason."""
    line = f"{VERDICT[check.passed]}  {check.section:<5} {check.name}"
    if check.passed is False:
        line += f": expected {check.expected}, measured {check.computed}"
        if check.cause:
            line += f"; likely cause: {check.cause}"
    elif check.passed is None and check.note:
        line += f": {check.note}"
    return line


def numbers(check: Check) -> list[str]:
    """The numbers behind a check's line: expected and computed, deviation against tolerance, the note."""
    shown = check.expected or check.computed
    lines = [f"expected {check.expected}; computed {check.computed}"] if shown else []
    if check.deviation is not None:
        bound = "" if check.tolerance is None else f" (tolerance {check.tolerance:g})"
        lines.append(f"measured deviation {check.deviation:.3g}{bound}")
    if check.note and check.passed is not None:
        lines.append(check.note)
    return lines


def text_lines(report: FileReport, verbose: bool = False) -> list[str]:
    """A file's report: its name, one line per check, the error line and a count; `verbose` adds the
    numbers behind each line and the learner's traceback."""
    lines = [f"{report.path}"]
    for check in report.checks:
        lines.append("  " + check_line(check))
        if verbose:
            lines.extend("        " + line for line in numbers(check))
    if report.error:
        lines.append("  ERROR " + report.error)
        if verbose and report.traceback:
            lines.extend("    " + line for line in report.traceback.rstrip().splitlines())
    if report.checks:
        passed, failed, skipped = counts(report)
        lines.append(f"  {passed} passed, {failed} failed, {skipped} skipped")
    return lines


def json_records(reports: Sequence[FileReport]) -> list[dict[str, Any]]:
    """One object per check (the file, pass/fail/skip and Check's fields), and one per file error."""
    records: list[dict[str, Any]] = []
    for report in reports:
        for check in report.checks:
            records.append({"file": str(report.path), "status": VERDICT[check.passed].lower(),
                            **{key: _finite(value) for key, value in check.record().items()}})
        if report.error:
            records.append({"file": str(report.path), "status": "error", "error": report.error,
                            "traceback": report.traceback})
    return records


def gradescope_results(reports: Sequence[FileReport]) -> dict[str, Any]:
    """Gradescope's results.json: a point per check that applies, a failed test per unreadable file."""
    tests, skipped = [], []
    for report in reports:
        prefix = f"{report.path.name}: " if len(reports) > 1 else ""
        if report.error:
            output = "\n\n".join(part for part in (report.error, report.traceback.rstrip()) if part)
            tests.append(_test(f"{prefix}the file can be imported and checked", False, output))
        for check in report.checks:
            if check.passed is None:
                skipped.append(f"{prefix}{check.section} {check.name}: {check.note}")
                continue
            cause = [f"likely cause: {check.cause}"] if check.passed is False and check.cause else []
            tests.append(_test(f"{prefix}{check.section} {check.name}", check.passed,
                               "\n".join([*numbers(check), *cause])))
    score = sum(test["score"] for test in tests)
    summary = [f"gptlab check: {score:g} of {len(tests)} checks passed"]
    if skipped:
        summary += ["", "Skipped, as they do not apply to what the file defines (scored out of nothing):",
                   *skipped]
    return {"score": score, "output": "\n".join(summary), "visibility": "visible", "tests": tests}


def write_gradescope(reports: Sequence[FileReport], path: Path) -> None:
    """Write gradescope_results to `path` (Gradescope reads /autograder/results/results.json)."""
    text = json.dumps(gradescope_results(reports), indent=2, ensure_ascii=False)  # § as itself
    atomic_write_text(path, text + "\n")  # whole or not at all


def csv_rows(reports: Sequence[FileReport]) -> list[dict[str, Any]]:
    """One row per file, outputs.CSV_COLUMNS: its counts, the percent of applicable checks passed (0 if not
    checked), the error."""
    rows = []
    for report in reports:
        passed, failed, skipped = counts(report)
        applicable = passed + failed
        score = 0.0 if report.error or not applicable else round(100 * passed / applicable, 1)
        rows.append({"file": str(report.path), "passed": passed, "failed": failed, "skipped": skipped,
                     "score": score, "error": report.error or ""})
    return rows


def _test(name: str, passed: bool, output: str) -> dict[str, Any]:
    """One Gradescope test case worth one point."""
    return {"name": name, "score": 1.0 if passed else 0.0, "max_score": 1.0,
            "status": "passed" if passed else "failed", "output": output, "visibility": "visible"}


def _finite(value: Any) -> Any:
    """Infinities and NaN as the strings "inf", "-inf", "nan": strict JSON has no spelling for them."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value
