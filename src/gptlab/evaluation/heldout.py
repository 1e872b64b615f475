"""Held-out evaluation: mean next-token loss, perplexity and bits per character, of a model on tokens
(`evaluate_tokens`) or of a run on its own split or any text (`evaluation_line`, what `gptlab eval` and the
end of `gptlab train` print)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gptlab.checkpoint import data_folder, load_for_inference, load_header
from gptlab.common import autocast, resolve_device
from gptlab.data.corpora import load_text
from gptlab.data.tokens import TokenData
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
    """Score every token of `tokens` (after the first) once, in consecutive block_size windows; with
    `progress`, behind a bar of the batches done."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be at least 1 (leave it out to score every token)")
    block = model.config.block_size
    device = next(model.parameters()).device
    stream = torch.from_numpy(np.asarray(tokens[: max_tokens + 1] if max_tokens else tokens).astype(np.int64))
    n_windows = (len(stream) - 1) // block
    if n_windows < 1:
        raise ValueError(
            f"the text has {len(stream)} tokens, fewer than one window of block_size + 1 = {block + 1}: "
            "evaluate on more text"
        )
    x = stream[: n_windows * block].view(n_windows, block)  # (N, T)
    y = stream[1 : n_windows * block + 1].view(n_windows, block)  # (N, T), next tokens
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


def evaluation_line(run: str | Path, data: str, max_tokens: int | None, dtype: str = "float32",
                    quantize: str = "none", device: str = "cpu", progress: bool = False,
                    announce: Callable[[str], None] | None = None) -> str:
    """Evaluate a run's best checkpoint on `data` (train, val, a prepared folder's val split, or any
    text) on `device`, its weights held as `dtype` and `quantize` say (gptlab.quantize), and describe
    the result in one line; `progress` draws a bar of the batches, `announce` is given a line before them."""
    model, tokenizer = load_for_inference(run, resolve_device(device), dtype, quantize)
    checkpoint = load_header(run)
    if data in ("train", "val") or (Path(data) / "meta.json").is_file():
        own = data in ("train", "val")
        folder = data_folder(Path(checkpoint.source).parent, checkpoint.state) if own else Path(data)
        prepared = TokenData(folder)
        if prepared.tokenizer.to_dict() != checkpoint.tokenizer:
            raise ValueError(f"{folder} was prepared with another tokenizer than {run}'s: give its own "
                             "prepared folder, or a text file")
        split = data if own else "val"
        tokens = prepared.split(split)
        characters = len(tokens) if tokenizer.kind == "char" else None
        name = f"{split} split"
    else:
        text = load_text(data)
        tokens = tokenizer.encode_array(text)
        characters = len(text)
        name = data
    block = model.config.block_size
    windows = (len(tokens) - 1 if max_tokens is None else min(len(tokens) - 1, max_tokens)) // block
    if announce is not None and windows > 0:  # else evaluate_tokens refuses the text or max_tokens
        announce(f"scoring {name}: {windows * block:,} tokens in {windows:,} windows of {block}")
    result = evaluate_tokens(model, tokens, max_tokens=max_tokens, progress=progress)
    if characters:  # scale to the characters actually scored
        scored = round(characters * result.tokens / max(1, len(tokens) - 1))
        result = dataclasses.replace(result, characters=scored)
    bpc = f", {result.bits_per_char:.4f} bits per character" if result.bits_per_char else ""
    return (f"{name}: loss {result.loss:.4f} nats per token, perplexity {result.perplexity:.3f}{bpc} "
            f"({result.tokens:,} tokens scored)")
