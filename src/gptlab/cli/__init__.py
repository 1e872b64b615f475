"""The `gptlab` command: a thin layer over the library, one subcommand per job.

Every subcommand is a small function over library calls; user mistakes (ValueError, missing files)
become one `gptlab: error: ...` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from gptlab.cli.common import TqdmHandler
from gptlab.cli.hf import add_hf_commands
from gptlab.cli.inspect import add_inspect_commands
from gptlab.cli.seq2seq import add_seq2seq_commands
from gptlab.cli.text import add_data_commands, add_model_commands

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptlab",
        description="Small Transformer language models (and encoder-decoders), verified against handout #11.",
        epilog="Start with `gptlab lab` to see the handout's numbers reproduced by the library.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_model_commands(sub)
    add_data_commands(sub)
    add_hf_commands(sub)
    add_inspect_commands(sub)
    add_seq2seq_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gptlab` console command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[TqdmHandler()], force=True)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, OSError) as err:
        print(f"gptlab: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gptlab: interrupted", file=sys.stderr)
        return 130
