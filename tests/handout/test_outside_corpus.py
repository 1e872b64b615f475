"""Issue 39: `gptlab check` on a corpus of learner files written outside gptlab's own style.

tests/handout/outside/ holds small plain-PyTorch files in the styles courses actually produce (the
video-tutorial per-head modules, nanoGPT's fused c_attn, F.scaled_dot_product_attention,
nn.MultiheadAttention, Llama-like RoPE/RMSNorm/SwiGLU, Hugging Face-style configs, CS336-style own
Linear/Embedding, explicit loops, required mask arguments, ...). Each file says in its docstring
which style it is and whether it is correct or which single bug it has, and carries:

- `STYLE`: the style, in words;
- `BUG`: None for a correct file, else the bug in words;
- `EXPECTED_CAUSE` (bug files): a regex, matched case-insensitively against the causes of the failed
  checks, that a cause naming this bug matches;
- `FLAGS`: the `gptlab check` flags a learner would pass (--attention, --heads, --block, --model).

The done-when of the issue: every correct file gets no FAIL and at least 12 PASS lines; every bug
file gets at least one FAIL, and a FAIL whose cause names the bug. The verdicts are compared with what
each file says about itself, never with grade's output.

Every case holds today; before the fixes of issue 39, 17 of the 36 did not (6 false alarms on correct
files, 11 bugs missed or blamed on the wrong cause).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from gptlab.handout.learner.grade import Names, grade
from gptlab.handout.properties import Check

# ok_single_matrix's `.T` warns when the checker tries it on a batch, as it is meant to
pytestmark = pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")

CORPUS = Path(__file__).parent / "outside"
MIN_PASSES = 12  # a correct file must pass at least this many checks

def _load(path: Path) -> dict[str, Any]:
    """Import a corpus file under a name of its own and return its namespace."""
    spec = importlib.util.spec_from_file_location(f"outside_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


@functools.cache
def _namespace(name: str) -> dict[str, Any]:
    return _load(CORPUS / name)


def _names(flags: list[str]) -> Names:
    """The Names a learner's `gptlab check` flags give: --attention, --heads, --block, --model."""
    assert len(flags) % 2 == 0, f"flags come in pairs: {flags}"
    given = {flag.removeprefix("--"): value for flag, value in zip(flags[::2], flags[1::2], strict=True)}
    assert set(given) <= {"attention", "heads", "block", "model"}, f"unknown flags: {flags}"
    return Names(**given)


@functools.cache
def _graded(name: str) -> tuple[tuple[Check, ...], str]:
    """Every check grade gives the file (with its FLAGS), or () and why grade raised."""
    namespace = _namespace(name)
    try:
        return tuple(grade(namespace, _names(namespace["FLAGS"]))), ""
    except Exception as error:  # noqa: BLE001 - any exception is the verdict for this file
        return (), f"grade raised {type(error).__name__}: {error}"


def _line(c: Check) -> str:
    return f"{c.verdict} {c.section} {c.name}: expected {c.expected}, computed {c.computed}; cause: {c.cause}"


FILES = sorted(p.name for p in CORPUS.glob("*.py"))
CORRECT = [f for f in FILES if _namespace(f)["BUG"] is None]
BUGGY = [f for f in FILES if _namespace(f)["BUG"] is not None]


def test_the_corpus_is_what_the_issue_asks_for() -> None:
    counts = len(FILES), len(CORRECT), len(BUGGY)
    assert counts[0] >= 30 and counts[1] >= 12 and counts[2] >= 15, counts
    styles = {_namespace(f)["STYLE"] for f in FILES}
    assert len(styles) >= 10, sorted(styles)
    for f in FILES:
        namespace = _namespace(f)
        doc, bug = namespace["__doc__"] or "", namespace["BUG"]
        assert doc.startswith("Style:"), f"{f}: the docstring starts with its style"
        assert isinstance(namespace["FLAGS"], list), f"{f}: FLAGS is a list"
        _names(namespace["FLAGS"])
        if bug is None:
            assert "\nCorrect" in doc, f"{f}: a correct file says so in its docstring"
            assert "EXPECTED_CAUSE" not in namespace, f"{f}: a correct file has no EXPECTED_CAUSE"
        else:
            assert "\nBug:" in doc, f"{f}: a bug file names its bug in its docstring"
            re.compile(namespace["EXPECTED_CAUSE"])


@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.slow
def test_a_correct_file_gets_no_fail_and_enough_passes(name: str) -> None:
    results, crash = _graded(name)
    assert not crash, crash
    failures = [_line(c) for c in results if c.passed is False]
    assert not failures, "\n".join(failures)
    passes = sum(c.passed is True for c in results)
    assert passes >= MIN_PASSES, f"only {passes} PASS (at least {MIN_PASSES} expected):\n" + "\n".join(
        _line(c) for c in results if c.passed is None)


@pytest.mark.parametrize("name", BUGGY)
@pytest.mark.slow
def test_a_bug_fails_with_a_cause_naming_it(name: str) -> None:
    results, crash = _graded(name)
    assert not crash, crash
    failed = [c for c in results if c.passed is False]
    bug, expected = _namespace(name)["BUG"], _namespace(name)["EXPECTED_CAUSE"]
    assert failed, f"{bug}: nothing failed"
    named = [c for c in failed if re.search(expected, c.cause, re.IGNORECASE)]
    assert named, f"{bug}: no failed check's cause matches /{expected}/:\n" + "\n".join(map(_line, failed))
