"""Choosing the next token from the model's logits (§7.1): greedy, or a sample restricted by top-k/top-p.

Temperature 0 is greedy; otherwise the draw is from softmax(logits / temperature), restricted to
the top-k tokens and then to the smallest set of tokens whose probability reaches top-p,
renormalised. The settings are one `SamplingConfig`, validated when it is built.

A model's vocabulary may be larger than its tokenizer's (an import padded to a round size, as
Qwen2.5 pads 151,665 ids to 151,936): `within_vocabulary` keeps the extra ids from ever being chosen.
"""

from __future__ import annotations

import torch

from gptlab.config import SamplingConfig


def token_probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution sampling draws from, (B, V): softmax(logits / temperature), then top-k, then top-p."""
    top_k, top_p = sampling.top_k, sampling.top_p
    logits = logits.float() / sampling.temperature  # (B, V)
    if top_k is not None and top_k < logits.size(-1):
        kept = torch.zeros_like(logits, dtype=torch.bool)
        kept.scatter_(-1, logits.topk(top_k, dim=-1).indices, True)  # exactly k tokens, even with ties
        logits = logits.masked_fill(~kept, float("-inf"))
    if top_p < 1:
        probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)  # (B, V), most likely first
        before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each one
        # A token is dropped when the more likely ones already reach top_p: what stays is the
        # smallest set whose probability reaches it (for the first token `before` is exactly 0).
        dropped = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, before >= top_p)
        logits = logits.masked_fill(dropped, float("-inf"))
    return logits.softmax(dim=-1)


def within_vocabulary(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Logits (B, V) with every id >= vocab_size at -inf, so no sample, argmax or top list holds one.

    Returns the logits themselves when nothing is padded (vocab_size None or >= V).
    """
    if vocab_size is None or vocab_size >= logits.size(-1):
        return logits
    masked = logits.clone()
    masked[..., vocab_size:] = float("-inf")
    return masked


def next_token(logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Choose one token per row from logits (B, V): the largest at temperature 0, else a sample, (B, 1)."""
    if sampling.greedy:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(token_probabilities(logits, sampling), num_samples=1, generator=generator)


def sampler(sampling: SamplingConfig, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `sampling.seed` on `device`, or None (the global one) when it has no seed."""
    return None if sampling.seed is None else torch.Generator(device).manual_seed(sampling.seed)
