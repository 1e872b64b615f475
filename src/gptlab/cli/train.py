"""The prepare / train / consolidate commands: text into token files, a training run, sharded checkpoints
into single files."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptlab.cli.common import (
    COUNT,
    NATURAL,
    Bounded,
    InputFile,
    OutputFolder,
    RunPath,
    add_config_arguments,
    add_run_options,
    config_overrides,
    print_configs,
    report_run,
)
from gptlab.cli.sample import print_samples
from gptlab.config import CORPORA, TOKENIZERS, ModelConfig, SamplingConfig, TrainConfig

SAMPLES = "samples.txt"  # the samples printed after training, kept in the run folder


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus or text into train.bin / val.bin beside its tokenizer."""
    from gptlab.common import on_terminal
    from gptlab.data.prepare import prepare

    meta = prepare(args.source, args.out, tokenizer=args.tokenizer or "char",
                   vocab_size=args.tokenizer_vocab_size, val_fraction=args.val_fraction,
                   progress=not args.no_progress and on_terminal(), split=args.split)
    tokens = meta["tokens"]
    print(f"wrote {args.out}: {tokens['train']:,} train and {tokens['val']:,} validation tokens, "
          f"{meta['tokenizer']} tokenizer with {meta['vocab_size']:,} ids")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train a new run (or resume one), then report its evaluation and a few samples.

    Under torchrun every process runs this; the library joins the process group, rank 0 prepares the
    data, and only rank 0 prints.
    """
    from gptlab.checkpoint import LAST, has_checkpoint
    from gptlab.common import on_terminal
    from gptlab.inference.loading import load
    from gptlab.training import distributed
    from gptlab.training.final import final_evaluation
    from gptlab.training.resume import resume_as_given

    out = Path(args.out)
    is_main = distributed.this_process().is_main
    repeated = not args.resume and has_checkpoint(out, LAST)  # the same command again continues its run
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun --max-restarts counts here
    if repeated and is_main:
        print(f"note: torchrun restarted the workers (restart {restart}): continuing {out} from its last "
              "checkpoint" if restart else
              f"note: {out} already holds a run: continuing it, as --resume would")
    if args.resume or repeated:
        result = resume_as_given(out, preset=args.preset, toml_path=args.config,
                                 model_overrides=config_overrides(args, ModelConfig),
                                 train_overrides=config_overrides(args, TrainConfig), data=args.data,
                                 tokenizer=args.tokenizer, vocab_size=args.tokenizer_vocab_size,
                                 init_from=args.init_from, stop_at=args.stop_at,
                                 progress=not args.no_progress)
    else:
        result = train_new(args, out, is_main)
    if not is_main:
        return result.exit_status
    # One validation number: a finished run's best checkpoint scored on its val split in order (more
    # tokens than the sampled batches that chose it), the line `gptlab eval RUN` prints; an interrupted
    # run reports that estimate. The scoring says what it does first, and draws a bar on a terminal.
    bar = not args.no_progress and on_terminal()
    report_run(result, out, None if result.interrupted else
               lambda: final_evaluation(out, bar, lambda line: print(line, flush=True)).line())
    if result.interrupted:
        return result.exit_status
    if args.samples:  # kept beside the run as printed: the same command again writes them again
        print_samples(load(out), "\n", args.samples, SamplingConfig(temperature=0.8, seed=0),
                      save=out / SAMPLES)
        print(f"(these samples are saved in {out / SAMPLES})")
    if args.link:
        print_next_commands(out, Path(args.link))
    return 0


def train_new(args: argparse.Namespace, out: Path, is_main: bool) -> Any:
    """A new run as the options describe it, its configs printed first (by the main process)."""
    from gptlab.data.corpora import check_source
    from gptlab.training.loop import train
    from gptlab.training.presets import resolve_configs

    model_overrides = config_overrides(args, ModelConfig)
    if args.init_from and model_overrides:
        flags = ", ".join("--" + name.replace("_", "-") for name in model_overrides)
        raise ValueError(f"--init-from takes the model from the checkpoint: {flags} cannot change it")
    model_config, train_config = resolve_configs(
        args.preset, args.config, model_overrides, config_overrides(args, TrainConfig)
    )
    check_source(args.data or "shakespeare")  # a mistyped --data is refused before the configs print
    if is_main:
        print_configs({"model": model_config, "train": train_config}, hidden=("vocab_size",))
    return train(out, args.data or "shakespeare", model_config, train_config,
                 tokenizer=args.tokenizer or "char", vocab_size=args.tokenizer_vocab_size,
                 stop_at=args.stop_at, progress=not args.no_progress, init_from=args.init_from)


def print_next_commands(out: Path, link: Path) -> None:
    """Point `link` at the finished run, then print the run's real path and three commands that work on it
    as printed: on `link` when it points there, else on the run's own folder."""
    from gptlab.checkpoint import load_header
    from gptlab.training.runs import point_link

    why_not = point_link(link, out)
    where = out if why_not else link
    shown = f" ({link} points to it)" if not why_not and link.absolute() != out.absolute() else ""
    print(f"\nthe run: {out.resolve()}{shown}" + (f"\nnote: {why_not}" if why_not else ""))
    try:
        load_header(out).load_tokenizer().encode("ROMEO:")
        prompt = ["--prompt", "ROMEO:"]
    except ValueError:  # a text without those characters: the default prompt, a newline
        prompt = []
    program = gptlab_program()
    print("next (as printed, from this folder):")
    for command in (["sample", str(where), *prompt], ["eval", str(where)], ["serve", str(where)]):
        print("  " + " ".join([program, shlex.join(command)]))


def gptlab_program() -> str:
    """How to call this gptlab as printed: `gptlab` when it is the one on PATH, else this environment's
    script (relative to the working folder when inside it), else `python -m gptlab`."""
    script = shutil.which("gptlab", path=str(Path(sys.executable).parent))
    if script is None:
        return shlex.join([sys.executable, "-m", "gptlab"])
    on_path = shutil.which("gptlab")
    if on_path and Path(on_path).resolve() == Path(script).resolve():
        return "gptlab"
    try:
        relative = Path(script).relative_to(Path.cwd())
    except ValueError:
        return shlex.quote(script)
    return shlex.quote(str(relative) if len(relative.parts) > 1 else f"./{relative}")  # a slash: not PATH's


def cmd_consolidate(args: argparse.Namespace) -> int:
    from gptlab.checkpoint import consolidate

    written = consolidate(Path(args.run))
    for file in written:
        print(f"wrote {file}")
    if not written:
        print(f"{args.run} holds single-file checkpoints already: nothing to consolidate")
    return 0


def add_prepare_command(sub: Any) -> None:
    """The prepare command."""
    source_help = f"a built-in corpus ({', '.join(CORPORA)}), a text file, a folder or a glob"
    prep = sub.add_parser(
        "prepare", help="tokenize text into train/val token files",
        description="Tokenize a corpus into OUT/train.bin and OUT/val.bin (memory-mapped token ids), "
        "OUT/tokenizer.json and OUT/meta.json, holding out a deterministic validation split.",
    )
    prep.add_argument("source", help=source_help)
    prep.add_argument("--out", required=True, type=OutputFolder(),
                      help="folder to write (replaced only on success)")
    prep.add_argument("--val-fraction", type=Bounded(float, 0, 1), default=0.1,
                      help="share held out for validation")
    prep.add_argument("--split", choices=("spread", "tail"), default="spread",
                      help="spread: every tenth chunk validates, across the whole corpus (default); tail: "
                      "the last val-fraction of the text validates, as nanoGPT splits")
    add_tokenizer_options(prep, TOKENIZERS)
    prep.set_defaults(func=cmd_prepare)



def add_train_commands(sub: Any) -> None:
    """The train and consolidate commands."""
    tr = sub.add_parser(
        "train", help="train a model (the main job)",
        description="Train a GPT on a corpus with teacher forcing. Settings are layered: defaults, "
        "then --preset, then --config FILE.toml ([model] and [train] tables), then options below. "
        "The run folder gets config.json, metrics.csv, steps.csv, loss.png, last.safetensors and "
        "best.safetensors (sharded under torchrun --parallel fsdp: see --checkpoint-format). Ctrl-C saves "
        "and stops; --resume continues exactly.",
        epilog="example: gptlab train --preset demo --data shakespeare --out runs/demo",
    )
    tr.add_argument("--out", default="runs/latest", type=OutputFolder(),
                    help="run folder (default: runs/latest)")
    add_run_options(tr)
    tr.add_argument("--init-from", metavar="RUN", type=RunPath(),
                    help="fine-tune: start from this run's (or an imported "
                    "model's) weights and architecture, tokenizing --data with its tokenizer")
    tr.add_argument("--samples", type=NATURAL, default=2, help=f"samples printed after training and saved in "
                    f"OUT/{SAMPLES} (default 2)")
    tr.add_argument("--link", metavar="PATH", help="when the run finishes, point the symlink PATH at it "
                    "(replacing an older link at once), then print the run's path and the next commands on "
                    "PATH (make demo keeps runs/demo so)")
    add_train_options(tr, data_help=", or a prepared folder (default shakespeare); with --resume, the run's "
                      "prepared folder if it was moved")
    tr.set_defaults(func=cmd_train)

    co = sub.add_parser(
        "consolidate", help="turn a run's sharded checkpoints into single safetensors files",
        description="A run trained under torchrun with --parallel fsdp saves sharded checkpoints "
        "(RUN/shards/, named by last.shards.json and best.shards.json): every command reads them as they "
        "are. "
        "consolidate writes last.safetensors and best.safetensors from them in one process and removes "
        "the shards, for copying a run as two files or for tools that read one file.",
        epilog="example: gptlab consolidate runs/fsdp",
    )
    co.add_argument("run", type=RunPath(), help="run folder")
    co.set_defaults(func=cmd_consolidate)


def add_train_options(parser: argparse.ArgumentParser, data_help: str,
                      exclude: Sequence[str] = ()) -> None:
    """What a training run is made of: --preset, --config, --data and its tokenizer, and one option per
    model and training field (shared by `train` and `compare`)."""
    from gptlab.training.presets import PRESETS

    parser.add_argument("--preset", choices=list(PRESETS), help="named settings to start from")
    parser.add_argument("--config", type=InputFile(), metavar="FILE.toml",
                        help="TOML file with [model] and [train] tables")
    parser.add_argument("--data", help=f"a built-in corpus ({', '.join(CORPORA)}), a text file, a folder "
                        "or a glob" + data_help)
    add_tokenizer_options(parser, TOKENIZERS)
    # vocab_size comes from the tokenizer (so --vocab-size is the tokenizer's); causal is never switched off
    add_config_arguments(parser, ModelConfig, "model options", exclude=("vocab_size", "causal"))
    add_config_arguments(parser, TrainConfig, "training options", exclude=exclude)


def add_tokenizer_options(parser: argparse.ArgumentParser, tokenizers: Sequence[str]) -> None:
    parser.add_argument("--tokenizer", choices=tokenizers, help="how text becomes ids (default char)")
    parser.add_argument("--vocab-size", type=COUNT, dest="tokenizer_vocab_size", metavar="N",
                        help="vocabulary size of a trained bpe tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
