"""However `gptlab check` ends, its CSV holds every file graded so far: a submission that kills the check
server is graded as a crash and the batch goes on, and SIGTERM (a course's grading timeout) leaves the
rows already graded."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.handout.learner.bugs import write_reference

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the check server forks: Linux only")


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def alive(pid: int) -> bool:
    """Running: in /proc and not a zombie."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.slow  # the command end to end, and a second server
def test_a_file_that_kills_the_check_server_is_a_crash_and_the_batch_goes_on(tmp_path: Path) -> None:
    pid_file = tmp_path / "killer.pid"
    files = [write_reference(tmp_path / name) for name in ("a_good.py", "b_killer.py", "c_good.py")]
    files[1].write_text(f"import os\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                        "os.kill(os.getppid(), 9)\n" + files[1].read_text(encoding="utf-8"), encoding="utf-8")
    grades = tmp_path / "grades.csv"
    assert main(["check", *map(str, files), "--csv", str(grades), "--no-learning", "--timeout", "120"]) == 1
    graded = {Path(row["file"]).name: row for row in rows(grades)}
    assert list(graded) == ["a_good.py", "b_killer.py", "c_good.py"]
    assert graded["a_good.py"]["score"] == graded["c_good.py"]["score"] == "100.0"
    assert graded["b_killer.py"]["score"] == "0.0" and "server" in graded["b_killer.py"]["error"]
    killer = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(killer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(killer), "the killer's check outlived it"


@pytest.mark.slow  # a whole `gptlab check` process
def test_sigterm_leaves_a_csv_of_the_files_graded_so_far(tmp_path: Path) -> None:
    ready = tmp_path / "sleeper-started"
    files = [write_reference(tmp_path / name) for name in ("a_good.py", "b_sleeper.py", "c_good.py")]
    sleeper = f"import time\nopen({str(ready)!r}, 'w').close()\ntime.sleep(600)\n"
    files[1].write_text(sleeper, encoding="utf-8")
    grades = tmp_path / "grades.csv"
    command = subprocess.Popen([sys.executable, "-m", "gptlab", "check", *map(str, files), "--csv",
                                str(grades), "--no-learning", "--timeout", "600"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():  # the first file is graded; the second has started
            assert command.poll() is None and time.monotonic() < deadline, command.stderr
            time.sleep(0.05)
        command.send_signal(signal.SIGTERM)
        assert command.wait(60) == 128 + signal.SIGTERM
    finally:
        if command.poll() is None:
            os.kill(command.pid, signal.SIGKILL)
            command.wait()
    assert [(Path(row["file"]).name, row["score"]) for row in rows(grades)] == [("a_good.py", "100.0")]
