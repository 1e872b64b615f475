"""The `gptlab` command: a thin layer over the library, one subcommand per job.

Every subcommand is a small function over library calls; user mistakes (ValueError, missing files)
become one `gptlab: error: ...` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from gptlab.cli.adapt import add_adapt_commands
from gptlab.cli.chat import add_chat_command
from gptlab.cli.common import ARGUMENT_FLAGS, TqdmHandler
from gptlab.cli.compare import add_compare_command
from gptlab.cli.eval import add_eval_command
from gptlab.cli.hf import add_hf_commands
from gptlab.cli.inspect import add_inspect_commands
from gptlab.cli.lab import add_model_commands
from gptlab.cli.learner import add_learner_commands
from gptlab.cli.sample import add_sample_command
from gptlab.cli.seq2seq import add_seq2seq_commands
from gptlab.cli.serve import add_serve_command
from gptlab.cli.train import add_prepare_command, add_train_commands
from gptlab.config import SettingError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptlab",
        description="Small Transformer language models (and encoder-decoders), verified against handout #11.",
        epilog="Start with `gptlab lab` to see the handout's numbers reproduced by the library.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_model_commands(sub)
    add_prepare_command(sub)
    add_train_commands(sub)
    add_eval_command(sub)
    add_sample_command(sub)
    add_hf_commands(sub)
    add_inspect_commands(sub)
    add_seq2seq_commands(sub)
    add_serve_command(sub)
    add_adapt_commands(sub)
    add_chat_command(sub)
    add_compare_command(sub)
    add_learner_commands(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every clean-up runs on the way out; the command exits 143."""


def terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gptlab` console command: 0 done, 2 a user mistake, 130 Ctrl-C, 143 SIGTERM."""
    args = build_parser().parse_args(argv)
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
        print(f"gptlab: error: {err}", file=sys.stderr)
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
