"""Run a learner's file in a child process with a time and a memory limit, and grade it there.

This is isolation against mistakes, NOT a sandbox against malicious code: an endless loop, an allocation
without bound, a crash, a call to exit() or a wrong return shape becomes one line naming the file and the
problem, but the learner's code runs with your rights and can read, write or delete whatever you can.
Check only code you would run yourself, or run `gptlab check` inside a container or a throw-away account.

On Linux each file's child is forked from a check server (server.py starts it, forking.py is its loop), one
per process and started by the first check: a fresh interpreter, CUDA hidden in its environment (the checks
run on the CPU; CUDA would also reserve address space far beyond any limit), that imports torch and the
checks once and runs no tensor operation (forking after one is unsafe: torch's thread pool). Elsewhere each
child is a fresh interpreter, `python -m gptlab.handout.learner.isolate`, that imports them itself. Either
way the child works in a temporary folder of its own holding copies of the learner's file and of its local
import closure, the modules and packages of its folder it imports (closure.py), and nothing else of that
folder (so that, in a batch, one file can neither read nor delete nor rewrite another; a file that imports
another of the batch is one error naming it), has no $PWD, leads a new session (its whole process group is
killed however it ends), has no stdin, draws matplotlib off-screen, and caps its address space (RLIMIT_AS,
Linux) at its size after the import of torch and the checks plus `memory_mb`, so the limit is the learner's
share whatever torch's build maps (measured with torch 2.13's CPU build: 12 MB of address space for bare
Python, 626 MB after importing torch and the checks; a CUDA build maps more). The default of 4096 MB is far
above what the handout's tiny models need and stops an allocation without bound within a second or two. The
wall-clock limit counts from the start of the file's check, so a server still starting (torch's import, ~2 s
of CPU, once) takes from the first files' time. The checks come back as JSON. A server that dies while a file
is checked (the learner's code can kill its parent) makes that file one error, a crash, and the next file
starts a fresh server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

import torch

from gptlab.handout.learner import server
from gptlab.handout.learner.child import import_and_grade
from gptlab.handout.learner.closure import local_imports
from gptlab.handout.learner.grade import Names
from gptlab.handout.learner.page import Pictures
from gptlab.handout.learner.server import child_env
from gptlab.handout.properties import Check, Evidence, judge

MiB = 2**20
TAIL_BYTES = 8192  # the end of the child's own output kept, for the report of a child that died
SERVER_LOST = ("{path}: gptlab check's server, the parent of the learner's process, ended while this file "
               "was checked: the learner's code killed it (or, with --jobs above 1, a file checked at the "
               "same time did); graded as a crash, and the next file gets a fresh server")
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
    pictures: Pictures | None = None  # what the file's page draws (check_file(pictures=True), --html)


class ServerLost(Exception):
    """The check server died while a file's child ran; `tail` is the child's last output."""

    def __init__(self, tail: str) -> None:
        super().__init__(tail)
        self.tail = tail


def check_file(path: Path, names: Names, timeout_s: float = 60, memory_mb: int = 4096,
               pictures: bool = False, learning: bool = True, batch: Sequence[Path] = ()) -> FileReport:
    """Import `path` in a child process limited to `timeout_s` seconds and `memory_mb` MB beyond the torch
    import, and grade what it defines there (with `pictures`, also measure what its page draws). It runs
    on a copy of itself and its local imports; one that imports another file of `batch` (those checked with
    it) is one error naming it. Isolation against mistakes, not a sandbox (module docstring)."""
    modules = local_imports(path)
    if others := _batch_imports(path, modules, batch):
        return FileReport(path, [], f"{path}: imports {', '.join(others)}, another file checked in this "
                          "batch: a submission may import its own modules, never another submission")
    with tempfile.TemporaryDirectory(prefix="gptlab-check-") as folder:
        copy = _private_copy(path, modules, Path(folder) / "work")
        result = Path(folder) / "result.json"
        request = {"path": str(copy), "shown": str(path), "result": str(result),
                   "names": dataclasses.asdict(names), "memory_mb": memory_mb, "pictures": pictures,
                   "learning": learning}
        run = _run_forked if server.FORK_SERVER else _run_child
        try:
            returncode, timed_out, tail = run(request, copy.parent, timeout_s)
        except ServerLost as lost:
            return FileReport(path, [], SERVER_LOST.format(path=path),
                              _own_lines(lost.tail, copy).replace(str(copy), str(path)))
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
        drawn = Pictures.from_record(outcome["pictures"]) if outcome.get("pictures") else None
    except (KeyError, TypeError, ValueError, RuntimeError):  # written by something else than the child's code
        return FileReport(path, [], f"{path}: the check process's report is malformed: the learner's code "
                          "changed the checks or wrote their report")
    if error and outcome["out_of_memory"]:
        error = f"{error}: the limit is {memory_mb} MB beyond the torch import (raise it with --memory-mb)"
    if error is None and not checks:
        error = f"{path}: the check process reported no checks: the learner's code changed the checks"
    return FileReport(path, checks, error and str(error), traceback_text, drawn)


def _batch_imports(path: Path, modules: set[Path], batch: Sequence[Path]) -> list[str]:
    """The files of `batch`, as given, other than `path` itself, that are among the `modules` it imports."""
    imported = {module.resolve() for module in modules} - {path.resolve()}
    return list(dict.fromkeys(str(other) for other in batch if other.resolve() in imported))


def _private_copy(path: Path, modules: set[Path], folder: Path) -> Path:
    """`path` and the `modules` it imports from its folder (closure.local_imports) copied into `folder`, laid
    out as they are there: the learner's code runs there, sees nothing else of its folder, and a file that
    deletes or rewrites what is around it touches only its own copies."""
    folder.mkdir()
    root = path.resolve().parent
    for module in sorted(modules):
        copy = folder / module.relative_to(root)
        if module.is_dir():  # a namespace package
            copy.mkdir(parents=True, exist_ok=True)
        else:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(module, copy)
    shutil.copy2(path, folder / path.name)
    return folder / path.name


def _run_child(request: dict[str, Any], cwd: Path, timeout_s: float) -> tuple[int, bool, str]:
    """Run the child on `request` in `cwd`: its exit status, whether it ran past `timeout_s`, its last output.

    Whatever way it ends (a normal finish, the time limit, an exception here), its whole process group is
    killed before it is reaped, so nothing the learner's code started outlives the check."""
    child = subprocess.Popen(
        [sys.executable, "-m", "gptlab.handout.learner.isolate", json.dumps(request)], cwd=cwd,
        env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
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


def _run_forked(request: dict[str, Any], cwd: Path, timeout_s: float) -> tuple[int, bool, str]:
    """Run the child on `request` in `cwd`, forked by the check server: its exit status, whether it ran past
    `timeout_s` (counted from now), its last output. However it ends, the server kills its group (forking);
    where the server dies first, _server_gone does."""
    deadline = time.monotonic() + timeout_s
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read, write = os.pipe()  # the child's stdout and stderr
    tail, returncode = _keep_tail(open(read, "rb")), -signal.SIGKILL
    with ours:
        try:
            try:
                running = _send({"request": request, "cwd": str(cwd)}, [theirs.fileno(), write])
            finally:
                theirs.close()
                os.close(write)
            first = _receive(ours, deadline)  # the child's id, sent by the child, then its exit status
            pid = int(first[4:]) if first.startswith(b"pid ") else 0
            reply = _receive(ours, deadline) if pid else first
            if not reply:  # the server closed the connection first
                _server_gone(running, pid, tail)
            returncode, timed_out = int(reply), False
        except TimeoutError:
            timed_out = True
        finally:
            with contextlib.suppress(OSError):  # the server is gone: nothing left to end
                ours.settimeout(10)
                ours.send(b"end")
                while ours.recv(16):  # the server closes the connection once the group is killed
                    pass
    return returncode, timed_out, tail()


def _send(message: dict[str, Any], fds: list[int]) -> server.Server:
    """Send a check to the check server: `message` and `fds`, the child's connection and output. Where the
    server has just died (killed by a file checked at the same time), once more to a fresh one."""
    data = json.dumps(message).encode()
    running = server.connection()
    try:
        socket.send_fds(running.control, [data], fds)
    except (BrokenPipeError, ConnectionResetError):  # the server's end is closed: it is exiting
        if not running.died():
            raise
        running = server.connection()
        socket.send_fds(running.control, [data], fds)
    return running


def _receive(conn: socket.socket, deadline: float) -> bytes:
    """The next message on `conn`, waited for until `deadline` (TimeoutError); b"" once it is closed."""
    conn.settimeout(max(deadline - time.monotonic(), 0.001))
    return conn.recv(16)


def _server_gone(running: server.Server, pid: int, tail: Callable[[], str]) -> NoReturn:
    """The check server closed a check's connection before sending its child's status: stopped, as the
    command ends (a RuntimeError), or dead, killed by a learner's code. Then the child `pid` (0: not known)
    is nobody's child: its group is killed here, at once, and ServerLost raised with its last output."""
    if not running.died():
        raise RuntimeError("gptlab check's server process was stopped while a file was being checked")
    if pid:  # at once: the orphan is reaped when it ends, and its id, its group's, may then be reused
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    raise ServerLost(tail())


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


def child_job(request: dict[str, Any]) -> None:
    """The child's whole job: limits, import, grade, and the outcome written as JSON for the parent."""
    faulthandler.enable()  # a segfault in the learner's extension code still leaves a trace in the output
    torch.set_num_threads(1)  # tiny models: a second thread only adds hand-over time
    outcome = import_and_grade(Path(request["path"]), Names(**request["names"]), request["shown"],
                               functools.partial(_limit_address_space, request["memory_mb"]),
                               bool(request.get("pictures")), bool(request.get("learning", True)))
    Path(request["result"]).write_text(json.dumps(outcome), encoding="utf-8")


if __name__ == "__main__":
    child_job(json.loads(sys.argv[1]))
