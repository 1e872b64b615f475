"""`gptlab check` forks each file's child from one server that imported torch once (issue 39, point 7):
the checks are those of a fresh interpreter per file, --jobs N checks N files at a time and still
reports them in the files' order, and a folder stands for its .py files."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.handout.learner import bugs, isolate, server
from gptlab.handout.learner.formats import json_records
from gptlab.handout.learner.grade import Names
from gptlab.handout.learner.isolate import FileReport, check_file
from gptlab.handout.properties import Check

CORRECT = '''\
import math

def attention(q, k, v):
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(dim=-1)
    return weights @ v, weights
'''

# Appended to each learner file: which process started the child, that one's parent, and whether the
# starting process had torch loaded when it did.
RECORD = '''
import os as _os
with open({log!r}, "a") as _out:
    _parent = _os.getppid()
    _grandparent = open(f"/proc/{{_parent}}/stat").read().rsplit(")", 1)[1].split()[1]
    _out.write(f"{{_parent}} {{_grandparent}} {{'libtorch' in open(f'/proc/{{_parent}}/maps').read()}}\\n")
'''


def submissions(folder: Path, log: Path) -> list[Path]:
    """Three learner files in `folder` (and a note that is not one), each recording its child's parents."""
    folder.mkdir()
    (folder / "c_attention.py").write_text(CORRECT, encoding="utf-8")
    files = [bugs.write_reference(folder / "a_reference.py"),
             bugs.write_bug("no-mask", folder / "b_no_mask.py"), folder / "c_attention.py"]
    for path in files:
        path.write_text(path.read_text(encoding="utf-8") + RECORD.format(log=str(log)), encoding="utf-8")
    (folder / "notes.txt").write_text("not a submission", encoding="utf-8")
    return files


@pytest.mark.slow  # three fresh interpreters, then a server and its three children
@pytest.mark.skipif(sys.platform != "linux", reason="the check server forks: Linux only")
def test_forked_children_give_the_checks_of_fresh_interpreters_without_importing_torch_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    spawned_log, forked_log = tmp_path / "spawned.log", tmp_path / "forked.log"
    files = submissions(tmp_path / "spawned", spawned_log)
    monkeypatch.setattr(server, "FORK_SERVER", False)
    spawned = json_records([check_file(path, Names(), timeout_s=120) for path in files])
    assert {line.split()[0] for line in spawned_log.read_text().splitlines()} == {str(os.getpid())}

    files = submissions(tmp_path / "forked", forked_log)
    monkeypatch.setattr(server, "FORK_SERVER", True)
    assert main(["check", str(tmp_path / "forked"), "--jobs", "2", "--json", "--timeout", "120"]) == 1
    forked = json.loads(capsys.readouterr().out)
    spawned_dir, forked_dir = str(tmp_path / "spawned"), str(tmp_path / "forked")
    assert [{**r, "file": r["file"].replace(spawned_dir, forked_dir)} for r in spawned] == forked
    assert {record["file"] for record in forked} == set(map(str, files))
    # One process started all three children, itself started by this one, with torch already loaded:
    # no child imported torch afresh.
    lines = forked_log.read_text().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1, lines
    forker, its_parent, had_torch = lines[0].split()
    assert forker != str(os.getpid()) and its_parent == str(os.getpid()) and had_torch == "True"


@pytest.mark.slow  # the check command end to end, twice at a time
def test_jobs_2_checks_two_at_a_time_and_reports_in_the_files_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    running, most = [0], [0]
    lock = threading.Lock()

    def slow_first(path: Path, names: Names, timeout_s: float, memory_mb: int, **_: Any) -> FileReport:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.5 if path.name == "f0.py" else 0.05)  # the first file finishes last
        with lock:
            running[0] -= 1
        return FileReport(path, [Check("§2.1", f"check of {path.stem}", True)])

    monkeypatch.setattr(isolate, "check_file", slow_first)
    files = [tmp_path / f"f{i}.py" for i in range(5)]
    for path in files:
        path.write_text("", encoding="utf-8")
    assert main(["check", *map(str, files), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.endswith(".py")] == list(map(str, files))
    assert most[0] == 2


@pytest.mark.slow  # the check command end to end
def test_a_folder_means_its_py_files_sorted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    seen: list[str] = []

    def record(path: Path, names: Names, timeout_s: float, memory_mb: int, **_: Any) -> FileReport:
        seen.append(str(path))
        return FileReport(path, [Check("§2.1", "retrieval", True)])

    monkeypatch.setattr(isolate, "check_file", record)
    folder = tmp_path / "submissions"
    (folder / "inner").mkdir(parents=True)
    for name in ("zoe.py", "ada.py", "notes.txt", "inner/deep.py"):
        (folder / name).write_text("", encoding="utf-8")
    single = tmp_path / "extra.py"
    single.write_text("", encoding="utf-8")
    assert main(["check", str(folder), str(single)]) == 0
    assert seen == [str(folder / "ada.py"), str(folder / "zoe.py"), str(single)]

    empty = tmp_path / "empty"
    empty.mkdir()
    capsys.readouterr()
    assert main(["check", str(empty)]) == 2
    assert capsys.readouterr().err == f"gptlab: error: {empty}: a folder with no .py file in it\n"
    assert main(["check", str(single), "--jobs", "0"]) == 2
    assert capsys.readouterr().err.startswith("gptlab: error: argument --jobs: 0 is not an integer of")
