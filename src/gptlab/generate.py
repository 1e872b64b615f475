"""Generation (§7.1): predict from the last position, sample or pick the largest logit, append, repeat.

This is the handout's naive loop: every step recomputes the whole (cropped) prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptlab.model import GPT


def check_sampling(temperature: float, top_k: int | None, max_new_tokens: int) -> None:
    """Refuse sampling settings that have no meaning, naming the option and its valid range."""
    if temperature < 0:
        raise ValueError(f"--temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k={top_k} must be at least 1")
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens} must not be negative")


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """Choose one token per row from logits (B, V): greedy at temperature 0, else sample."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B, 1) one step at a time, continuing the prompts idx (B, T)."""
    check_sampling(temperature, top_k, max_new_tokens)
    model.eval()
    block = model.config.block_size
    for _ in range(max_new_tokens):
        context = idx[:, -block:]  # the window the model can see
        logits, _ = model(context)
        token = next_token(logits[:, -1, :], temperature, top_k, generator)
        idx = torch.cat([idx, token], dim=1)
        yield token
