"""What the child of `gptlab check` does with a learner's file: import it, grade it, and turn every
failure of the learner's code into one line naming the file (and its traceback trimmed to the file)."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptlab.handout.learner.grade import LearnerError, Names, grade, subjects
from gptlab.handout.learner.page import pictures_for


def import_and_grade(path: Path, names: Names, shown: str,
                     limit: Callable[[], Callable[[], None]] = lambda: lambda: None,
                     pictures: bool = False, learning: bool = True) -> dict[str, Any]:
    """Import the learner's file in this process and grade it: {"checks", "error", "traceback",
    "out_of_memory"} as plain data (with `pictures`, also "pictures": the numbers page.py draws), every
    failure of the learner's code one line that names `shown`.

    `limit()` is called before the learner's code runs and returns the call that lifts it, made before
    any report is built (the learner's globals may still hold the memory). Meant for the child: the
    file's folder goes first on sys.path and the module into sys.modules, as running it as a script would.
    """
    lift, imported = limit(), False
    try:
        namespace = _import(path)
        imported = True
        checks = grade(namespace, names, learning=learning)
        drawn = pictures_for(*subjects(namespace, names)).record() if pictures else None
    except BaseException as err:  # whatever the learner's code raised, SystemExit included
        lift()
        return _check_failure(err, path, shown) if imported else _import_failure(err, path, shown)
    lift()
    return {"checks": [{**check.record(), "evidence": check.evidence and check.evidence.record()}
                       for check in checks], "error": None, "traceback": "", "out_of_memory": False,
            "pictures": drawn}


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
