"""The chat command: talk to a run through its chat template, interactively or one scripted turn at a time.

The conversation is the library's (`gptlab.inference.conversation`): each turn renders it with the
run's template and encodes it as the server's /v1/chat/completions does, so `gptlab chat`, `LM.chat`
and the server give the same answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from gptlab.cli.common import (
    RunPath,
    add_config_arguments,
    add_device_option,
    add_weight_options,
    config_overrides,
)
from gptlab.config import SAMPLE_DEFAULTS, SamplingConfig

if TYPE_CHECKING:  # torch is imported when a command runs, not when the parser is built
    from gptlab.inference.conversation import Conversation

COMMANDS = "/reset starts a new conversation, /exit (or Ctrl-D) ends"


def cmd_chat(args: argparse.Namespace) -> int:
    """Load the run and its template; answer each --message, or talk until /exit, Ctrl-D or Ctrl-C."""
    from gptlab.inference.conversation import Conversation
    from gptlab.inference.loading import load

    if args.json and not args.message:
        raise ValueError("--json prints one object per --message turn: give --message")
    overrides = config_overrides(args, SamplingConfig)
    SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **overrides})  # a bad option is refused before loading
    lm = load(args.run, device=args.device, dtype=args.dtype, quantize=args.quantize)
    conversation = Conversation(lm, lm.sampling(**overrides), args.system)
    if args.message:
        for turn, message in enumerate(args.message, 1):
            answer(conversation, message, turn if args.json else None)
        return 0
    return talk(conversation)


def answer(conversation: Conversation, message: str, json_turn: int | None) -> None:
    """Stream one reply to stdout, or print it as one JSON object (`json_turn`: its turn number)."""
    begin, reply, tokens = time.perf_counter(), "", []
    for chunk in conversation.reply(message):
        reply += chunk.text
        tokens += [] if chunk.token is None else [chunk.token]
        if json_turn is None:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if json_turn is None:
        print()
        return
    record = {"turn": json_turn, "message": message, "reply": reply, "tokens": tokens,
              "stop_reason": chunk.stop_reason,
              "tokens_per_s": round(len(tokens) / (time.perf_counter() - begin), 1)}
    print(json.dumps(record, ensure_ascii=False))


def talk(conversation: Conversation) -> int:
    """The interactive loop: a line in, the reply streamed out. Ctrl-C during a reply drops that turn;
    Ctrl-C or Ctrl-D at the prompt, or /exit, ends the chat."""
    print(f"chatting; {COMMANDS}", flush=True)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            conversation.reset()
            print("(a new conversation)", flush=True)
            continue
        if not command:
            continue
        sys.stdout.write("model> ")
        try:
            answer(conversation, line, None)
        except KeyboardInterrupt:
            print("\n(reply interrupted: the conversation is as before it)", flush=True)
        except ValueError as err:
            print(f"\n{err}", flush=True)


def add_chat_command(sub: Any) -> None:
    """The chat command."""
    chat = sub.add_parser(
        "chat", help="chat with a run through its chat template",
        description="Talk to a run: each turn renders the conversation with the run's chat template (an "
        "imported model's own, else gptlab's native one) and streams the reply, which ends at the end "
        f"of the turn. Interactive by default ({COMMANDS}); --message answers given turns and exits. "
        "Options not given take the run's own defaults (generation_config.json), then gptlab sample's.",
        epilog='example: gptlab chat runs/sft --message "What is 2 + 3?" --temperature 0',
    )
    chat.add_argument("run", type=RunPath(), help="a run folder or checkpoint file (fine-tuned for chat)")
    chat.add_argument("--message", action="append", metavar="TEXT", help="a user turn to answer, then exit; "
                      "repeat it for several turns of one conversation, answered in order")
    chat.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    chat.add_argument("--json", action="store_true", help="with --message: print one JSON object per turn "
                      "(turn, message, reply, tokens, stop_reason, tokens_per_s)")
    add_config_arguments(chat, SamplingConfig, "sampling options", defaults=SAMPLE_DEFAULTS)
    add_device_option(chat)
    add_weight_options(chat)
    chat.set_defaults(func=cmd_chat)
