"""Files that survive a crash: every write gptlab makes goes through a temporary file, is fsynced and
then renamed, so a reader (or a run resumed after kill -9) sees the old file or the whole new one."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's) contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp_path)`, fsync the file, then rename it to `path` (and fsync the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a UTF-8 text file atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


class RunLock:
    """An exclusive lock on a run folder for the length of a run, so two writers never share one.

    The lock is `flock` on RUN/.lock, which holds the owner's process id; the operating system releases
    it when the process ends in any way (kill -9 included), so a stale lock never blocks a later run.
    """

    NAME = ".lock"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path = run_dir, run_dir / self.NAME
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"{self.run_dir} is in use by another gptlab process (pid {holder}): wait for "
                             "it to finish, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files that writes killed mid-way left in `folder` (call it under RunLock)."""
    stale = sorted(folder.glob(".*.tmp-*"))  # atomic_write's files and prepare's staging folders
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale
