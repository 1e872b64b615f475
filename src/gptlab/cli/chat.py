"""The chat command: talk to a run through its chat template, interactively or one scripted turn at a time.

Each turn renders the whole conversation with the run's template (`adapt.chat.template_from_state`),
the assistant's turn opened, and encodes it as the server's /v1/chat/completions does (no BOS added:
the template writes its markers); the reply ends at the end of the turn (the native template's
`<|end|>`, or one of the tokenizer's stop ids), so `gptlab chat` and the server give the same answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gptlab.cli.common import add_config_arguments, add_device_option, add_weight_options, config_overrides
from gptlab.cli.sample import SAMPLE_DEFAULTS
from gptlab.config import SamplingConfig

if TYPE_CHECKING:  # torch is imported when a command runs, not when the parser is built
    from gptlab.generate import Chunk
    from gptlab.model import GPT
    from gptlab.text.chat_template import ChatTemplate
    from gptlab.text.tokenizer import Tokenizer

COMMANDS = "/reset starts a new conversation, /exit (or Ctrl-D) ends"


class Conversation:
    """A conversation with a model: the messages so far, and each reply streamed as `generate` chunks."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, template: ChatTemplate, sampling: SamplingConfig,
                 system: str | None = None) -> None:
        from gptlab.sampling import sampler
        from gptlab.text.chat_template import missing_tokens

        missing = missing_tokens(tokenizer, template)
        if missing:
            raise ValueError(f"this run's tokenizer has no single ids for {', '.join(missing)}, the markers "
                             "of its chat template: it was not fine-tuned for chat (gptlab finetune with "
                             '{"messages"} examples adds them); gptlab sample continues plain text')
        self.model, self.tokenizer, self.template, self.system = model, tokenizer, template, system
        ends = template.end_of_turn  # a stop string, as the server adds it
        self.sampling = sampling.replace(stop=(*sampling.stop, *ends))
        # One random stream for the whole conversation, as `gptlab sample` has one for all its samples.
        self.generator = sampler(sampling, next(model.parameters()).device)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def reply(self, message: str) -> Iterator[Chunk]:
        """Stream the reply to a user message; the conversation keeps both once the reply has ended
        (a reply cut short, by Ctrl-C or an error, leaves the conversation as it was)."""
        from gptlab.generate import generate, text_chunks

        asked = [*self.messages, {"role": "user", "content": message}]
        text = self.template.render(asked, add_generation_prompt=True)
        ids = self.tokenizer.encode_array(text).tolist()
        window = self.model.config.block_size
        if len(ids) > window:
            raise ValueError(f"the conversation is {len(ids)} tokens, more than the model's context of "
                             f"{window}: /reset to start a new one, or send a shorter message")
        tokens = generate(self.model, [ids], self.sampling, generator=self.generator,
                          eot_id=self.tokenizer.stop_ids, vocab_size=self.tokenizer.vocab_size)
        said = ""
        for chunk in text_chunks(tokens, self.tokenizer, self.sampling.stop):
            said += chunk.text
            yield chunk
        self.messages = [*asked, {"role": "assistant", "content": said}]


def cmd_chat(args: argparse.Namespace) -> int:
    """Load the run and its template; answer each --message, or talk until /exit, Ctrl-D or Ctrl-C."""
    from gptlab.checkpoint import generation_defaults, load_for_inference, load_header
    from gptlab.common import resolve_device
    from gptlab.text.chat_template import template_from_state

    if args.json and not args.message:
        raise ValueError("--json prints one object per --message turn: give --message")
    sampling = SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **generation_defaults(args.run),
                                         **config_overrides(args, SamplingConfig)})
    template = template_from_state(load_header(args.run).state)
    model, tokenizer = load_for_inference(args.run, resolve_device(args.device), args.dtype, args.quantize)
    conversation = Conversation(model, tokenizer, template, sampling, args.system)
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
    chat.add_argument("run", help="a run folder or checkpoint file (fine-tuned for chat)")
    chat.add_argument("--message", action="append", metavar="TEXT", help="a user turn to answer, then exit; "
                      "repeat it for several turns of one conversation, answered in order")
    chat.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    chat.add_argument("--json", action="store_true", help="with --message: print one JSON object per turn "
                      "(turn, message, reply, tokens, stop_reason, tokens_per_s)")
    add_config_arguments(chat, SamplingConfig, "sampling options", defaults=SAMPLE_DEFAULTS)
    add_device_option(chat)
    add_weight_options(chat)
    chat.set_defaults(func=cmd_chat)
