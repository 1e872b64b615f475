"""Fine-tuning examples from JSONL, with loss masks that are right by construction.

One JSON object a line, one of three shapes for the whole file:
    {"text": ...}                                   plain text: every token trained
    {"prompt": ..., "completion": ...}              raw text: the completion (and end token) trained
    {"messages": [{"role": ..., "content": ...}]}   through the chat template: assistant turns trained
Plain text and completions end with the tokenizer's end-of-text token (when it has one), so the model
learns to stop; an assistant turn ends with whatever its template writes after it (the end-of-turn
marker and, in most templates, a line break), which is trained with it.

How masks are made (issue 25, point 2): never by looking for marker ids in the token list. Each trained
span is delimited by two prefixes of the rendered text (for a conversation: messages 1..i-1 with the
generation prompt, and messages 1..i); both are tokenised, and the tokens between their lengths are
trained. A prefix whose tokens are not a prefix of the whole example's tokens (a tokenizer merging across
the boundary) is an error, never a silently shifted mask. `mask_problems` checks a mask a second,
independent way: by the bytes each token spells, against the byte ranges of the trained text.

`Example.trained[i]` says whether token i is a target (predicted from tokens 0..i-1); token 0 never is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptlab.adapt.options import LOSS_ON, TOO_LONG
from gptlab.data.corpora import iconv_hint
from gptlab.text.chat_template import ROLES, ChatTemplate
from gptlab.text.tokenizer import Tokenizer

SHAPES = {"text": ("text",), "prompt-completion": ("prompt", "completion"), "messages": ("messages",)}


@dataclass
class Example:
    """One example's token ids, which of them are targets, its rendered text and the trained byte ranges."""

    ids: list[int]
    trained: list[bool]
    text: str
    spans: list[tuple[int, int]]  # byte ranges of `text` (UTF-8) whose tokens are trained
    line: int  # its line in the JSONL file


@dataclass
class FineTuneData:
    """The examples that fit the context, and what happened to the others."""

    examples: list[Example]
    shape: str
    lines: int  # examples read from the file
    context: int  # tokens an example may hold: block_size + 1
    skipped_too_long: int = 0
    longest: int = 0  # tokens of the longest example, when one was skipped as too long
    truncated: int = 0
    skipped_untrained: int = 0  # truncated so far that no trained token was left
    counts: dict[str, int] = field(default_factory=dict)  # "trained" and "untrained" tokens, kept examples

    def summary(self) -> str:
        """One line: examples kept, tokens trained and untrained, and any skipped or truncated."""
        parts = [f"{len(self.examples)} of {self.lines} examples ({self.shape})",
                 f"{self.counts['trained']:,} trained and {self.counts['untrained']:,} untrained tokens"]
        if self.skipped_too_long:
            parts.append(f"{self.skipped_too_long} skipped as longer than the context of {self.context} "
                         f"tokens (the longest has {self.longest}; --too-long truncate keeps them, cut to "
                         "fit)")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to the context of {self.context} tokens")
        if self.skipped_untrained:
            parts.append(f"{self.skipped_untrained} skipped with nothing left to train after truncation")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Reading and checking the file


def read_records(path: str | Path) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """The file's shape and its (line number, record) pairs; bad data is one ValueError naming file:line."""
    path = Path(path)
    shape, first, records = None, 0, []
    try:
        lines = path.open("rb")  # bytes, so that a line that is not UTF-8 is named by its number
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    with lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue  # blank lines, such as a trailing one, hold no example
            try:
                line = raw.decode("utf-8")
                record = json.loads(line)
                this = record_shape(record)
            except ValueError as err:
                reason = (f"not JSON ({err.msg})" if isinstance(err, json.JSONDecodeError)
                          else f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}): convert "
                          f"it to UTF-8, {iconv_hint(path)}"
                          if isinstance(err, UnicodeDecodeError) else str(err))
                raise ValueError(f"{path}:{number}: {reason}") from None
            if shape is None:
                shape, first = this, number
            elif this != shape:
                raise ValueError(f"{path}:{number}: a {this} example, but line {first} is {shape}: use one "
                                 "shape per file")
            records.append((number, record))
    if shape is None:
        raise ValueError(f"{path} holds no examples: write one JSON object a line")
    return shape, records


def record_shape(record: Any) -> str:
    """Which of the three shapes a parsed line is, or a ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object such as "
                         '{"prompt": "...", "completion": "..."}')
    keys = set(record)
    shape = next((s for s, need in SHAPES.items() if need[0] in keys), None)
    if shape is None:
        raise ValueError(f"keys {sorted(keys)} are none of the shapes {{text}}, {{prompt, completion}}, "
                         "{messages}")
    need = set(SHAPES[shape])
    if need - keys:
        raise ValueError(f"missing key {sorted(need - keys)[0]!r} of a {shape} example")
    if keys - need:
        raise ValueError(f"unexpected key {sorted(keys - need)[0]!r} in a {shape} example")
    if shape == "messages":
        check_messages(record["messages"])
        return shape
    for key in need:
        if not isinstance(record[key], str):
            raise ValueError(f"{key!r} must be a string, not {type(record[key]).__name__}")
    if shape == "prompt-completion" and not record["completion"]:
        raise ValueError("the completion is empty: there would be nothing to train")
    return shape


def check_messages(messages: Any) -> None:
    """A ValueError unless `messages` is: an optional system message, then user and assistant in turn,
    ending with a non-empty assistant message; each an object of a role and a string content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    start = 1 if isinstance(messages[0], dict) and messages[0].get("role") == "system" else 0
    for n, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(f"message {n} must be an object with exactly the keys role and content")
        if message["role"] not in ROLES or not isinstance(message["content"], str):
            raise ValueError(f"message {n} needs a role among {', '.join(ROLES)} and a string content")
        expected = ("user", "assistant")[(n - 1 - start) % 2] if n > start else "system"
        if message["role"] != expected:
            raise ValueError(f"message {n} is {message['role']} where {expected} must come (an optional "
                             "system message, then user and assistant in turn)")
        if expected == "assistant" and not message["content"]:
            raise ValueError(f"message {n} (assistant) is empty: there would be nothing to train")
    if messages[-1]["role"] != "assistant":
        raise ValueError("the last message must be the assistant's: it is what is trained")


# ---------------------------------------------------------------------------------------------
# Rendering: the whole text, and the pairs of prefixes that delimit each trained span


def end_text(tokenizer: Tokenizer) -> str:
    """The end-of-text token's text (it encodes back to the one id), or "" for a tokenizer without one."""
    return "" if tokenizer.eot_id is None else tokenizer.decode([tokenizer.eot_id])


def render_text(record: dict[str, Any], tokenizer: Tokenizer,
                template: ChatTemplate | None) -> tuple[str, list[tuple[str, str]]]:
    full = record["text"] + end_text(tokenizer)
    return full, [("", full)]


def render_prompt_completion(record: dict[str, Any], tokenizer: Tokenizer,
                             template: ChatTemplate | None) -> tuple[str, list[tuple[str, str]]]:
    full = record["prompt"] + record["completion"] + end_text(tokenizer)
    return full, [(record["prompt"], full)]


def render_messages(record: dict[str, Any], tokenizer: Tokenizer,
                    template: ChatTemplate | None) -> tuple[str, list[tuple[str, str]]]:
    if template is None:
        raise ValueError("messages examples need a chat template")
    messages = record["messages"]
    prefixes = [(template.render(messages[:i], add_generation_prompt=True), template.render(messages[:i + 1]))
                for i, m in enumerate(messages) if m["role"] == "assistant"]
    return template.render(messages), prefixes


RENDERERS: dict[str, Callable[..., tuple[str, list[tuple[str, str]]]]] = {
    "text": render_text, "prompt-completion": render_prompt_completion, "messages": render_messages}


def build_example(record: dict[str, Any], shape: str, tokenizer: Tokenizer, template: ChatTemplate | None,
                  loss_on: str = "completion", line: int = 0) -> Example:
    """Tokenise one record and mark its targets by tokenising the prefixes that bound each trained span."""
    text, bounds = RENDERERS[shape](record, tokenizer, template)
    if loss_on == "all":
        bounds = [("", text)]

    def encode(piece: str) -> list[int]:  # no BOS or other post-processing: the text holds every marker
        return tokenizer.encode_array(piece).tolist()

    ids = encode(text)
    trained = [False] * len(ids)
    spans = []
    for before, after in bounds:
        if not (text.startswith(after) and after.startswith(before)):
            raise ValueError("the chat template renders a conversation's beginning differently from the "
                             "whole conversation, so its turns cannot be found in the text")
        start, end = encode(before), encode(after)
        if end[:len(start)] != start or ids[:len(end)] != end:
            cut = len(after if ids[:len(end)] != end else before)
            raise ValueError(f"the tokens of the text up to {text[max(0, cut - 20):cut]!r} are not a prefix "
                             "of the whole example's tokens (the tokenizer merges across the edge of a "
                             "trained span): end the prompt with a space or line break, or start the "
                             "completion with one")
        trained[len(start):len(end)] = [True] * (len(end) - len(start))
        spans.append((len(before.encode("utf-8")), len(after.encode("utf-8"))))
    trained[:1] = [False] * len(trained[:1])  # the first token is never predicted
    return Example(ids, trained, text, spans, line)


def load_examples(path: str | Path, tokenizer: Tokenizer, template: ChatTemplate | None, block_size: int,
                  loss_on: str = "completion", too_long: str = "skip") -> FineTuneData:
    """Every example of a JSONL file, tokenised and masked; those longer than the context (block_size + 1
    tokens make block_size next-token pairs) skipped or truncated as `too_long` says."""
    if loss_on not in LOSS_ON or too_long not in TOO_LONG:
        raise ValueError(f"loss_on={loss_on!r}, too_long={too_long!r}: choose loss_on among "
                         f"{', '.join(LOSS_ON)} and too_long among {', '.join(TOO_LONG)}")
    shape, records = read_records(path)
    data = FineTuneData([], shape, len(records), block_size + 1)
    for line, record in records:
        try:
            example = build_example(record, shape, tokenizer, template, loss_on, line)
        except ValueError as err:
            raise ValueError(f"{path}:{line}: {err}") from None
        if len(example.ids) > block_size + 1:
            if too_long == "skip":
                data.skipped_too_long += 1
                data.longest = max(data.longest, len(example.ids))
                continue
            data.truncated += 1
            example.ids, example.trained = example.ids[:block_size + 1], example.trained[:block_size + 1]
            if not any(example.trained):
                data.skipped_untrained += 1
                continue
        data.examples.append(example)
    data.counts = {"trained": sum(sum(e.trained) for e in data.examples),
                   "untrained": sum(len(e.trained) - sum(e.trained) for e in data.examples)}
    return data


# ---------------------------------------------------------------------------------------------
# Checking a mask independently, and turning examples into the trainer's pairs


def mask_problems(example: Example, tokenizer: Tokenizer) -> list[str]:
    """What is wrong with an example's mask, checked by the bytes each token spells (not by tokenising
    prefixes, as it was made): a token is trained exactly when its bytes lie in a trained span."""
    text = example.text.encode("utf-8")
    pieces = [tokenizer.token_bytes(i) for i in example.ids]
    if not text.startswith(b"".join(pieces)):
        return [f"line {example.line}: the tokens do not spell the text, so the mask cannot be checked by "
                "bytes (a tokenizer that rewrites text, such as sentencepiece's added spaces)"]
    problems, offset = [], 0
    for i, (piece, trained) in enumerate(zip(pieces, example.trained, strict=True)):
        start, offset = offset, offset + len(piece)
        inside = any(a <= start and offset <= b for a, b in example.spans)
        straddles = any(start < a < offset or start < b < offset for a, b in example.spans)
        if straddles:
            problems.append(f"line {example.line}: token {i} ({piece!r}) straddles a trained span's edge")
        elif i > 0 and inside != trained:
            state = "trained" if trained else "not trained"
            problems.append(f"line {example.line}: token {i} ({piece!r}) is {state} but lies "
                            f"{'inside' if inside else 'outside'} the trained text")
    return problems


def next_token_pairs(example: Example) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (T,) and targets (T,) for next-token training, T = len(ids) - 1; -1 marks an untrained
    target, which `model.next_token_loss` skips."""
    ids = torch.tensor(example.ids, dtype=torch.long)  # (T + 1,)
    targets = ids[1:].masked_fill(~torch.tensor(example.trained[1:], dtype=torch.bool), -1)  # (T,)
    return ids[:-1], targets


def collate(examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of examples as inputs (B, T) and targets (B, T), padded on the right to the longest:
    padded inputs are 0 and padded targets -1 (causal attention keeps padding out of earlier positions)."""
    pairs = [next_token_pairs(e) for e in examples]
    T = max(len(inputs) for inputs, _ in pairs)
    inputs = torch.zeros(len(pairs), T, dtype=torch.long)  # (B, T)
    targets = torch.full((len(pairs), T), -1, dtype=torch.long)  # (B, T)
    for row, (x, y) in enumerate(pairs):
        inputs[row, :len(x)], targets[row, :len(y)] = x, y
    return inputs, targets
