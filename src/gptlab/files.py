"""Files that survive a crash: every write gptlab makes goes through a temporary file, is fsynced and
then renamed, so a reader (or a run resumed after kill -9) sees the old file or the whole new one."""

from __future__ import annotations

import os
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
