"""The learner commands: `gptlab check` grades a learner's own implementation against the handout, and
`gptlab break` writes or trains the classic bugs it catches. Thin wiring over gptlab.handout.learner."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.cli.common import COUNT, Bounded, OutputFile, OutputFolder

if TYPE_CHECKING:
    from gptlab.handout.learner.isolate import FileReport

CHECK_DESCRIPTION = """\
Import each FILE.py (your own implementation) and run every check of handout #11 that applies to
what it defines, one line each: PASS, FAIL or SKIP, the section and the check; a failure says what
was expected, what was measured and the most likely cause with its fix. The documented names:

  attention(q, k, v[, mask])  a function returning y, or (y, weights): §2.1 retrieval [2, 1.5],
                              §3.1 scale by sqrt(d_k), §3.2 rows sum to one, batch items do not
                              mix, inputs of rank 3 and 4
  MultiHeadAttention          a module, fused or one module per head: §4 parameter count,
                              §4.1 two heads are concatenated, not averaged, §4.2 fused = separate
  Block                       a Transformer block: §5 LayerNorm across features, pre- or post-norm
  a model                     ids [B, T] -> logits [B, T, V], built by --model EXPR: §6.1 order,
                              §7.1 appending a token, §7.3 no output sees a later input, the loss
                              is next-token

A check that cannot apply (no weights to set, no mask argument) is SKIPped with the reason, never
passed. A folder given as FILE.py means the .py files in it. Each file runs in a child process of
its own with a time limit and a memory limit, on a copy of itself and of the modules and packages it
imports from its folder (never another FILE.py of the command), so an endless loop, an allocation
without bound or a crash is one line naming the file; on Linux the children are forked from one
process that imported torch once, so only the first file waits for torch's import, and --jobs N
checks N at a time (the report keeps the files' order). This is isolation against mistakes,
NOT a sandbox: the file's code runs with your rights, so check only code you would run yourself (or
run gptlab check inside a container). Exit status: 0 every check that applies passed, 1 a check
failed or a file could not be checked, 2 a usage mistake."""

CHECK_EPILOG = """\
examples:
  gptlab check attention.py
  gptlab check model.py --model "GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8))"
  gptlab check mine.py --attention scaled_attention --heads Heads --verbose
  gptlab check submissions/*.py --csv grades.csv
  gptlab check submissions/ --jobs 2
  gptlab check mine.py --html pages        # then open pages/mine.html
  gptlab check /autograder/submission/model.py --gradescope /autograder/results/results.json"""

BREAK_DESCRIPTION = """\
The gallery of classic bugs in attention and GPT code. --list names them; BUG --write FILE.py
writes a learner-style implementation with that bug (an exercise: find it, or run gptlab check on
it); `reference --write FILE.py` writes the correct one; BUG --train trains the bugged model beside
the correct one for --seconds each and shows what the bug does, with a picture. Every bug of kind
"bug" is caught by gptlab check at its section; the two of kind "choice" (positions missing,
post-norm without warm-up) are not failed by check: --train shows what they cost."""

BREAK_EPILOG = """\
examples:
  gptlab break --list
  gptlab break mask-after-softmax --write exercise.py && gptlab check exercise.py
  gptlab break unshifted-targets --train --seconds 60 --out runs/break"""


def learner_files(names: list[str]) -> list[Path]:
    """The files to check: each FILE.py given, and for a folder its .py files, sorted."""
    paths = []
    for path in map(Path, names):
        if path.is_dir():
            found = sorted(inside for inside in path.glob("*.py") if inside.is_file())
            if not found:
                raise ValueError(f"{path}: a folder with no .py file in it")
            paths += found
        elif not path.is_file():
            raise ValueError(f"{path}: no such file")
        elif path.suffix != ".py":
            raise ValueError(f"{path} is not a Python file: give the .py file that defines your attention, "
                             "heads, block or model")
        else:
            paths.append(path)
    return paths


def refuse_outputs(args: argparse.Namespace, paths: list[Path]) -> None:
    """Refuse, before anything runs, a --csv or --html that would replace a file gptlab check did not write
    (its own earlier grades and pages are written again: the same command twice just works)."""
    from gptlab.files import written_by_gptlab
    from gptlab.handout.learner.outputs import grades_written_by_check, page_file

    grades, folder = Path(args.csv or ""), Path(args.html or "")
    if args.csv and grades.is_dir():
        raise ValueError(f"--csv {grades} is a folder: give the file to write the grades to")
    if args.csv and grades.exists() and not grades_written_by_check(grades):
        raise ValueError(f"--csv {grades} exists and was not written by gptlab check: move it, or give "
                         "another file")
    if args.html and folder.exists() and not folder.is_dir():
        raise ValueError(f"--html {folder} is a file: give a folder for the pages")
    pages = [page_file(folder, path) for path in paths] if args.html else []
    for page in pages:
        if page.exists() and not written_by_gptlab(page):
            raise ValueError(f"--html {folder}: {page} exists and was not written by gptlab: move it, or "
                             "give another folder")


def cmd_check(args: argparse.Namespace) -> int:
    """Check each file in its own child process, --jobs at a time, print the reports in the files' order,
    write the files asked for (the CSV as each file is graded, so it outlives an interruption)."""
    from gptlab.handout.learner import server

    if args.timeout <= 0 or args.memory_mb <= 0:
        raise ValueError("--timeout and --memory-mb must be positive")
    if args.jobs < 1:
        raise ValueError("--jobs must be at least 1")
    paths = learner_files(args.files)
    refuse_outputs(args, paths)
    if server.FORK_SERVER:
        server.connection()  # started now, its torch import overlaps this process's, just below
    from gptlab.handout.learner.formats import json_records, succeeded, write_gradescope

    reports = check_all(args, paths)
    if args.json:
        print("[" + ",\n".join(json.dumps(record, allow_nan=False) for record in json_records(reports)) + "]")
    if args.gradescope:
        write_gradescope(reports, Path(args.gradescope))
    if args.html:
        from gptlab.handout.learner.page import write_page

        pages = [write_page(report, Path(args.html), report.pictures) for report in reports]
        print(f"wrote {len(pages)} page{'s' * (len(pages) != 1)} to {args.html}/ (open {pages[0].name} in a "
              "browser)", file=sys.stderr if args.json else sys.stdout)
    if len(reports) > 1 and not args.json:
        print(f"\n{sum(map(succeeded, reports))} of {len(reports)} files passed every check that applies")
    return 0 if all(map(succeeded, reports)) else 1


def check_all(args: argparse.Namespace, paths: list[Path]) -> list[FileReport]:
    """The reports of `paths`, checked --jobs at a time, each printed as it comes in the files' order (as
    text, without --json); each file's row is written to --csv as soon as it is graded. The check server
    ends with the command: interrupted, running checks are killed at once."""
    from concurrent.futures import ThreadPoolExecutor

    from gptlab.handout.learner import server
    from gptlab.handout.learner.formats import csv_rows, text_lines
    from gptlab.handout.learner.grade import Names
    from gptlab.handout.learner.isolate import check_file
    from gptlab.handout.learner.outputs import GradesCsv

    given = {"attention": args.attention, "heads": args.heads, "block": args.block, "model": args.model}
    names = Names(**{field: value for field, value in given.items() if value is not None})
    grades = GradesCsv(Path(args.csv), len(paths)) if args.csv else None

    def graded(index: int, path: Path) -> FileReport:
        report = check_file(path, names, args.timeout, args.memory_mb, pictures=bool(args.html),
                            learning=args.learning, batch=paths)
        if grades is not None:
            grades.add(index, csv_rows([report])[0])
        return report

    reports = []
    pool = ThreadPoolExecutor(args.jobs)
    try:
        for report in pool.map(graded, range(len(paths)), paths):
            reports.append(report)
            if not args.json:
                print("\n".join(text_lines(report, args.verbose)), flush=True)
        return reports
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        server.stop_server()
        pool.shutdown()


def cmd_break(args: argparse.Namespace) -> int:
    """List the bugs, write one (or the reference) as a learner-style file, or train one and the reference."""
    from gptlab.handout.learner import bugs  # imported here so that `gptlab check` never needs the gallery

    if args.list:
        width = max(len(name) for name in bugs.BUGS)
        for bug in bugs.BUGS.values():
            print(f"{bug.name:<{width}}  {bug.kind:<6}  {bug.section:<5}  {bug.title}")
        print(f"{'reference':<{width}}  {'':<6}  {'':<5}  the correct implementation (with --write)")
        return 0
    if args.bug is None or not (args.write or args.train):
        raise ValueError("give --list, or a bug with --write FILE.py or --train (--list names the bugs)")
    if args.bug == "reference":
        if args.train:
            raise ValueError("the reference trains beside every bug: name a bug to --train")
        bugs.write_reference(Path(args.write))
        print(f"wrote {args.write}: the correct implementation")
        return 0
    bug = bugs.bug_named(args.bug)
    if args.write:
        bugs.write_bug(bug.name, Path(args.write))
        found = "finds it" if bug.kind == "bug" else "does not fail it (a choice: --train shows its cost)"
        print(f"wrote {args.write}: {bug.title}; gptlab check {args.write} {found}")
        return 0
    from gptlab.handout.learner.side_by_side import train_side_by_side

    for line in train_side_by_side(args.bug, args.seconds, Path(args.out)):
        print(line)
    return 0


def add_learner_commands(sub: Any) -> None:
    """`gptlab check` and `gptlab break`."""
    check = sub.add_parser("check", help="check your own attention, heads, block or model (handout #11)",
                           description=CHECK_DESCRIPTION, epilog=CHECK_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("files", nargs="+", metavar="FILE.py", help="the learner's files, each checked apart; "
                       "a folder means its .py files")
    names = check.add_argument_group("names (when yours differ from the documented ones)")
    names.add_argument("--attention", metavar="NAME", help="the attention function (default attention)")
    names.add_argument("--heads", metavar="NAME", help="the multi-head module (default MultiHeadAttention)")
    names.add_argument("--block", metavar="NAME", help="the Transformer block (default Block)")
    names.add_argument("--model", metavar="EXPR", help="a Python expression evaluated in your file that "
                       "builds the whole model, e.g. \"GPT(GPTConfig(vocab_size=11, block_size=16, "
                       "n_layer=2, n_head=2, n_embd=8))\" (default: your GPT class, or one named like it, "
                       "built from its config)")
    check.add_argument("--verbose", action="store_true", help="show the numbers behind each line and the "
                       "traceback of a file that fails, trimmed to the frames in that file")
    check.add_argument("--json", action="store_true", help="print one JSON object per check instead of text")
    check.add_argument("--gradescope", metavar="RESULTS.json", type=OutputFile(),
                       help="also write Gradescope's autograder "
                       "results (one test per check, one point each)")
    check.add_argument("--csv", metavar="GRADES.csv", type=OutputFile(),
                       help="also write one row per file: file, passed, "
                       "failed, skipped, score (percent of the checks that apply), error; rewritten as each "
                       "file is graded, so an interrupted batch keeps its grades")
    check.add_argument("--html", metavar="DIR", type=OutputFolder(),
                       help="also write one offline page per file into DIR: the "
                       "checks, your attention weights on the handout's worked inputs beside the reference, "
                       "and each block's dependence of output i on input j, a leak above the diagonal marked")
    check.add_argument("--no-learning", dest="learning", action="store_false", help="leave out the §7.2 "
                       "learning checks (initial loss, gradients, memorising a batch: up to a second each)")
    check.add_argument("--timeout", type=Bounded(float, 1e-3), default=60, metavar="S",
                       help="seconds each file may take "
                       "(default 60); the first files' include starting torch (~2 s, once)")
    check.add_argument("--jobs", type=COUNT, default=1, metavar="N",
                       help="files checked at a time, the report "
                       "still in the files' order (default 1)")
    check.add_argument("--memory-mb", type=COUNT, default=4096, metavar="N", help="memory each file's code "
                       "may take beyond the torch import, Linux only (default 4096)")
    check.set_defaults(func=cmd_check)

    brk = sub.add_parser("break", help="the gallery of classic attention bugs: write or train one",
                         description=BREAK_DESCRIPTION, epilog=BREAK_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    brk.add_argument("bug", nargs="?", metavar="BUG", help="a bug's name (see --list), or reference")
    action = brk.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true", help="name the bugs, their kind and section")
    action.add_argument("--write", metavar="FILE.py", type=OutputFile(),
                        help="write a learner-style file with the bug")
    action.add_argument("--train", action="store_true", help="train the bugged and the correct model and "
                        "show the difference")
    brk.add_argument("--seconds", type=Bounded(float, 1e-3), default=60,
                     help="training time of each model (default 60)")
    brk.add_argument("--out", default="runs/break", type=OutputFolder(),
                     help="folder for the picture (default runs/break)")
    brk.set_defaults(func=cmd_break)
