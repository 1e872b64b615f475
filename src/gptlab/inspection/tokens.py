"""Prompts, single tokens and positions as the inspection commands take them, with one-line errors.

A command that names token positions of its prompt (intervene, lens, patch) needs the prompt to fit
the model's context window (`encode_prompt`: cropping would shift every position the user names); one
that names none (attention, ablate) reads the last block_size tokens of a longer one, as sampling does,
and says so (`prompt_window`). A replacement must be exactly one token, and a position may count from
the end as in Python (-1 is the last token).
"""

from __future__ import annotations

from collections.abc import Sequence

from gptlab.config import SettingError
from gptlab.text.tokenizer import Tokenizer

# Characters a label shows visibly: a space, line breaks and tabs would vanish on an axis.
VISIBLE = {" ": "\u2423", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def prompt_window(tokenizer: Tokenizer, prompt: str, block_size: int,
                  option: str = "prompt") -> tuple[list[int], int]:
    """The token ids of `prompt`'s last block_size tokens, and how many tokens before them were left out
    (0 when it fits); an empty prompt is refused, `option` naming the argument (a SettingError setting)."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise SettingError("{o} encodes to no tokens: give a non-empty prompt", o=option)
    return ids[-block_size:], max(0, len(ids) - block_size)


def encode_prompt(tokenizer: Tokenizer, prompt: str, block_size: int, option: str = "prompt") -> list[int]:
    """The token ids of `prompt`, refusing an empty prompt or one longer than the context window;
    `option` names the argument in errors (a SettingError setting)."""
    ids, left_out = prompt_window(tokenizer, prompt, block_size, option)
    if left_out:
        raise SettingError(f"{{o}} is {len(ids) + left_out} tokens but the model sees at most "
                           f"block_size={block_size}: shorten the prompt", o=option)
    return ids


def encode_token(tokenizer: Tokenizer, text: str, option: str) -> int:
    """The id of `text`, which must encode to exactly one token; `option` names the argument in errors."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise SettingError(f"{{o}} {text!r} is {len(ids)} tokens for the {tokenizer.kind} tokenizer; "
                           "give text that is exactly one token", o=option)
    return ids[0]


def token_label(tokenizer: Tokenizer, token: int) -> str:
    """A token's text with spaces, line breaks, tabs and other control characters made visible."""
    text = tokenizer.decode([token])
    shown = "".join(VISIBLE.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in text)
    return shown or "\u2205"  # the empty set sign for a token that decodes to nothing


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """`token_label` of every id."""
    return [token_label(tokenizer, token) for token in ids]


def resolve_position(position: int, length: int, option: str) -> int:
    """A position in 0..length-1 from one that may count from the end; a SettingError naming `option` if
    out of range."""
    if not -length <= position < length:
        raise SettingError(f"{{o}} position {position} is outside the prompt's {length} tokens: "
                           f"use 0..{length - 1}, or -{length}..-1 to count from the end", o=option)
    return position % length


def parse_replacement(spec: str) -> tuple[int, str]:
    """(position, text) of a `--replace POS=TOKEN` value; the text may itself contain '='."""
    position, sep, text = spec.partition("=")
    if not (sep and text and position.strip().removeprefix("-").isdigit()):
        raise SettingError(f"{{r}} {spec!r} must be POS=TOKEN, a token index and the new token, e.g. 3=e",
                           r="replace")
    return int(position), text
