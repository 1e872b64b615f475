"""`gptlab.check`: the handout's checks on live objects in a notebook or a REPL, in this very process.

`attention=` takes a function; `heads=`, `block=` and `model=` a class, built at the handout's sizes as
`gptlab check FILE.py` builds it (D=8, H=2 for §4's count, D=4, H=2 for §4.1, D=16 for a block, a model
at V=11, T_max=16, L=2, H=2, D=16), or an instance, checked at its own sizes on a copy (your object is
never changed); for a multi-head instance the checks stated at the handout's sizes (§4's count, §4.1)
are SKIPped with the reason. Unlike `gptlab check FILE.py`, nothing is isolated: the code runs in this
process with NO time limit and NO memory limit, so an endless loop hangs the kernel.

The result prints as `gptlab check`'s lines in a terminal and renders as a coloured table in Jupyter.
"""

from __future__ import annotations

import copy
import html
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from gptlab.handout.learner.build import BuildError, build, sizes
from gptlab.handout.learner.formats import VERDICT, check_line, counts, succeeded, text_lines
from gptlab.handout.learner.grade import MODEL_CLASSES, LearnerError, Names, grade
from gptlab.handout.learner.isolate import FileReport
from gptlab.handout.learner.parts import input_width
from gptlab.handout.learner.projections import HEAD_COUNTS, Wiring, find_wiring
from gptlab.handout.properties import Check, skipped

__all__ = ["CheckResult", "check"]

IN_PROCESS = "in this process: no time or memory limit (gptlab check FILE.py runs a file with both)"
# The sections of grade's one line for a kind that is missing, and the kind each stands for.
MISSING = {"§2.1": "attention", "§4": "heads", "§5": "block", "§7.3": "model"}
SIZE_BOUND = {"§4": "§4 counts the weights of the class built at D=8, H=2",
              "§4.1": "§4.1 sets the handout's 4 x 4 weights into the class built at D=4, H=2"}
COLOURS = {True: "#1a7f37", False: "#cf222e", None: "#6e7781"}  # PASS green, FAIL red, SKIP grey
TINTS = {True: "#eef8f0", False: "#fdf0f0", None: "#f6f8fa"}


@dataclass(frozen=True)
class CheckResult:
    """What `check` found: `gptlab check`'s lines in a terminal, a coloured table in a notebook."""

    report: FileReport
    title: str  # the first line: what was checked, in this process without limits

    @property
    def checks(self) -> list[Check]:
        """Every check, in handout order (PASS, FAIL and SKIP alike)."""
        return self.report.checks

    @property
    def passed(self) -> int:
        """How many checks passed."""
        return counts(self.report)[0]

    @property
    def failed(self) -> int:
        """How many checks failed."""
        return counts(self.report)[1]

    @property
    def skipped(self) -> int:
        """How many checks did not apply (scored out of nothing, never counted as passed)."""
        return counts(self.report)[2]

    @property
    def ok(self) -> bool:
        """Some check applied, none failed and nothing stopped the checks."""
        return succeeded(self.report)

    @property
    def error(self) -> str | None:
        """The one line that says why the objects could not be checked, if they could not."""
        return self.report.error

    def lines(self, verbose: bool = False) -> list[str]:
        """The title, then `gptlab check`'s lines; `verbose` adds the numbers behind each line."""
        return [self.title, *text_lines(self.report, verbose)[1:]]

    def __str__(self) -> str:
        """The lines `gptlab check` prints, under the title."""
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        """The same lines: what a terminal or a notebook's text/plain shows for the result."""
        return str(self)

    def _repr_html_(self) -> str:
        """One coloured row per check (verdict, section, check, what was measured and why), for Jupyter."""
        cell = "padding:2px 8px;text-align:left;vertical-align:top"
        rows = []
        for c in self.checks:
            verdict = (f'<td style="{cell};color:#fff;background:{COLOURS[c.passed]};font-weight:bold">'
                       f"{VERDICT[c.passed]}</td>")
            rows.append(f'<tr style="background:{TINTS[c.passed]}">{verdict}<td style="{cell}">'
                        f'{html.escape(c.section)}</td><td style="{cell}">{html.escape(c.name)}</td>'
                        f'<td style="{cell}">{html.escape(_detail(c))}</td></tr>')
        head = "".join(f'<th style="{cell}">{name}</th>' for name in ("verdict", "section", "check", "cause"))
        error = (f'<p style="color:{COLOURS[False]};font-weight:bold">ERROR {html.escape(self.error)}</p>'
                 if self.error else "")
        table = (f'<table class="gptlab-check"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
                 "</table>" if rows else "")
        tally = f"<p>{self.passed} passed, {self.failed} failed, {self.skipped} skipped</p>" if rows else ""
        return f"<div><p>{html.escape(self.title)}</p>{table}{error}{tally}</div>"


def _detail(c: Check) -> str:
    """What `check_line` adds after the check's name: expected, measured and cause, or why it is skipped."""
    line = check_line(c)
    head = f"{VERDICT[c.passed]}  {c.section:<5} {c.name}"
    return line[len(head):].removeprefix(": ") if line.startswith(head) else line


def check(attention: Callable[..., Any] | None = None, heads: type | nn.Module | None = None,
          block: type | nn.Module | None = None, model: type | nn.Module | None = None) -> CheckResult:
    """Every handout check that applies to these live objects, run IN THIS PROCESS with no time or memory
    limit (`gptlab check FILE.py` isolates a file); classes at the handout's sizes, instances on a copy."""
    given = {kind: value for kind, value in
             (("attention", attention), ("heads", heads), ("block", block), ("model", model))
             if value is not None}
    if not given:
        raise TypeError("gptlab.check needs attention=, heads=, block= or model=: a function, a class or an "
                        "instance")
    namespace = _namespace(given)
    names, extra, shown = _place(given, namespace)
    title = f"gptlab.check({', '.join(f'{k}={v}' for k, v in shown.items())}) {IN_PROCESS}"
    try:
        results = grade(namespace, names, discover=False) + extra  # only what was passed
    except LearnerError as error:  # nothing applied: a model class that cannot be built says why itself
        return CheckResult(FileReport(Path("gptlab.check"), extra, None if extra else str(error)), title)
    return CheckResult(FileReport(Path("gptlab.check"), _translated(results, given)), title)


def _namespace(given: dict[str, Any]) -> dict[str, Any]:
    """The globals of the module the objects were written in (a notebook's), without the default names
    grade looks up, so that only what is given (and what is found inside it) is checked."""
    homes = [_home(given[kind]) for kind in ("model", "block", "heads", "attention") if kind in given]
    home = next((h for h in homes if h is not None), {"__name__": "__main__"})
    defaults = {f.default for f in fields(Names) if isinstance(f.default, str)} | set(MODEL_CLASSES)
    return {name: value for name, value in home.items() if name not in defaults}


def _home(value: Any) -> dict[str, Any] | None:
    """The globals of the module that defines `value` (a function, a class, or an instance's class)."""
    if isinstance(getattr(value, "__globals__", None), dict):
        return value.__globals__
    cls = value if isinstance(value, type) else type(value)
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    return vars(module) if module is not None and cls.__module__ not in ("builtins", "functools") else None


def _place(given: dict[str, Any], namespace: dict[str, Any]) -> tuple[Names, list[Check], dict[str, str]]:
    """Put each object in `namespace` under its own name: grade's Names for them, the lines this module
    adds itself (a model class that cannot be built), and how each is shown in the title."""
    chosen: dict[str, str] = {}
    extra: list[Check] = []
    shown: dict[str, str] = {}
    for kind, value in given.items():
        label = _label(value)
        shown[kind] = label if isinstance(value, type) or kind == "attention" else f"{label} instance"
        if kind == "attention":
            if isinstance(value, type) or not callable(value):
                raise TypeError(f"attention= takes a function attention(q, k, v[, mask]), not {label}")
            namespace[label] = value
        elif not (isinstance(value, nn.Module) or isinstance(value, type) and issubclass(value, nn.Module)):
            raise TypeError(f"{kind}= takes an nn.Module subclass or an instance of one, not {label}")
        elif kind == "model":
            made = value if not isinstance(value, type) else _built_model(value, namespace, extra)
            if made is None:
                continue
            namespace[label] = _copy(made, label) if made is value else made
        else:
            namespace[label] = value if isinstance(value, type) else _copying_class(value)
        chosen[kind] = label
    return Names(**chosen), extra, shown


def _label(value: Any) -> str:
    """A function's or class's own name, or an instance's class name."""
    named = value if isinstance(value, type) or hasattr(value, "__name__") else type(value)
    return str(getattr(named, "__name__", type(value).__name__))


def _built_model(cls: type, namespace: dict[str, Any], extra: list[Check]) -> nn.Module | None:
    """The model class built at V=11, T_max=16, L=2, H=2, D=16 as `gptlab check` builds it, or None with a
    SKIP line in `extra` saying why."""
    try:
        return build(cls, cls.__name__, sizes(16, 2), namespace)
    except BuildError as error:
        extra.append(skipped("§7.1", f"{cls.__name__} builds", f"{error}: pass an instance, model="
                             f"{cls.__name__}(...), at V=11, T_max=16, L=2, H=2, D=16"))
        return None


def _copy(instance: nn.Module, label: str) -> nn.Module:
    """A deep copy of the learner's instance: the checks redraw weights and switch to eval mode."""
    try:
        return copy.deepcopy(instance)
    except Exception as error:  # the learner's module may hold anything
        raise TypeError(f"cannot copy the {label} instance ({type(error).__name__}: {error}), and the checks "
                        f"would change its weights: pass the class {label} instead") from error


def _copying_class(instance: nn.Module) -> type:
    """An nn.Module class whose every construction is a fresh copy of `instance`: grade builds it as it
    would build the learner's class, so each check gets the instance at its own sizes."""
    label = type(instance).__name__
    _copy(instance, label)  # fails here, once, if the instance cannot be copied

    def new(cls: type, *args: Any, **kwargs: Any) -> nn.Module:
        return _copy(instance, label)

    return type(label, (nn.Module,), {"__new__": new, "__module__": type(instance).__module__,
                                      "__qualname__": type(instance).__qualname__})


def _translated(results: list[Check], given: dict[str, Any]) -> list[Check]:
    """grade's lines, told for a notebook: a kind not given says so (a model class that cannot be built has
    its own line already); a multi-head instance's size-bound checks SKIP, as does a §4.2 failure measured
    with a head count the instance does not state."""
    instance = given.get("heads") if isinstance(given.get("heads"), nn.Module) else None
    out = []
    for c in results:
        kind = MISSING.get(c.section)
        if c.passed is None and kind is not None and "the file defines no" in c.note:
            if kind in given:
                continue
            what = "a function" if kind == "attention" else "a class or an instance"
            c = replace(c, note=f"not given: pass {kind}= ({what}) to check it")
        elif instance is not None and c.section in SIZE_BOUND:
            c = skipped(c.section, c.name.split(", D=")[0], f"{SIZE_BOUND[c.section]}; an instance is "
                        f"checked at its own sizes: pass the class {_label(instance)} for this check")
        elif instance is not None and c.section == "§4.2" and c.passed is False and _guessed_heads(instance):
            c = skipped(c.section, c.name, f"{_label(instance)} states no head count "
                        f"({', '.join(HEAD_COUNTS)}), so H=2 was assumed and did not fit: give it an n_head "
                        "attribute, or pass the class")
        out.append(c)
    return out


def _guessed_heads(module: nn.Module) -> bool:
    """Whether the checks would have to guess the module's head count: it has no attribute naming it and
    no structure (one module per head, nn.MultiheadAttention) that shows it."""
    width = input_width(module, 0)
    wirings = [find_wiring(module, width, n_head) for n_head in (1, 2)]
    return all(isinstance(w, Wiring) for w in wirings) and len({getattr(w, "n_head", 0) for w in wirings}) > 1
