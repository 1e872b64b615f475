"""Run `gptlab ARGV...` and interrupt it at a chosen write: the launcher of test_interrupted_and_repeated.

    python tests/cli/interrupt_launcher.py ARGV...

behaves as `python -m gptlab ARGV...`, with the writes of the process into the current folder watched.
A process multiprocessing starts with "spawn" (compare's workers) imports this file again, so it is watched
too, with counts of its own; a forked child (check's workers) is not. Two kinds of write are events:

- "replace": an `os.replace` or `os.rename` (what gptlab's atomic writes end with: the temporary file is
  whole, the rename is the commit), named by the destination;
- "open": a `builtins.open` / `io.open` in a writing mode ("w", "a", "x" or "+"), named by the file, just
  after it was opened (created or truncated) and before any byte is written.

GPTLAB_TEST_EVENTS names a file (outside the watched folder) that receives one JSON line per event,
{"event", "path", "n"} (n: the count of that kind so far, from 1), and {"fired": ...} when the process
signals itself. GPTLAB_TEST_INTERRUPT, a JSON object {"event", "match", "k", "when", "signal"}, makes the
process send itself `signal` (SIGINT: Ctrl-C, SIGKILL: kill -9) at the k-th event of that kind whose path's
last part matches the fnmatch pattern `match`, `when` "before" or "after" a rename (an open is always
signalled after it). It fires once: a process that survives its signal (gptlab's training saves on Ctrl-C)
goes on unwatched. Without it the launcher only records, so an uninterrupted run shows where it writes.
"""

from __future__ import annotations

import builtins
import fnmatch
import io
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

MAIN_PID = os.getpid()
ROOT = Path.cwd().resolve()
PLAN: dict[str, Any] | None = json.loads(os.environ["GPTLAB_TEST_INTERRUPT"]) \
    if os.environ.get("GPTLAB_TEST_INTERRUPT") else None
_LOG_FD = os.open(os.environ["GPTLAB_TEST_EVENTS"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) \
    if os.environ.get("GPTLAB_TEST_EVENTS") else None
_counts = {"replace": 0, "open": 0}
_matched = 0
_fired = False
_real_replace, _real_rename, _real_open = os.replace, os.rename, io.open


def _record(entry: dict[str, Any]) -> None:
    """One JSON line in the events file, written with os.write (no buffer to lose on SIGKILL)."""
    if _LOG_FD is not None:
        os.write(_LOG_FD, (json.dumps(entry) + "\n").encode())


def _inside(path: Any) -> str | None:
    """`path` relative to the watched folder, or None for a file descriptor or a path outside it."""
    if isinstance(path, int):
        return None
    try:
        return Path(os.fsdecode(path)).resolve().relative_to(ROOT).as_posix()
    except (ValueError, OSError, TypeError):
        return None


def _event(kind: str, path: Any, when: str) -> None:
    """Record an event ("before" or "after" it happens) and signal the process where the plan says."""
    global _matched, _fired
    if os.getpid() != MAIN_PID:  # a forked child (gptlab check's workers): not the command's own writes
        return
    where = _inside(path)
    if where is None:
        return
    if when == ("before" if kind == "replace" else "after"):
        _counts[kind] += 1
        _record({"event": kind, "path": where, "n": _counts[kind]})
    if PLAN is None or _fired or PLAN["event"] != kind:
        return
    if when != (PLAN.get("when", "before") if kind == "replace" else "after"):
        return
    if not fnmatch.fnmatch(where.rsplit("/", 1)[-1], PLAN.get("match", "*")):
        return
    _matched += 1
    if _matched == PLAN["k"]:
        _fired = True
        _record({"fired": {**PLAN, "path": where}})
        os.kill(os.getpid(), getattr(signal, PLAN["signal"]))


def _replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
    _event("replace", dst, "before")
    _real_replace(src, dst, *args, **kwargs)
    _event("replace", dst, "after")


def _rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
    _event("replace", dst, "before")
    _real_rename(src, dst, *args, **kwargs)
    _event("replace", dst, "after")


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    handle = _real_open(file, mode, *args, **kwargs)
    if any(c in mode for c in "wax+"):
        _event("open", file, "after")
    return handle


if __name__ in ("__main__", "__mp_main__"):  # run, or imported again by a spawned child: never on import
    os.replace, os.rename = _replace, _rename
    builtins.open = io.open = _open

if __name__ == "__main__":
    sys.argv[0] = "gptlab"
    from gptlab.cli import main

    raise SystemExit(main(sys.argv[1:]))
