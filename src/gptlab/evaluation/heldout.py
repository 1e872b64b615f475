"""Held-out evaluation: mean next-token loss, perplexity and bits per character, of a model on tokens
(`evaluate_tokens`) or of a run on its own split or any text (`evaluate_run`). By default a run is scored on
EVAL_TOKENS tokens, in windows spread evenly over the text: `gptlab eval RUN` and the end of `gptlab
train` (gptlab.training.final) score the same ones and print the same line."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gptlab.checkpoint import Checkpoint, data_folder
from gptlab.common import autocast
from gptlab.data.corpora import load_text
from gptlab.data.tokens import TokenData
from gptlab.inference.loading import load
from gptlab.model import GPT


@dataclass(frozen=True)
class Evaluation:
    """Loss of a model on a token stream, in the units people compare."""

    loss: float  # mean cross-entropy, nats per token
    tokens: int  # tokens scored
    characters: int | None = None  # characters of the text those tokens encode, when known

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bits_per_char(self) -> float | None:
        """Total information in bits divided by characters: comparable across tokenizers."""
        if not self.characters:
            return None
        return self.loss * self.tokens / self.characters / math.log(2)


@torch.no_grad()
def evaluate_tokens(
    model: GPT,
    tokens: np.ndarray,
    batch_size: int = 16,
    max_tokens: int | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> Evaluation:
    """Score the tokens of `tokens` (after the first) in block_size windows: every window, or with
    `max_tokens` that many tokens' worth of windows spread evenly over the whole text (so a corpus of
    files read in name order is not judged by its first files); with `progress`, behind a bar."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be at least 1 (leave it out to score every token)")
    block = model.config.block_size
    device = next(model.parameters()).device
    stream = torch.from_numpy(np.asarray(tokens).astype(np.int64))
    every = (len(stream) - 1) // block  # the text's whole windows
    if every < 1:
        raise ValueError(
            f"the text has {len(stream)} tokens, fewer than one window of block_size + 1 = {block + 1}: "
            "evaluate on more text"
        )
    n_windows = every if max_tokens is None else min(every, max_tokens // block)
    if n_windows < 1:
        raise ValueError(f"max_tokens={max_tokens} is less than one window of block_size = {block} tokens: "
                         f"score at least {block}")
    picked = torch.arange(n_windows) * every // n_windows  # (N,): evenly spaced, all of them when N = every
    x = stream[: every * block].view(every, block)[picked]  # (N, T)
    y = stream[1 : every * block + 1].view(every, block)[picked]  # (N, T), next tokens
    was_training = model.training
    model.eval()
    total = 0.0
    batches = tqdm(range(0, n_windows, batch_size), disable=not progress, unit="batch", dynamic_ncols=True,
                   leave=False)
    for start in batches:
        xb, yb = x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        with autocast(device, dtype):
            _, loss = model(xb, yb)
        total += loss.item() * xb.numel()
    model.train(was_training)
    return Evaluation(loss=total / x.numel(), tokens=x.numel())


# What `gptlab eval` and the end of `gptlab train` score unless told otherwise: this many tokens of the text,
# in windows spread evenly over it, so that the two print the same figure in seconds on a CPU (a demo's val
# split holds about twice as many; `gptlab eval --all` scores every one).
EVAL_TOKENS = 2**18


def scored_tokens(available: int, window: int, max_tokens: int | None) -> int:
    """How many of `available` tokens `evaluate_tokens` scores: whole windows, `max_tokens` worth of them
    (every target when None)."""
    targets = available - 1 if max_tokens is None else min(available - 1, max_tokens)
    return max(targets, 0) // window * window


@dataclass(frozen=True)
class HeldOutText:
    """A text to score a run on: its name in a report, its tokens, and its characters when known."""

    name: str  # "the val split", or what the user gave
    tokens: np.ndarray
    characters: int | None


def held_out_text(run: str | Path, data: str, header: Checkpoint) -> HeldOutText:
    """The tokens of `data` for the run whose checkpoint `header` is: its train or val split, a prepared
    folder's val split, or any text encoded with the run's tokenizer."""
    if data in ("train", "val") or (Path(data) / "meta.json").is_file():
        own = data in ("train", "val")
        folder = data_folder(Path(header.source).parent, header.state) if own else Path(data)
        prepared = TokenData(folder)
        if prepared.tokenizer.to_dict() != header.tokenizer:
            raise ValueError(f"{folder} was prepared with another tokenizer than {run}'s: give its own "
                             "prepared folder, or a text file")
        split = data if own else "val"
        tokens = prepared.split(split)
        characters = len(tokens) if prepared.tokenizer.kind == "char" else None  # one token per character
        return HeldOutText(f"the {split} split", tokens, characters)
    text = load_text(data)
    return HeldOutText(data, header.load_tokenizer().encode_array(text), len(text))


def checkpoint_label(header: Checkpoint) -> str:
    """How a report names a checkpoint: "best checkpoint (step 1300)", from its file's name and step."""
    step = header.state.get("step")
    name = f"{Path(header.source).name.split('.')[0]} checkpoint"  # best.safetensors, best.shards.json
    return name if step is None else f"{name} (step {step})"


@dataclass(frozen=True)
class RunEvaluation:
    """One checkpoint scored on one text: what `gptlab eval` and the end of `gptlab train` print."""

    checkpoint: str  # checkpoint_label's name for it
    text: str  # HeldOutText.name
    available: int  # the text's tokens, of which `result.tokens` were scored
    window: int  # the tokens are scored in windows of the model's block_size
    result: Evaluation

    def line(self) -> str:
        """The one line that reports it, saying what was scored: the whole text or windows spread over it."""
        result = self.result
        bpc = f", {result.bits_per_char:.4f} bits per character" if result.bits_per_char else ""
        whole = result.tokens == scored_tokens(self.available, self.window, None)
        which = "the whole" if whole else "spread evenly over all"
        return (f"{self.checkpoint} on {self.text}: loss {result.loss:.4f} nats per token, perplexity "
                f"{result.perplexity:.3f}{bpc} ({result.tokens:,} tokens scored, {which} of "
                f"{self.available:,}, in windows of {self.window})")


def described(header: Checkpoint, text: HeldOutText, max_tokens: int | None, loss: float) -> RunEvaluation:
    """The report of `loss`, the checkpoint's loss on `max_tokens` tokens of `text` (all: None)."""
    window = header.model_config.block_size
    scored = scored_tokens(len(text.tokens), window, max_tokens)
    # Characters scale with the tokens actually scored.
    characters = round(text.characters * scored / max(1, len(text.tokens) - 1)) if text.characters else None
    return RunEvaluation(checkpoint_label(header), text.name, len(text.tokens), window,
                         Evaluation(loss, scored, characters))


def evaluate_run(run: str | Path, data: str = "val", max_tokens: int | None = EVAL_TOKENS,
                 dtype: str = "float32", quantize: str = "none", device: str = "cpu", progress: bool = False,
                 announce: Callable[[str], None] | None = None) -> RunEvaluation:
    """Score a run's best checkpoint on `max_tokens` tokens (all: None), spread over `data` (train, val, a
    prepared folder's val split, or any text) on `device`, its weights held as `dtype` and `quantize`
    say (gptlab.load); `progress` draws a bar of the batches, `announce` is given a line before them."""
    lm = load(run, device=device, dtype=dtype, quantize=quantize)
    header, model = lm.header, lm.model
    assert header is not None, "a loaded run has its header"
    text = held_out_text(run, data, header)
    window = model.config.block_size
    scored = scored_tokens(len(text.tokens), window, max_tokens)
    if announce is not None and scored > 0:  # else evaluate_tokens refuses the text or max_tokens
        announce(f"scoring {checkpoint_label(header)} on {text.name}: {scored:,} tokens in "
                 f"{scored // window:,} windows of {window}")
    result = evaluate_tokens(model, text.tokens, max_tokens=max_tokens, progress=progress)
    return described(header, text, max_tokens, result.loss)


def evaluation_line(run: str | Path, data: str = "val", max_tokens: int | None = EVAL_TOKENS,
                    dtype: str = "float32", quantize: str = "none", device: str = "cpu",
                    progress: bool = False, announce: Callable[[str], None] | None = None) -> str:
    """`evaluate_run`'s report in one line."""
    return evaluate_run(run, data, max_tokens, dtype, quantize, device, progress, announce).line()
