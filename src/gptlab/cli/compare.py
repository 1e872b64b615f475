"""The compare command: train a grid of settings over seeds, and report the differences with their noise."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from typing import Any

from gptlab.cli.common import COUNT, OutputFolder, config_overrides
from gptlab.config import ModelConfig, SettingError, TrainConfig


def cmd_compare(args: argparse.Namespace) -> int:
    """Plan the grid (refusing a bad key or value), then print it (--dry-run) or train it and report."""
    from gptlab.experiments.compare import compare, describe, plan
    from gptlab.experiments.grid import RunOptions
    from gptlab.training.machine import share_cores

    options = RunOptions(preset=args.preset, config=args.config, data=args.data or "shakespeare",
                         tokenizer=args.tokenizer or "char", tokenizer_vocab_size=args.tokenizer_vocab_size,
                         model=config_overrides(args, ModelConfig), train=config_overrides(args, TrainConfig))
    varies = [parse_vary(text) for text in args.vary]
    seeds = parse_seeds(args.seeds)
    if args.dry_run:
        jobs, threads = share_cores(args.jobs)
        with tempfile.TemporaryDirectory() as nowhere:  # a dry run writes nothing: an --out only names runs
            grid = plan(options, varies, seeds, args.out or nowhere, args.baseline)
            for line in describe(grid, jobs, threads):
                print(line)
        return 0
    if args.out is None:
        raise ValueError("compare needs --out FOLDER to train into (only --dry-run goes without)")
    command = shlex.join(["gptlab", *sys.argv[1:]]) if sys.argv[1:2] == ["compare"] else ""
    result = compare(options, varies, seeds, args.out, jobs=args.jobs, baseline=args.baseline,
                     progress=not args.no_progress, command=command, spell=cli_spelling)
    for summary in result.summaries:
        if summary.n:
            mean, sd = summary.mean_sd("final_val")
            spread = "" if summary.n < 2 else f" ± {sd:.4f}"
            print(f"{summary.cell.name}: final val loss {mean:.4f}{spread} over {summary.n} seed(s)")
    if result.failed:
        for outcome in result.failed:
            message = outcome.describe(cli_spelling)
            print(f"gptlab: {outcome.label} {outcome.status}: {message}", file=sys.stderr)
        return 1
    print(f"report: {result.out / 'report.md'} (and report.html, curves.png)")
    return 0


def parse_vary(text: str) -> tuple[str, tuple[str, ...]]:
    """`KEY=V1,V2` -> (key as a field name, the values); the key may be written as its flag."""
    key, sep, values = text.partition("=")
    key = key.strip().removeprefix("--").replace("-", "_")
    items = tuple(v.strip() for v in values.split(","))
    if not sep or not key or not all(items):
        raise ValueError(f"--vary {text!r} must be KEY=V1,V2[,...], e.g. --vary positions=learned,rope")
    if len(set(items)) != len(items):
        raise ValueError(f"--vary {text!r} repeats a value: give each value once")
    return key, items


def parse_seeds(text: str) -> tuple[int, ...]:
    """`3` -> seeds 1, 2, 3; `1,5,9` -> those seeds."""
    try:
        seeds = tuple(int(s) for s in text.split(",")) if "," in text else tuple(range(1, int(text) + 1))
    except ValueError:
        raise ValueError(f"--seeds {text!r} must be a count (3: seeds 1, 2, 3) or a list (1,5,9)") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r} must give at least one seed, each once and not negative")
    return seeds


def add_compare_command(sub: Any) -> None:
    """`gptlab compare`."""
    from gptlab.cli.train import add_train_options

    cmp = sub.add_parser(
        "compare", help="train a grid of settings over seeds and test the differences",
        description="Train every combination of the --vary values, each with every seed, from the same "
        "data and options (any option of gptlab train), then write OUT/report.md, OUT/report.html and "
        "OUT/curves.png: each cell's final validation loss as mean ± sd over seeds, its difference to the "
        "baseline with Welch's t-test, and the curves. Each run is a normal run folder, "
        "OUT/<cell>/seed-<n>. The same command again trains nothing new: finished runs are kept, "
        "interrupted ones resumed, more seeds or values added.",
        epilog="example: gptlab compare --preset speedrun --vary positions=learned,rope,none --seeds 3 "
        "--out runs/positions",
    )
    cmp.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                     help="an option of gptlab train and its values, e.g. positions=learned,rope or "
                     "lr=3e-3,6e-3; repeat for a product of several")
    cmp.add_argument("--seeds", default="3", metavar="N", help="train each cell with seeds 1..N, or with "
                     "the seeds listed (1,5,9) (default 3)")
    cmp.add_argument("--out", type=OutputFolder(),
                     help="folder of the comparison (created; the same --out continues it); "
                     "required except with --dry-run")
    cmp.add_argument("--jobs", type=COUNT, metavar="N", help="runs trained at once, the cores shared among "
                     "them (default: one per core, one thread each)")
    cmp.add_argument("--baseline", metavar="CELL", help="the cell the others are compared with, by name "
                     "(positions=learned) or values (learned) (default: the first)")
    cmp.add_argument("--dry-run", action="store_true", help="print the grid, the number of runs and a "
                     "measured time estimate; train nothing")
    add_train_options(cmp, data_help=", or a prepared folder (default shakespeare)", exclude=("seed",))
    cmp.set_defaults(func=cmd_compare)


def cli_spelling(err: SettingError) -> str:
    """A failed run's message with its settings named as the command line names them."""
    from gptlab.cli.common import ARGUMENT_FLAGS

    return err.as_flags(ARGUMENT_FLAGS)
