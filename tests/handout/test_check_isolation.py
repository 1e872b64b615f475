"""`gptlab check`'s isolation of one learner's file from the others and from the machine (issue 44,
points 7 and 9): each file runs on a private copy in a folder of its own, and nothing it starts
outlives the check, whichever way it ends."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

from gptlab.handout.learner.grade import Names
from gptlab.handout.learner.isolate import check_file

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")

CORRECT = '''\
import math
import torch

def attention(q, k, v):
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(dim=-1)
    return weights @ v, weights
'''

# A file that deletes every other .py file in its working folder, then defines a correct attention.
VANDAL = '''\
import os
from pathlib import Path

for other in Path.cwd().glob("*.py"):
    if other.name != Path(__file__).name:
        os.remove(other)
Path("notes.py").write_text("x = 1")
''' + CORRECT


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def alive(pid: int) -> bool:
    """Running: in /proc and not a zombie (a killed orphan waits there for init to reap it)."""
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


@pytest.mark.slow
def test_a_file_cannot_delete_the_others_in_a_batch(tmp_path: Path) -> None:
    vandal = tmp_path / "a_vandal.py"
    vandal.write_text(VANDAL, encoding="utf-8")
    victim = tmp_path / "b_victim.py"
    victim.write_text(CORRECT, encoding="utf-8")
    before = {path.name: digest(path) for path in tmp_path.iterdir()}
    reports = [check_file(path, Names(), timeout_s=120) for path in (vandal, victim)]
    after = {path.name: digest(path) for path in tmp_path.iterdir()}
    assert after == before  # nothing added, removed or changed
    for report in reports:
        assert report.error is None, report.error
        assert report.checks and not [c for c in report.checks if c.passed is False]


@pytest.mark.slow
def test_helper_modules_beside_the_file_still_import(tmp_path: Path) -> None:
    (tmp_path / "my_helpers.py").write_text("import math\nSCALE = math.sqrt\n", encoding="utf-8")
    path = tmp_path / "uses_helper.py"
    path.write_text(CORRECT.replace("import math", "import math\nfrom my_helpers import SCALE")
                    .replace("math.sqrt(q.size(-1))", "SCALE(q.size(-1))"), encoding="utf-8")
    report = check_file(path, Names(), timeout_s=120)
    assert report.error is None, report.error
    assert [c for c in report.checks if c.passed] and not [c for c in report.checks if c.passed is False]


def test_a_traceback_names_the_learners_file_not_the_private_copy(tmp_path: Path) -> None:
    path = tmp_path / "typo.py"
    path.write_text("import torch\n\ndef attention(q, k, v):\n    return undefined_name\n", encoding="utf-8")
    report = check_file(path, Names(), timeout_s=120)
    failed = [c for c in report.checks if c.passed is False]
    assert failed and "NameError" in failed[0].cause
    assert "gptlab-check-" not in report.traceback + "".join(c.cause for c in report.checks)


@pytest.mark.slow  # a child run to its time limit
@pytest.mark.parametrize("ending", ["finishes", "times out"])
def test_nothing_the_file_starts_outlives_the_check(tmp_path: Path, ending: str) -> None:
    pids = tmp_path / "pids.txt"
    spawner = f'''\
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(3)]
with open({str(pids)!r}, "w") as out:
    out.write(" ".join(str(child.pid) for child in children))
{"time.sleep(120)" if ending == "times out" else ""}
''' + CORRECT
    path = tmp_path / "spawner.py"
    path.write_text(spawner, encoding="utf-8")
    report = check_file(path, Names(), timeout_s=120 if ending == "finishes" else 8)
    assert (report.error is None) == (ending == "finishes"), report.error
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 3
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in started if alive(pid)]
    for pid in left:  # do not leave them behind if the test fails
        os.kill(pid, 9)
    assert not left, f"still running after the check: {left}"
