"""The `gptlab` command: a thin layer over the library, one subcommand per job.

Every subcommand is a small function over library calls; user mistakes (ValueError, missing files)
become one `gptlab: error: ...` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from gptlab.cli.adapt import add_adapt_commands
from gptlab.cli.attribute import add_attribution_commands
from gptlab.cli.chat import add_chat_command
from gptlab.cli.common import ARGUMENT_FLAGS, TqdmHandler
from gptlab.cli.compare import add_compare_command
from gptlab.cli.eval import add_eval_command
from gptlab.cli.hf import add_hf_commands
from gptlab.cli.inspect import add_inspect_commands
from gptlab.cli.lab import add_model_commands
from gptlab.cli.learner import add_learner_commands
from gptlab.cli.sae import add_sae_commands
from gptlab.cli.sample import add_sample_command
from gptlab.cli.seq2seq import add_seq2seq_commands
from gptlab.cli.serve import add_serve_command
from gptlab.cli.train import add_prepare_command, add_train_commands
from gptlab.config import SettingError

EXIT_USAGE = 2


class Version(argparse.Action):
    """`gptlab --version`: the installed version (pyproject's, which is gptlab.__version__), looked up only
    when asked, since importing importlib.metadata costs every other command some 30 ms."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib.metadata import version

        print(f"{parser.prog} {version('gptlab')}")
        parser.exit()


class CommandParser(argparse.ArgumentParser):
    """A command's parser: it refuses an argument it does not know itself, in one line naming its options,
    where argparse would hand it up to the top-level parser and print gptlab's usage instead."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's parsing, with exit status 2 and one line when an argument is left unknown."""
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.exit(EXIT_USAGE, f"{self.prog}: error: unrecognized arguments: {' '.join(extra)} "
                      f"({self.known_options(extra)})\n")
        return parsed, extra

    def error(self, message: str) -> Any:
        """A bad argument as one line naming it (argparse would print the whole usage first)."""
        self.exit(EXIT_USAGE, f"gptlab: error: {message} (`{self.prog} --help` lists its options)\n")

    def known_options(self, extra: list[str]) -> str:
        """The options close to the `extra` ones, else all of them when they are few, else where they are."""
        options = [o for action in self._actions for o in action.option_strings if o not in ("-h", "--help")]
        words = [word.split("=", 1)[0] for word in extra if word.startswith("-")]
        close = [m for word in words for m in difflib.get_close_matches(word, options, n=1, cutoff=0.75)]
        if close:
            return f"did you mean {', '.join(close)}?"
        if not options:
            return f"{self.prog} takes no options, only --help"
        if len(options) <= 6:
            return f"{self.prog} takes {', '.join(options)}"
        return f"`{self.prog} --help` lists its options"


class TopParser(argparse.ArgumentParser):
    """gptlab's own parser: a mistyped command is one line with the commands closest to it."""

    def error(self, message: str) -> Any:
        """A bad command as one line, with did-you-mean (argparse would print the whole usage first)."""
        choices = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        typed = message.split("invalid choice: ", 1)[1].split("'")[1] if "invalid choice: " in message else ""
        close = difflib.get_close_matches(typed, list(choices or {}), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else "`gptlab --help` lists the commands"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message.split(' (choose from')[0]} ({hint})\n")


def build_parser() -> argparse.ArgumentParser:
    parser = TopParser(
        prog="gptlab",
        description="Small Transformer language models (and encoder-decoders), verified against handout #11.",
        epilog="Start with `gptlab lab` to see the handout's numbers reproduced by the library.",
    )
    parser.add_argument("--version", action=Version, help="print gptlab's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    add_model_commands(sub)
    add_prepare_command(sub)
    add_train_commands(sub)
    add_eval_command(sub)
    add_sample_command(sub)
    add_hf_commands(sub)
    add_inspect_commands(sub)
    add_attribution_commands(sub)
    add_seq2seq_commands(sub)
    add_serve_command(sub)
    add_adapt_commands(sub)
    add_chat_command(sub)
    add_compare_command(sub)
    add_learner_commands(sub)
    add_sae_commands(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every clean-up runs on the way out; the command exits 143."""


def terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def error_line(err: BaseException) -> str:
    """A user's error as one line: an OS error names its file (or files) and its reason, no [Errno N]."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        files = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else str(err.filename)
        return f"{files}: {err.strerror}"
    return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gptlab` console command: 0 done, 2 a user mistake, 130 Ctrl-C, 143 SIGTERM."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exited:  # --help, --version, or an argument refused in one line: the status
        return exited.code if isinstance(exited.code, int) else EXIT_USAGE * bool(exited.code)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[TqdmHandler()], force=True)
    func: Callable[[argparse.Namespace], int] = args.func
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if in_main_thread else None
    try:
        return func(args)
    except SettingError as err:
        print(f"gptlab: error: {err.as_flags(ARGUMENT_FLAGS)}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError) as err:
        print(f"gptlab: error: {error_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated:
        print("gptlab: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("gptlab: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
