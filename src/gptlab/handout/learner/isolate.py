"""Run a learner's file in a child process with a time and a memory limit, and grade it there.

This is isolation against mistakes, NOT a sandbox against malicious code: an endless loop, an allocation
without bound, a crash, a call to exit() or a wrong return shape becomes one line naming the file and the
problem, but the learner's code runs with your rights and can read, write or delete whatever you can.
Check only code you would run yourself, or run `gptlab check` inside a container or a throw-away account.

The child is `python -m gptlab.handout.learner.isolate`, started in a temporary folder of its own holding
copies of the learner's file and the .py files beside it (so that, in a batch, one file cannot delete or
rewrite another), with a new session (its whole process group is killed however it ends), no stdin,
CUDA hidden (the checks run on the CPU; CUDA would also reserve address space far beyond any limit) and
matplotlib drawing off-screen. It imports torch and the
checks first, then caps its address space (RLIMIT_AS, Linux) at what that import took plus `memory_mb`,
so the limit is the learner's share whatever torch's build maps (measured with torch 2.13's CPU build:
12 MB of address space for bare Python, 626 MB after importing torch and the checks; a CUDA build maps
more). The default of 4096 MB is far above what the handout's tiny models need and stops an allocation
without bound within a second or two. The wall-clock limit covers the whole child, torch's import
(~2 s of CPU) included. The checks come back as JSON.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from gptlab.handout.learner.grade import LearnerError, Names, grade
from gptlab.handout.properties import Check, Evidence, judge

MiB = 2**20
TAIL_BYTES = 8192  # the end of the child's own output kept, for the report of a child that died
KILLED_HINT = {getattr(signal, name) for name in ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS")
               if hasattr(signal, name)}  # how memory exhaustion ends (Windows has no SIGKILL, no SIGBUS)


@dataclass(frozen=True)
class FileReport:
    """The checks of one learner file, or the one line that says why it could not be checked."""

    path: Path
    checks: list[Check]
    error: str | None = None  # one line naming the file and the problem
    traceback: str = ""  # the learner's traceback trimmed to frames in their file, or the child's last
    # output where it died or was stopped without one (shown with --verbose and in Gradescope's output)


def check_file(path: Path, names: Names, timeout_s: float = 60, memory_mb: int = 4096) -> FileReport:
    """Import `path` in a child process limited to `timeout_s` seconds and `memory_mb` MB beyond the torch
    import, and grade what it defines there. Isolation against mistakes, not a sandbox (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="gptlab-check-") as folder:
        copy = _private_copy(path, Path(folder) / "work")
        result = Path(folder) / "result.json"
        request = {"path": str(copy), "shown": str(path), "result": str(result),
                   "names": dataclasses.asdict(names), "memory_mb": memory_mb}
        returncode, timed_out, tail = _run_child(request, copy.parent, timeout_s)
        if timed_out:
            return FileReport(path, [], f"{path}: stopped at the time limit of {timeout_s:g} s: an endless "
                              "loop, or training at import? Keep script code under `if __name__ == "
                              "\"__main__\":` (raise the limit with --timeout)", tail)
        if not result.exists():
            return FileReport(path, [], _death(path, returncode, memory_mb),
                              _own_lines(tail, copy).replace(str(copy), str(path)))
        outcome = json.loads(result.read_text(encoding="utf-8"))
    return _report(path, outcome, memory_mb, str(copy))


def _report(path: Path, outcome: Any, memory_mb: int, copy: str) -> FileReport:
    """The child's outcome as a report, every verdict computed here from the numbers it sent (`judge`)."""
    try:
        checks = [judge(Check(**{**fields, "evidence": Evidence.from_record(fields["evidence"])
                                 if fields["evidence"] else None})) for fields in outcome["checks"]]
        error, traceback_text = outcome["error"], str(outcome["traceback"]).replace(copy, str(path))
    except (KeyError, TypeError, ValueError, RuntimeError):  # written by something else than the child's code
        return FileReport(path, [], f"{path}: the check process's report is malformed: the learner's code "
                          "changed the checks or wrote their report")
    if error and outcome["out_of_memory"]:
        error = f"{error}: the limit is {memory_mb} MB beyond the torch import (raise it with --memory-mb)"
    if error is None and not checks:
        error = f"{path}: the check process reported no checks: the learner's code changed the checks"
    return FileReport(path, checks, error and str(error), traceback_text)


def _private_copy(path: Path, folder: Path) -> Path:
    """`path` and the other .py files beside it (its helper modules) copied into `folder`: the learner's code
    runs there, so a file that deletes or rewrites what is around it touches only its own copies."""
    folder.mkdir()
    for sibling in path.resolve().parent.glob("*.py"):
        if sibling.is_file():
            shutil.copy2(sibling, folder / sibling.name)
    shutil.copy2(path, folder / path.name)  # the file itself, even where the glob missed it (a symlink)
    return folder / path.name


def _run_child(request: dict[str, Any], cwd: Path, timeout_s: float) -> tuple[int, bool, str]:
    """Run the child on `request` in `cwd`: its exit status, whether it ran past `timeout_s`, its last output.

    Whatever way it ends (a normal finish, the time limit, an exception here), its whole process group is
    killed before it is reaped, so nothing the learner's code started outlives the check."""
    child = subprocess.Popen(
        [sys.executable, "-m", "gptlab.handout.learner.isolate", json.dumps(request)], cwd=cwd,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    tail, timed_out = _keep_tail(child.stdout), False
    try:
        timed_out = not _exited(child, timeout_s)
    finally:
        _kill_group(child)
        child.wait()
    return child.returncode, timed_out, tail()


def _exited(child: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `child` to exit, leaving it unreaped (a zombie) where the platform allows,
    so that its process id, which is its group's id, cannot be reused before the group is killed."""
    if not hasattr(os, "waitid"):  # Windows: no zombies to keep, no groups to kill
        try:
            child.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_group(child: subprocess.Popen) -> None:
    """SIGKILL the child's process group: the child, if still running, and every process it started
    that stayed in the group (a process that made itself a new session escapes: not a sandbox)."""
    if not hasattr(os, "killpg"):
        child.kill()
        return
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass


def import_and_grade(path: Path, names: Names, shown: str,
                     limit: Callable[[], Callable[[], None]] = lambda: lambda: None) -> dict[str, Any]:
    """Import the learner's file in this process and grade it: {"checks", "error", "traceback",
    "out_of_memory"} as plain data, every failure of the learner's code one line that names `shown`.

    `limit()` is called before the learner's code runs and returns the call that lifts it, made before
    any report is built (the learner's globals may still hold the memory). Meant for the child: the
    file's folder goes first on sys.path and the module into sys.modules, as running it as a script would.
    """
    lift, imported = limit(), False
    try:
        namespace = _import(path)
        imported = True
        checks = grade(namespace, names)
    except BaseException as err:  # whatever the learner's code raised, SystemExit included
        lift()
        return _check_failure(err, path, shown) if imported else _import_failure(err, path, shown)
    lift()
    return {"checks": [{**check.record(), "evidence": check.evidence and check.evidence.record()}
                       for check in checks], "error": None, "traceback": "", "out_of_memory": False}


def _learner_traceback(err: BaseException, path: Path) -> str:
    """The traceback of `err` trimmed to the frames in the learner's file, then the exception itself."""
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if frame.filename == str(path)]
    head = [f"Traceback (frames in {path.name} only):\n", *traceback.format_list(frames)] if frames else []
    return "".join([*head, *traceback.format_exception_only(type(err), err)])


def _import(path: Path) -> dict[str, Any]:
    """Execute the file as a module named after it (unless that name is taken) and return its globals."""
    name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else "submission"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} cannot be loaded as a module"
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # its own helper modules import as they would from a script
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return vars(module)


def _import_failure(err: BaseException, path: Path, shown: str) -> dict[str, Any]:
    """The outcome of a file whose import raised: what went wrong, in words, at which line of the file."""
    if isinstance(err, SyntaxError):
        where = "" if err.filename == str(path) else f" in {err.filename}"
        return _failure(err, path, f"{shown}: syntax error{where} at line {err.lineno}: {err.msg}")
    at = "" if (line := _last_line_in(err, path)) is None else f" at line {line}"
    if isinstance(err, SystemExit):
        return _failure(err, path, f"{shown}: the file called exit(){at} on import: keep script code under "
                        "`if __name__ == \"__main__\":`")
    if _out_of_memory(err):
        return _failure(err, path, f"{shown}: ran out of memory{at} on import ({type(err).__name__})")
    return _failure(err, path, f"{shown}: import failed{at}: {_exception_line(err)}")


def _check_failure(err: BaseException, path: Path, shown: str) -> dict[str, Any]:
    """The outcome of a file whose definitions broke a check: grade's LearnerError, or a crash."""
    if isinstance(err, LearnerError):  # grade's one line; the traceback is the learner's, when it has one
        return _failure(err.__cause__ or err.__context__, path, f"{shown}: {err}")
    line = _last_line_in(err, path)
    if line is None and not _out_of_memory(err):  # the crash is in gptlab itself: say so, for a bug report
        return {"checks": [], "error": f"{shown}: gptlab's checks crashed ({_exception_line(err)}); this is "
                "a bug in gptlab, please report it with the traceback that --verbose shows",
                "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
                "out_of_memory": False}
    at = "" if line is None else f" at line {line}"
    what = "called exit()" if isinstance(err, SystemExit) else f"crashed ({_exception_line(err)})"
    return _failure(err, path, f"{shown}: the learner's code {what}{at} while being checked")


def _failure(err: BaseException | None, path: Path, message: str) -> dict[str, Any]:
    """The outcome of a file that could not be checked: one line, and the learner's trimmed traceback."""
    return {"checks": [], "error": message, "traceback": "" if err is None else _learner_traceback(err, path),
            "out_of_memory": _out_of_memory(err)}


def _exception_line(err: BaseException) -> str:
    """`Type: message`, the message cut to its first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _last_line_in(err: BaseException, path: Path) -> int | None:
    """The line of the innermost frame of the learner's file in err's traceback, if any."""
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == str(path)]
    return lines[-1] if lines else None


def _out_of_memory(err: BaseException | None) -> bool:
    """Whether err, or an exception it was raised from, is an allocation refused by the memory limit."""
    while err is not None:
        text = str(err)
        if isinstance(err, MemoryError) or "can't allocate memory" in text or "not enough memory" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


def _death(path: Path, returncode: int, memory_mb: int) -> str:
    """The one line for a child that ended without reporting: killed by a signal, or exiting on its own."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = (f" (a crash in compiled code, or memory exhausted: the limit is {memory_mb} MB beyond the "
                "torch import, set with --memory-mb)" if -returncode in KILLED_HINT else "")
        return f"{path}: the check process was killed by {name} while running the learner's code{hint}"
    return (f"{path}: the check process exited with status {returncode} before reporting: os._exit() in "
            "the learner's code, or a fatal error (--verbose shows its last output)")


def _own_lines(output: str, path: Path) -> str:
    """The child's last output without the crash dump's lines about other files than the learner's."""
    own = f'File "{path.resolve()}"'
    return "".join(line for line in output.splitlines(keepends=True)
                   if not line.lstrip().startswith(("File ", "Extension modules:")) or own in line)


def _keep_tail(stream: IO[bytes] | None) -> Callable[[], str]:
    """Drain `stream` on a thread, keeping only its last TAIL_BYTES; returns a call giving them as text."""
    assert isinstance(stream, io.BufferedReader), "the child's output must be a (buffered) pipe"
    kept = bytearray()

    def drain() -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            kept.extend(chunk)
            del kept[:-TAIL_BYTES]
        stream.close()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def text() -> str:
        reader.join(timeout=5)
        return kept.decode("utf-8", errors="replace")

    return text


def _limit_address_space(extra_mb: int) -> Callable[[], None]:
    """Cap this process's address space at its present size plus `extra_mb`; returns the undo.

    No-op where /proc/self/statm is missing (not Linux): there RLIMIT_AS is not enforced anyway.
    """
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except OSError:
        return lambda: None
    import resource  # POSIX only: imported where /proc says this is Linux
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra_mb * MiB
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _child(request: dict[str, Any]) -> None:
    """The child's whole job: limits, import, grade, and the outcome written as JSON for the parent."""
    faulthandler.enable()  # a segfault in the learner's extension code still leaves a trace in the output
    torch.set_num_threads(1)  # tiny models: a second thread only adds hand-over time
    outcome = import_and_grade(Path(request["path"]), Names(**request["names"]), request["shown"],
                               functools.partial(_limit_address_space, request["memory_mb"]))
    Path(request["result"]).write_text(json.dumps(outcome), encoding="utf-8")


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
