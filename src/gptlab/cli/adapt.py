"""The masks command: see what fine-tuning data trains on, before training on it."""

from __future__ import annotations

import argparse
import sys
from itertools import groupby
from typing import Any

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
    from gptlab.adapt.sft import load_examples

    if args.n < 0:
        raise ValueError(f"--n {args.n} must be 0 or more")
    source = chat_source(args.base)
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


def add_adapt_commands(sub: Any) -> None:
    """The masks command (fine-tuning data and its loss masks)."""
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
    p.add_argument("base", metavar="RUN_OR_HF_FOLDER",
                   help="a gptlab run (its tokenizer, chat template and context) or a Hugging Face folder")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="the fine-tuning examples")
    p.add_argument("--n", type=int, default=3, help="how many examples to show (default 3)")
    p.add_argument("--loss-on", choices=("completion", "all"), default="completion",
                   help="completion: only completions and assistant turns are trained (default); all: "
                   "every token")
    p.add_argument("--too-long", choices=("skip", "truncate"), default="skip",
                   help="an example longer than the context is skipped (default) or cut to fit")
    p.set_defaults(func=cmd_masks)
