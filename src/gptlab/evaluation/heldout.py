"""Held-out evaluation: mean next-token loss, perplexity and bits per character."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gptlab.common import autocast
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
) -> Evaluation:
    """Score every token of `tokens` (after the first) once, in consecutive block_size windows."""
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
    for start in range(0, n_windows, batch_size):
        xb, yb = x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        with autocast(device, dtype):
            _, loss = model(xb, yb)
        total += loss.item() * xb.numel()
    model.train(was_training)
    return Evaluation(loss=total / x.numel(), tokens=x.numel())
