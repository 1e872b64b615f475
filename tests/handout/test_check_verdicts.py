"""`gptlab check` computes every verdict in its own process (issue 44, point 8): the child that runs a
learner's code sends the raw numbers of each check, and the parent judges them with its own torch, so a
submission that replaces the grading function, patches torch's comparisons or writes the report itself
cannot set its grade. The judge is held to the in-process verdicts on every learner file of the test
suite and every bug of the gallery, so it never fails what the checks pass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from gptlab.handout.learner import bugs
from gptlab.handout.learner.formats import counts, succeeded
from gptlab.handout.learner.grade import Names, grade
from gptlab.handout.learner.isolate import check_file
from gptlab.handout.properties import UNBELIEVED, Check, Evidence, judge

LEARNERS = Path(__file__).parent / "learners"


def module_globals(path: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"verdict_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return vars(module)


def learner_files(folder: Path) -> list[Path]:
    written = [bugs.write_reference(folder / "reference.py")]
    written += [bugs.write_bug(name, folder / f"bug_{name.replace('-', '_')}.py") for name in bugs.BUGS]
    return sorted(LEARNERS.glob("*.py")) + written


@pytest.mark.slow  # grades the whole gallery
def test_the_parents_judgement_matches_every_check_made_in_process(tmp_path: Path) -> None:
    """Every check that passes carries evidence, and judging it again (after a trip through JSON, as
    from the child) gives the same verdict: on correct files, on every bug, passes and failures alike."""
    seen = {True: 0, False: 0}
    for path in learner_files(tmp_path):
        for check in grade(module_globals(path), Names()):
            if check.passed is None:
                continue
            if check.evidence is None:  # a crash, or a call that raised: a failure with nothing to measure
                assert check.passed is False and judge(check) == check, (path.name, check.name)
                continue
            sent = Check(**{**check.record(), "evidence": Evidence.from_record(check.evidence.record())})
            judged = judge(sent)
            assert judged.passed is check.passed, (path.name, check.name, check.deviation, judged.deviation)
            assert judged.cause == check.cause
            seen[check.passed] += 1
    assert seen[True] > 200 and seen[False] > 20, seen  # both kinds were exercised


def test_a_pass_without_evidence_is_not_believed() -> None:
    claimed = Check("§2.1", "retrieval output y", True, "[2, 1.5]", "[2, 1.5]", 0.0, 1e-6)
    assert judge(claimed).passed is False and judge(claimed).cause == UNBELIEVED
    skipped = Check("§4", "fused", None, note="no weights")
    assert judge(skipped) == skipped


def no_mask(folder: Path) -> Path:
    """The gallery's model with its causal mask dropped: fails §7.3."""
    return bugs.write_bug("no-mask", folder / "no_mask.py")


@pytest.mark.slow
def test_patching_torch_in_the_learners_process_does_not_flip_a_verdict(tmp_path: Path) -> None:
    honest = check_file(no_mask(tmp_path), Names(), timeout_s=120)
    assert honest.error is None and not succeeded(honest)
    cheat = tmp_path / "cheat.py"
    cheat.write_text(no_mask(tmp_path).read_text() + '''
import torch
torch.Tensor.abs = lambda self: torch.zeros_like(self)  # every change measured in this process becomes 0
''', encoding="utf-8")
    report = check_file(cheat, Names(), timeout_s=120)
    assert report.error is None, report.error
    failed = {c.name for c in report.checks if c.passed is False}
    assert {c.name for c in honest.checks if c.passed is False} <= failed  # the §7.3 failures stay
    assert any(c.section == "§7.3" for c in report.checks if c.passed is False)


@pytest.mark.parametrize("how", ["replaces grade", "writes the report"])
def test_a_submission_cannot_set_its_own_grade(tmp_path: Path, how: str) -> None:
    forged = "Check('§2.1', f'forged {i}', True, 'anything', 'anything', 0.0, 1.0)"
    attack = {
        "replaces grade": f'''
import sys
from gptlab.handout.properties import Check
child = sys.modules["gptlab.handout.learner.child"]  # where the child grades the file
child.grade = lambda namespace, names, **_: [{forged} for i in range(43)]
''',
        "writes the report": f'''
import json, os, sys, threading
from gptlab.handout.properties import Check
def _forge():
    request = json.loads(sys.argv[1])
    checks = [dict({forged}.record(), evidence=None) for i in range(43)]
    with open(request["result"], "w") as out:
        json.dump({{"checks": checks, "error": None, "traceback": "", "out_of_memory": False}}, out)
    os._exit(0)
threading.Timer(0.0, _forge).start()
''',
    }[how]
    cheat = tmp_path / "cheat.py"
    cheat.write_text(no_mask(tmp_path).read_text() + attack, encoding="utf-8")
    report = check_file(cheat, Names(), timeout_s=120)
    passed, failed, _ = counts(report)
    assert not succeeded(report) and passed == 0 and failed == 43, (report.error, passed, failed)
