"""Built-in sequence-to-sequence tasks, generated on the fly: reverse, sort, add.

Each needs cross-attention: the answer's i-th symbol depends on a source position that moves with
the input (reverse reads position n-1-i, sort counts symbols everywhere, add carries across digits).
Examples are drawn fresh for every batch from a seeded generator, so training never runs out of data.

Held-out examples: a source whose CRC-32 is a multiple of HELD_OUT_EVERY is never trained on. Training
batches skip those sources and evaluation draws only them, so exact match measures generalisation to
unseen sources of the trained lengths, not memorisation (about 1 in 20 of every length's sources).

Every example is encoded as the encoder-decoder expects (`make_batch`):
- source: its symbols, then <eos>; padded with <pad> at the end;
- decoder input: <bos>, then the answer's symbols; padded with <pad>;
- targets: the answer's symbols, then <eos>; padded with -1, which the loss ignores.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gptlab.config import Seq2SeqConfig, TaskConfig, TrainConfig
from gptlab.seq2seq.model import EncoderDecoder, decode_answers
from gptlab.seq2seq.presets import SEQ2SEQ_PRESETS
from gptlab.text.tokenizer import SymbolTokenizer

SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD, BOS, EOS = range(3)
DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
HELD_OUT_EVERY = 20
MAX_ROUNDS = 1000  # draws of a batch before concluding that a task has no sources of one part


def vocabulary() -> SymbolTokenizer:
    """One vocabulary for every task: the special tokens, digits, '+' and lower-case letters."""
    return SymbolTokenizer(SPECIALS, DIGITS + "+" + LETTERS)


def _strings(generator: torch.Generator, n: int, lengths: tuple[int, int], alphabet: str,
             leading_zero: bool = True) -> list[str]:
    """n random strings over `alphabet`, each of a length drawn uniformly from [lo, hi].

    Without `leading_zero` the first symbol is never alphabet[0], as numbers are written (so the
    number 0 itself is never drawn; a user may still ask for it).
    """
    lo, hi = lengths
    sizes = torch.randint(lo, hi + 1, (n,), generator=generator).tolist()
    picks = torch.randint(len(alphabet), (n, hi), generator=generator)  # (n, hi) symbol indices
    if not leading_zero:
        picks[:, 0] = torch.randint(1, len(alphabet), (n,), generator=generator)
    return ["".join(alphabet[i] for i in row[:size]) for row, size in zip(picks.tolist(), sizes, strict=True)]


@dataclass(frozen=True)
class Task:
    """How to draw sources, what the answer to a source is, and which inputs are well formed."""

    name: str
    description: str
    alphabet: str  # every character a source may hold
    draw: Callable[[torch.Generator, int, tuple[int, int]], list[str]]
    answer: Callable[[str], str]
    pattern: str  # a well-formed source, as a regular expression
    longest: Callable[[int], tuple[int, int]]  # max_len -> longest (source, answer) in characters


def _add_sources(generator: torch.Generator, n: int, lengths: tuple[int, int]) -> list[str]:
    left, right = (_strings(generator, n, lengths, DIGITS, leading_zero=False) for _ in range(2))
    return [f"{a}+{b}" for a, b in zip(left, right, strict=True)]


TASKS: dict[str, Task] = {
    "reverse": Task("reverse", "reverse a string of lower-case letters: 'gptlab' -> 'baltpg'",
                    LETTERS, lambda g, n, lengths: _strings(g, n, lengths, LETTERS),
                    lambda s: s[::-1], "[a-z]+", lambda m: (m, m)),
    "sort": Task("sort", "sort a string of digits: '31415' -> '11345'",
                 DIGITS, lambda g, n, lengths: _strings(g, n, lengths, DIGITS),
                 lambda s: "".join(sorted(s)), "[0-9]+", lambda m: (m, m)),
    "add": Task("add", "add two numbers written in digits: '57+68' -> '125'",
                DIGITS + "+", _add_sources, lambda s: str(sum(int(x) for x in s.split("+"))),
                "(0|[1-9][0-9]*)\\+(0|[1-9][0-9]*)", lambda m: (2 * m + 1, m + 1)),
}


def get_task(name: str) -> Task:
    """The task called `name`, or a ValueError listing them."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    return TASKS[name]


def required_block_size(config: TaskConfig) -> int:
    """The window that fits the longest source and answer, each with its <eos> (or <bos>) added."""
    return max(get_task(config.task).longest(config.max_len)) + 1


def is_held_out(source: str) -> bool:
    """True for the ~1 in HELD_OUT_EVERY sources kept for evaluation only."""
    return zlib.crc32(source.encode()) % HELD_OUT_EVERY == 0


def draw_sources(config: TaskConfig, generator: torch.Generator, n: int, held_out: bool) -> list[str]:
    """n sources from the training part (held_out=False) or the held-out part of the task."""
    task, kept = get_task(config.task), []
    for _ in range(MAX_ROUNDS):  # a handful of rounds suffice unless the task has almost no sources
        drawn = task.draw(generator, max(n, 64) if held_out else n, (config.min_len, config.max_len))
        kept += [s for s in drawn if is_held_out(s) == held_out]
        if len(kept) >= n:
            return kept[:n]
    part = "held-out" if held_out else "training"
    raise ValueError(f"{task.name} with lengths {config.min_len}-{config.max_len} has (almost) no {part} "
                     "sources: raise max_len")


def check_source(config: TaskConfig, source: str, block_size: int) -> None:
    """A ValueError saying what is wrong with a user's input for this task, if anything is."""
    task = get_task(config.task)
    if not re.fullmatch(task.pattern, source):
        raise ValueError(f"{source!r} is not a valid {task.name} input: {task.description} "
                         f"(characters {task.alphabet!r})")
    longest = max(len(source), len(task.answer(source))) + 1
    if longest > block_size:
        raise ValueError(f"{source!r} is too long for this model's window of {block_size} tokens: "
                         f"it was trained on up to {config.max_len} characters")


def resolve_seq2seq_configs(task: str, task_overrides: dict[str, Any] | None = None,
                            model_overrides: dict[str, Any] | None = None,
                            train_overrides: dict[str, Any] | None = None,
                            ) -> tuple[TaskConfig, Seq2SeqConfig, TrainConfig]:
    """The task's preset under explicit overrides; block_size fits the task unless it is given."""
    if task not in SEQ2SEQ_PRESETS:
        raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(SEQ2SEQ_PRESETS)}")
    preset = SEQ2SEQ_PRESETS[task]
    task_config = TaskConfig.from_dict({**preset["task"], **(task_overrides or {}), "task": task})
    model = {"block_size": required_block_size(task_config), **preset["model"], **(model_overrides or {})}
    return (task_config, Seq2SeqConfig.from_dict(model),
            TrainConfig.from_dict({**preset["train"], **(train_overrides or {})}))


def pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Rows of ids of different lengths as one (B, longest) tensor, filled at the end with `value`."""
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def encode_sources(vocab: SymbolTokenizer, sources: Sequence[str]) -> torch.Tensor:
    """Source ids with <eos> appended, padded: (B, S)."""
    return pad([vocab.encode(s) + [EOS] for s in sources], PAD)


def make_batch(vocab: SymbolTokenizer, task: Task,
               sources: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sources (B, S), decoder inputs (B, T) and targets (B, T) for teacher forcing."""
    answers = [vocab.encode(task.answer(s)) for s in sources]
    return (encode_sources(vocab, sources), pad([[BOS] + a for a in answers], PAD),
            pad([a + [EOS] for a in answers], -1))


@torch.no_grad()
def exact_match(model: EncoderDecoder, config: TaskConfig, n: int, seed: int,
                device: torch.device, chunk: int = 500) -> float:
    """The fraction of n held-out sources (the same n for a given seed) whose greedy answer is right."""
    vocab, task = vocabulary(), get_task(config.task)
    sources = draw_sources(config, torch.Generator().manual_seed(seed), n, held_out=True)
    right = 0
    for start in range(0, n, chunk):
        part = sources[start : start + chunk]
        answers = decode_answers(model, encode_sources(vocab, part).to(device), BOS, EOS)
        right += sum(vocab.decode(a) == task.answer(s) for a, s in zip(answers, part, strict=True))
    return right / n


class TaskData:
    """A task as the training loop's data source: batches of fresh examples, exact match as a metric."""

    metric_names = ("val_exact_match",)
    selects_best = True  # held-out examples drawn afresh: enough to choose a best checkpoint

    def __init__(self, config: TaskConfig) -> None:
        self.config, self.task, self.tokenizer = config, get_task(config.task), vocabulary()

    def check_window(self, block_size: int) -> None:
        """Raise a ValueError unless the longest source and answer fit the model's window."""
        needed = required_block_size(self.config)
        if block_size < needed:
            raise ValueError(f"block_size={block_size} is too small for {self.task.name} with max_len="
                             f"{self.config.max_len}: it needs at least {needed}")

    def get_batch(self, split: str, batch_size: int, block_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sources (B, S), decoder inputs and targets (B, T): training or held-out ("val") examples."""
        sources = draw_sources(self.config, generator, batch_size, held_out=split == "val")
        return make_batch(self.tokenizer, self.task, sources)

    def state(self) -> dict[str, object]:
        """What a checkpoint keeps to rebuild this data source."""
        return {"task": self.config.to_dict()}

    def metrics(self, model: nn.Module, losses: dict[str, float], seed: int,
                device: torch.device) -> dict[str, float]:
        """Exact match on the same held-out sources at every evaluation."""
        assert isinstance(model, EncoderDecoder), "a task trains an encoder-decoder"
        return {"val_exact_match": exact_match(model, self.config, self.config.eval_examples, seed, device)}
