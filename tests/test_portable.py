"""gptlab on platforms other than Linux and macOS, simulated here since no Windows machine runs the tests.

Windows has no `fcntl`, `resource`, `termios`, `pwd` or `grp`, nor signals such as SIGKILL; a folder
cannot be opened there (so it has no folder fsync), FlushFileBuffers needs a handle open for writing,
and LockFileEx's byte lock keeps other processes from reading the locked byte. Child processes import
gptlab with such modules refused to gptlab's own code (`GUARD`), and `os.name`, `os.open` and `os.read`
are patched here to act as Windows's do.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptlab.files import RunLock, atomic_write_text

# Run first in a child: gptlab's own modules may not import what Windows lacks, and get the modules in
# SHAPED instead of the real ones (third-party modules are left alone: on Windows they take their own
# Windows branches).
GUARD = textwrap.dedent("""
    import builtins

    POSIX_ONLY = {"fcntl", "resource", "termios", "pwd", "grp", "tty", "pty", "posix", "syslog", "curses"}
    SHAPED = {}
    posix_import = builtins.__import__

    def windows_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (globals or {}).get("__name__", "").split(".")[0] == "gptlab":
            if name.split(".")[0] in POSIX_ONLY:
                raise ModuleNotFoundError(f"No module named {name!r} (as on Windows)", name=name)
            if name in SHAPED:
                return SHAPED[name]
        return posix_import(name, globals, locals, fromlist, level)

    builtins.__import__ = windows_import
""")

# Run after GUARD: gptlab's modules get `os` and `signal` without (the usual of) the names Windows lacks.
WINDOWS_NAMES = textwrap.dedent("""
    import os, re, signal, types

    def without(module, names):
        copy = types.ModuleType(module.__name__)
        copy.__dict__.update({key: value for key, value in vars(module).items() if key not in names})
        return copy

    KEPT_SIGNALS = {"SIGABRT", "SIGFPE", "SIGILL", "SIGINT", "SIGSEGV", "SIGTERM"}
    SHAPED["signal"] = without(signal, {name for name in vars(signal) if re.fullmatch("SIG[A-Z0-9]+", name)
                                        and name not in KEPT_SIGNALS} | {"alarm", "pause", "setitimer"})
    SHAPED["os"] = without(os, {"fork", "killpg", "setpgrp", "setsid", "getpgid", "getuid", "geteuid",
                                "sched_getaffinity", "sysconf", "uname", "statvfs", "mkfifo", "chown",
                                "nice", "getloadavg", "pread", "pwrite", "O_NONBLOCK", "O_DIRECTORY",
                                "O_NOFOLLOW", "O_CLOEXEC", "O_SYNC", "O_DSYNC", "WNOHANG"})
""")

IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil
    import gptlab

    for module in pkgutil.walk_packages(gptlab.__path__, "gptlab."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    print("imported", flush=True)
""")

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gptlab.files import RunLock

    with RunLock(Path(sys.argv[1])):
        print("locked", flush=True)
        time.sleep(600)
""")


# ---------------------------------------------------------------------------------------------
# Importing


@pytest.mark.parametrize("shape", [
    "",
    WINDOWS_NAMES,
], ids=["windows-modules", "windows-os-and-signal-names"])
@pytest.mark.slow
def test_the_whole_library_imports_without_what_windows_lacks(shape: str) -> None:
    child = subprocess.run([sys.executable, "-c", GUARD + shape + IMPORT_ALL], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0 and child.stdout == "imported\n", child.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Flushing to the disk


def watch_flushes(monkeypatch: pytest.MonkeyPatch,
                  folder_error: OSError | None = None) -> list[tuple[str, int]]:
    """Record ("file" or "folder", the open's access mode) for every descriptor fsynced; opening a
    folder raises `folder_error` where one is given."""
    flushed: list[tuple[str, int]] = []
    modes: dict[int, int] = {}
    posix_open, posix_fsync = os.open, os.fsync

    def opened(path: Path, flags: int, *args: int) -> int:
        if folder_error is not None and Path(path).is_dir():
            raise folder_error
        fd = posix_open(path, flags, *args)
        modes[fd] = flags & (os.O_RDONLY | os.O_WRONLY | os.O_RDWR)
        return fd

    def fsynced(fd: int) -> None:
        flushed.append(("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file", modes[fd]))
        posix_fsync(fd)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "fsync", fsynced)
    return flushed


def test_windows_flushes_the_file_for_writing_and_skips_the_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run" / "config.json"
    flushed = watch_flushes(monkeypatch)
    atomic_write_text(path, "posix\n")
    assert flushed == [("file", os.O_RDONLY), ("folder", os.O_RDONLY)]  # POSIX: the rename made durable too
    flushed.clear()
    monkeypatch.setattr(os, "name", "nt")
    atomic_write_text(path, "windows\n")
    monkeypatch.undo()
    assert flushed == [("file", os.O_RDWR)]  # FlushFileBuffers needs write access; no folder handle exists
    assert path.read_text(encoding="utf-8") == "windows\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.json"]


def test_a_folder_that_cannot_be_opened_is_not_flushed_but_the_file_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run" / "config.json"
    flushed = watch_flushes(monkeypatch, PermissionError(errno.EACCES, "Permission denied", str(path.parent)))
    atomic_write_text(path, "text\n")
    monkeypatch.undo()
    assert flushed == [("file", os.O_RDONLY)]
    assert path.read_text(encoding="utf-8") == "text\n"


# ---------------------------------------------------------------------------------------------
# The run-folder lock


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A child process holding RunLock on tmp_path/run, with gptlab refused what Windows lacks."""
    child = subprocess.Popen([sys.executable, "-c", GUARD + HOLD_LOCK, str(tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    if child.stdout.readline() != "locked\n":
        child.kill()
        pytest.fail(child.communicate()[1][-3000:])
    yield child
    child.kill()
    child.wait()


def test_a_second_process_is_refused_naming_the_holder_without_reading_the_locked_byte(
        holder: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    lock = os.stat(run / RunLock.NAME)
    posix_read = os.read

    def windows_read(fd: int, n: int) -> bytes:  # LockFileEx keeps other processes off byte 0
        here = os.fstat(fd)
        if (here.st_dev, here.st_ino) == (lock.st_dev, lock.st_ino) and os.lseek(fd, 0, os.SEEK_CUR) == 0:
            raise PermissionError(errno.EACCES, "The process cannot access the file because another process "
                                  "has locked a portion of the file")
        return posix_read(fd, n)

    monkeypatch.setattr(os, "read", windows_read)
    with pytest.raises(ValueError) as refused, RunLock(run):
        pass
    assert str(refused.value) == (f"{run} is in use by another gptlab process (pid {holder.pid}): "
                                  "wait for it to finish, or choose another run_dir")


def test_a_killed_holder_does_not_block_the_next_run(holder: subprocess.Popen[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (run / RunLock.NAME).read_bytes()[1:].strip() == str(holder.pid).encode()  # readable past byte 0
    holder.kill()  # SIGKILL: no exit handler runs, the operating system drops the lock
    holder.wait()
    with RunLock(run):
        assert (run / RunLock.NAME).read_bytes()[1:].strip() == str(os.getpid()).encode()
    with RunLock(run):  # and the lock is released on leaving
        pass
