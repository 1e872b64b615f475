"""Files that survive a crash: every write gptlab makes goes through a temporary file, is fsynced and
then renamed, so a reader (or a run resumed after kill -9) sees the old file or the whole new one.

Portable to Windows: the run-folder lock is filelock's native lock, and a folder is fsynced only where
the platform can open one (not on Windows, whose folders cannot be opened as files)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import lock_descriptor, unlock_descriptor

from gptlab.config import SettingError

MARK = "gptlab"  # what gptlab's pictures and pages name as their writer
PNG_MARK = {"Software": MARK}  # matplotlib's savefig metadata: a PNG tEXt chunk
HTML_MARK = f'<meta name="generator" content="{MARK}">'  # in every page's <head>


def written_by_gptlab(path: Path) -> bool:
    """Whether an existing picture or page says gptlab wrote it (PNG_MARK or HTML_MARK near its start): an
    --out the same command may write again, where another file is refused without --force."""
    try:
        with path.open("rb") as handle:
            head = handle.read(16384)
    except OSError:
        return False
    return f"Software\0{MARK}".encode() in head or HTML_MARK.encode() in head


def fsync(path: Path) -> None:
    """Flush a file's contents to the disk, and a folder's entries (so a rename in it lasts) where the
    folder can be opened: never on Windows, nor anywhere for a folder one may not read."""
    if path.is_dir():
        if os.name == "nt":
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except PermissionError:  # what opening a folder raises where it is not allowed
            return
    else:  # Windows flushes (FlushFileBuffers) only through a handle open for writing
        fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_png(figure: Any, path: str | Path) -> None:
    """A matplotlib figure as gptlab's PNG (PNG_MARK), written whole or not at all (`atomic_write`)."""
    atomic_write(Path(path), lambda tmp: figure.savefig(tmp, format="png", metadata=PNG_MARK))


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp_path)`, fsync the file, then rename it to `path` (and fsync the folder). Temporaries of
    `path` that killed writers left are removed first, so the same write again leaves none behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks: its identity, to tell it changed."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write a UTF-8 text file atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


class RunLock:
    """An exclusive lock on a run folder for the length of a run, so two writers never share one.

    The lock is filelock's native lock (flock on POSIX, LockFileEx on byte 0 on Windows) on RUN/.lock,
    taken on a descriptor of our own so that the file keeps the owner's process id; the operating system
    releases it when the process ends in any way (kill -9 included), so a stale lock never blocks a later
    run. Windows lets no other process read a locked byte, so the id is written after byte 0 (" 1234").
    `restore()` leaves the file as it was found when the lock is released: a refusal changes nothing.
    """

    NAME = ".lock"
    PID_AT = 1  # the offset of the owner's process id: byte 0 is the one Windows locks

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path = run_dir, run_dir / self.NAME
        self.fd: int | None = None
        self.found: bytes | None = None  # the file's bytes before ours; None: this lock created it
        self.remove = False  # set by restore(): take away the file this lock created on release

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SettingError(f"cannot create the folder {self.run_dir}: {err.strerror or err}: choose "
                               "another {out}", out="run_dir") from None
        while True:  # until the file locked is the one the folder holds (a refusal may remove its own)
            created, fd = self._open()
            try:
                if not lock_descriptor(fd, blocking=False):
                    raise SettingError(f"{self.run_dir} is in use by another gptlab process (pid "
                                       f"{self._holder(fd)}): wait for it to finish, or choose another "
                                       "{out}", out="run_dir")
                if self._is_named(fd):
                    self.found = None if created else self._read(fd)
                    self._write(fd, f"{' ' * self.PID_AT}{os.getpid()}\n".encode())
                    self.fd = fd
                    return self
                unlock_descriptor(fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            removed = self.remove and self._unlink()  # POSIX: under the lock, so no waiter takes the old file
            try:  # closing alone releases it too, but Windows only some time after the handle closes
                unlock_descriptor(fd)
            finally:
                os.close(fd)
            if self.remove and not removed:  # Windows removes no open file; an opener of it keeps it
                self._unlink()

    def restore(self) -> None:
        """Put back the file's bytes as found (the previous owner's id), or remove it on release if this
        lock created it: for a command that refuses, so the folder is left byte for byte as it was."""
        if self.fd is not None and self.found is not None:
            self._write(self.fd, self.found)
        self.remove = self.found is None

    def _open(self) -> tuple[bool, int]:
        """Whether the file was created now, and a descriptor of it."""
        flags = os.O_RDWR | getattr(os, "O_BINARY", 0)
        while True:
            try:
                return True, os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            try:
                return False, os.open(self.path, flags)
            except FileNotFoundError:  # removed between the two opens: create it
                continue

    def _is_named(self, fd: int) -> bool:
        """Whether the locked file is still the folder's RUN/.lock (not one a refused run removed)."""
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)

    @staticmethod
    def _read(fd: int) -> bytes:
        """All the bytes of the locked file (ours to read: we hold the lock)."""
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 2**16):
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        """Replace the locked file's bytes with `data`."""
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)

    def _unlink(self) -> bool:
        """Remove the lock file; False where the platform refused (Windows, while a handle is open)."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            return False
        return True

    def _holder(self, fd: int) -> str:
        """The process id the lock's owner wrote, or "unknown" while it has not yet written it."""
        os.lseek(fd, self.PID_AT, os.SEEK_SET)
        return os.read(fd, 32).decode(errors="replace").strip() or "unknown"


# safetensors writes through a temporary file of its own in the target's folder: ".tmp" and 6 characters.
SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files that writes killed mid-way left in `folder` (call it under RunLock)."""
    stale = sorted([*folder.glob(".*.tmp-*"),  # atomic_write's files and prepare's staging folders
                    *(p for p in folder.glob(".tmp*") if SAFETENSORS_TMP.fullmatch(p.name))])
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def remove_abandoned_temporaries(path: Path) -> list[Path]:
    """Delete the temporary files atomic_write left beside `path` in processes that are gone (a kill -9):
    for files written outside a locked run folder, where another live process may be writing its own."""
    abandoned = []
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            abandoned.append(tmp)
    return abandoned


def process_alive(pid: int) -> bool:
    """Whether a process with this id is running (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but is not ours, or the platform cannot tell: keep its files
        return True
    return True
