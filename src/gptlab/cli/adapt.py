"""The masks, finetune and merge commands: see what fine-tuning data trains on, train on it (fully or
with LoRA adapters), and fold adapters into a normal run."""

from __future__ import annotations

import argparse
import sys
from itertools import groupby
from pathlib import Path
from typing import Any

from gptlab.adapt.options import DEFAULTS, LORA_LR, SFTConfig
from gptlab.cli.common import (
    COUNT,
    Bounded,
    OutputFolder,
    RunPath,
    add_config_arguments,
    add_run_options,
    config_overrides,
    report_run,
)
from gptlab.config import TrainConfig

MARKS = {True: ("\x1b[1;32m", "\x1b[0m"), False: ("[[", "]]")}  # on a terminal: bold green; off one: brackets


def highlighted(example: Any, tokenizer: Any, colour: bool) -> str:
    """An example's text with its trained tokens marked, run by run (what the loss will see)."""
    opening, closing = MARKS[colour]
    out = []
    for trained, run in groupby(zip(example.ids, example.trained, strict=True), key=lambda pair: pair[1]):
        text = b"".join(tokenizer.token_bytes(token) for token, _ in run).decode("utf-8", errors="replace")
        out.append(f"{opening}{text}{closing}" if trained else text)
    return "".join(out)


def cmd_masks(args: argparse.Namespace) -> int:
    """Render the first examples of a JSONL file with their trained tokens marked, and count tokens."""
    from gptlab.adapt.chat import chat_source
    from gptlab.adapt.sft import load_examples, read_records

    if args.n < 0:
        raise ValueError(f"--n {args.n} must be 0 or more")
    shape, _ = read_records(args.data)  # bad data is one line before anything is loaded
    source = chat_source(args.base, conversations=shape == "messages")
    data = load_examples(args.data, source.tokenizer, source.template, source.block_size,
                         loss_on=args.loss_on, too_long=args.too_long)
    colour = sys.stdout.isatty()
    for note in source.notes:
        print(f"note: {note}")
    for example in data.examples[:args.n]:
        trained = sum(example.trained)
        print(f"--- line {example.line}: {len(example.ids)} tokens, {trained} trained, "
              f"{len(example.ids) - trained} not")
        print(highlighted(example, source.tokenizer, colour))
    print(f"--- {data.summary()}")
    return 0


def lora_config(args: argparse.Namespace) -> Any:
    """The LoraConfig the --lora options describe, or None without --lora."""
    from gptlab.lora import LoraConfig

    given = {name: getattr(args, f"lora_{name}") for name in ("alpha", "dropout", "targets")
             if getattr(args, f"lora_{name}") is not None}
    if args.lora is None:
        if given:
            raise ValueError(f"--lora-{next(iter(given))} needs --lora R (the adapters' rank)")
        return None
    return LoraConfig(r=args.lora, **given)


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a run on JSONL examples (or continue doing so), then report the run."""
    from gptlab.adapt.finetune import finetune, resume_finetune
    from gptlab.checkpoint import LAST, has_checkpoint, load_header
    from gptlab.training import distributed

    sft = SFTConfig(**config_overrides(args, SFTConfig))  # --data among them
    lora, train_overrides = lora_config(args), config_overrides(args, TrainConfig)
    progress = not args.no_progress
    repeated = not args.resume and has_checkpoint(Path(args.out), LAST)
    # The same command again continues its run (one that would change it is refused by name); a run of
    # another kind there is refused by resume_finetune, with no note before it.
    if repeated and "sft" in load_header(args.out, prefer=LAST).state:
        print(f"note: {args.out} already holds a fine-tuning run: continuing it, as --resume would")
    if args.resume or repeated:
        result, _, _ = resume_finetune(args.base, args.out, sft, train_overrides, lora, args.stop_at,
                                       progress)
    else:
        settings = {**DEFAULTS, **({"lr": LORA_LR} if lora else {}), **train_overrides}
        settings.setdefault("min_lr", settings["lr"] / 10)
        result, _, _ = finetune(args.base, args.out, sft, TrainConfig.from_dict(settings), lora, args.stop_at,
                                progress)
    if not distributed.this_process().is_main:
        return result.exit_status
    report_run(result, Path(args.out))
    return result.exit_status


def cmd_merge(args: argparse.Namespace) -> int:
    """Fold an adapter run's LoRA adapters into the weights, as a normal run."""
    from gptlab.adapt.finetune import merge_run

    out = merge_run(args.run, args.out)
    print(f"wrote {out / 'best.safetensors'}: the adapters of {args.run} merged into its base's weights")
    return 0


def add_adapt_commands(sub: Any) -> None:
    """The masks, finetune and merge commands (fine-tuning data, training on it, LoRA adapters)."""
    p = sub.add_parser(
        "masks", help="show which tokens of fine-tuning data are trained",
        description="Read a JSONL file of fine-tuning examples (one JSON object a line: {\"text\"}, "
        "{\"prompt\", \"completion\"} or {\"messages\": [{\"role\", \"content\"}, ...]}), render them as "
        "BASE would see them (through its chat template for messages), and print the first examples with "
        "the trained tokens marked: green on a terminal, [[in brackets]] otherwise. What is trained: all "
        "of a text; a completion and the end-of-text token after it; each assistant turn with its "
        "end-of-turn marker. Then the counts of trained and untrained tokens over the whole file.",
        epilog="example: gptlab masks runs/base --data chat.jsonl --n 2. Bad data is reported as "
        "FILE:LINE: what is wrong.")
    p.add_argument("base", type=RunPath(), metavar="RUN_OR_HF_FOLDER",
                   help="a gptlab run (its tokenizer, chat template and context) or a Hugging Face folder")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="the fine-tuning examples")
    p.add_argument("--n", type=COUNT, default=3, help="how many examples to show (default 3)")
    p.add_argument("--loss-on", choices=("completion", "all"), default="completion",
                   help="completion: only completions and assistant turns are trained (default); all: "
                   "every token")
    p.add_argument("--too-long", choices=("skip", "truncate"), default="skip",
                   help="an example longer than the context is skipped (default) or cut to fit")
    p.set_defaults(func=cmd_masks)

    add_finetune_command(sub)
    m = sub.add_parser(
        "merge", help="fold a LoRA run's adapters into the weights",
        description="Write the model of a `gptlab finetune --lora` run (its best checkpoint) as a normal "
        "run: each adapted weight becomes W + (alpha / r) B A, summed in float32. The merged run needs no "
        "base run and gives the adapted run's logits to float rounding.",
        epilog="example: gptlab merge runs/lora --out runs/merged")
    m.add_argument("run", type=RunPath(), help="a run trained with gptlab finetune --lora")
    m.add_argument("--out", required=True, type=OutputFolder(), help="new or empty folder for the merged run")
    m.set_defaults(func=cmd_merge)


def add_finetune_command(sub: Any) -> None:
    """The finetune command: a base run, a JSONL file, the data and LoRA options, and train's options."""
    p = sub.add_parser(
        "finetune", help="fine-tune a run on JSONL examples (fully, or with LoRA adapters)",
        description="Train BASE (a gptlab run, or a Hugging Face model imported with import-hf) on a JSONL "
        "file of examples ({\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"}, as `gptlab masks` "
        "shows them), by default only on the completions and assistant turns. A fixed share of the "
        "examples is held out: the validation loss and the share of trained validation tokens predicted "
        "exactly are reported every --eval-interval steps, best.safetensors keeps the best validation "
        "loss, and --patience stops early. Messages are rendered with BASE's chat template (a native "
        "model gets gptlab's, its markers added to the vocabulary). With --lora R the base stays frozen "
        "and checkpoints hold only the adapters and the base's path; sample, eval and serve load them on "
        "the base, and gptlab merge folds them in. Ctrl-C saves; the same command with --resume "
        "continues exactly.",
        epilog="example: gptlab finetune runs/base --data tasks.jsonl --out runs/tuned --lora 8. Bad data "
        "is reported as FILE:LINE: what is wrong.")
    p.add_argument("base", type=RunPath(), metavar="BASE", help="the run to start from (its best checkpoint)")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="the fine-tuning examples")
    p.add_argument("--out", required=True, type=OutputFolder(),
                   help="new or empty folder for the run (with --resume: the run)")
    add_run_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(p, SFTConfig, "data options", exclude=("data",))
    lora = p.add_argument_group("LoRA options")
    lora.add_argument("--lora", type=COUNT, metavar="R", help="train rank-R adapters on the frozen base "
                      "instead of every weight")
    lora.add_argument("--lora-alpha", type=Bounded(float, 0),
                      help="adapter scale numerator: updates are multiplied by "
                      "alpha / R (default 16)")
    lora.add_argument("--lora-dropout", type=Bounded(float, 0, 1),
                      help="dropout on the adapters' input (default 0)")
    lora.add_argument("--lora-targets", nargs="+", metavar="PATTERN", help="linear layers to adapt, by "
                      "name pattern (default: attn.c_attn attn.c_proj mlp.c_fc mlp.c_gate mlp.c_proj)")
    shown = {**{name: str(value) for name, value in DEFAULTS.items()},
             "lr": f"{DEFAULTS['lr']}, {LORA_LR} with --lora", "min_lr": "lr / 10"}
    add_config_arguments(p, TrainConfig, "training options", exclude=("track_heads",), defaults=shown)
    p.set_defaults(func=cmd_finetune)
