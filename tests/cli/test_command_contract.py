"""The command contract (issue 54), held by walking the argparse tree of every command and subcommand, so a
new command or option is covered without anyone remembering to: every option declares its kind and range
where argparse can see it (`cli.common.Bounded`, `InputFile`, `RunPath`, `OutputFile`, choices), and each
value outside it (a number past a bound, inf, nan; a missing path, a folder where a file is wanted, a file
not in UTF-8) is refused with exit status 2 and one line naming the option, no traceback, and nothing
written or changed. Values in range are not run here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptlab.cli import build_parser, main
from gptlab.cli.common import (
    Bounded,
    InputFile,
    OutputFile,
    OutputFolder,
    RunPath,
    json_object,
    true_or_false,
)

# Options this test cannot try by their declared kind, and why. Everything else must declare one.
EXEMPT = {
    "--device": "a device name: which exist is the machine's answer (resolve_device refuses in one line)",
    "--data": "a built-in corpus name, a file, a folder or a glob: resolved at run time (did-you-mean there)",
    "--log": "destinations checked by TrainConfig.log, one line naming it, before anything is written",
    "--link": "a symlink to point at the finished run: only a link (or nothing) is replaced, at run time",
}
KINDS = (Bounded, InputFile, OutputFile, OutputFolder, RunPath)
# Text, parsed and refused by the command itself.
FREE_TEXT = ("--prompt", "--message", "--system", "--clean", "--corrupt", "--target", "--foil", "--regex",
             "--choice", "--stop", "--input", "--host", "--allowed-hosts", "--api-key", "--replace",
             "--edges", "--known", "--vary", "--baseline", "--tasks", "--variant", "--site", "--lora-targets",
             "--attention", "--heads", "--block", "--model", "--seeds")


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command and subcommand's words and parser, the top level included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def options() -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    """Every option that takes a value, with the words of its command."""
    for path, parser in commands(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                yield path, action


def outside_values(action: argparse.Action, folder: Path) -> list[str]:
    """The values outside the option's declared kind, made in `folder` where they are paths."""
    kind = action.type
    if isinstance(kind, Bounded):
        return kind.outside()
    if action.choices is not None:
        return ["not-one-of-the-choices"]
    missing, a_folder = str(folder / "missing"), str(folder / "a-folder")
    if isinstance(kind, InputFile):
        return [missing, a_folder] + ([str(folder / "latin1.txt")] if kind.text else [])
    if isinstance(kind, RunPath):
        return [missing]
    if isinstance(kind, OutputFile):
        return [a_folder]
    if isinstance(kind, OutputFolder):
        return [str(folder / "latin1.txt")]  # an existing file where a folder is wanted
    if kind is true_or_false:
        return ["maybe"]
    if kind is json_object:
        return ["not-json", "[1]"]
    return []


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` and its content's hash."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def undeclared(action: argparse.Action) -> bool:
    """Whether the option takes a value whose kind the contract cannot see."""
    name = action.option_strings[0]
    if name in EXEMPT or name in FREE_TEXT or action.choices is not None:
        return False
    return not isinstance(action.type, KINDS) and action.type not in (true_or_false, json_object)


def test_every_option_declares_its_kind() -> None:
    loose = sorted({f"{' '.join(path)} {a.option_strings[0]}" for path, a in options() if undeclared(a)})
    assert loose == [], "declare each one's kind (cli.common), or exempt it here with the reason"


def test_every_value_outside_an_option_is_one_line_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "runs").mkdir()
    before = snapshot(tmp_path)
    tried, values, problems = set(), 0, []
    parser = build_parser()  # what main() parses with, built once: each refusal happens while parsing
    for path, action in options():
        for value in outside_values(action, tmp_path):
            flag = action.option_strings[0]
            argv = [*path, f"{flag}={value}"]
            with pytest.raises(SystemExit) as exited:
                parser.parse_args(argv)
            err = capsys.readouterr().err
            tried.add((path, flag))
            values += 1
            if exited.value.code != 2 or err.count("\n") != 1 or flag not in err or "Traceback" in err:
                problems.append(f"gptlab {' '.join(argv)} -> exit {exited.value.code}: {err!r}")
    assert problems == []
    assert snapshot(tmp_path) == before
    print(f"{len(tried)} options tried with {values} values outside their kinds; {len(EXEMPT)} exempt, "
          f"{len(FREE_TEXT)} free text")
    assert len(tried) > 100


def test_a_missing_run_is_one_line_with_a_suggestion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    run_commands = [path for path, parser in commands(build_parser())
                    if any(isinstance(a.type, RunPath) and not a.option_strings for a in parser._actions)]
    assert len(run_commands) >= 15
    for path in run_commands:
        assert main([*path, "demo"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, (path, err)
        assert f"did you mean {os.path.join('runs', 'demo')}?" in err, (path, err)
