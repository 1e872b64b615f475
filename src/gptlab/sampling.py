"""Choosing the next token from the model's logits (§7.1): greedy, or a sample restricted by top-k/top-p.

Temperature 0 is greedy; otherwise the draw is from softmax(logits / temperature), restricted to
the top-k tokens and then to the smallest set of tokens whose probability reaches top-p,
renormalised. The settings are one `SamplingConfig`, validated when it is built.

A model's vocabulary may be larger than its tokenizer's (an import padded to a round size, as
Qwen2.5 pads 151,665 ids to 151,936): `within_vocabulary` keeps the extra ids from ever being chosen.

`SamplingConfig.logit_bias` (OpenAI's map of token id -> bias in [-100, 100]) is added to the logits
before anything else, greedy or sampled (`apply_logit_bias`); -100 bans a token outright (-inf), as
OpenAI says it should, rather than leave it a small chance. `apply_mask` keeps only the tokens a grammar
allows (structured output, `gptlab.structured`); a banned or masked token stays impossible whatever bias
it is given.
"""

from __future__ import annotations

import torch

from gptlab.config import SamplingConfig


def token_probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution sampling draws from, (B, V): softmax((logits + logit_bias) / temperature), then
    top-k, then top-p."""
    top_k, top_p = sampling.top_k, sampling.top_p
    logits = apply_logit_bias(logits, sampling.logit_bias).float() / sampling.temperature  # (B, V)
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


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float] | None) -> torch.Tensor:
    """Logits (B, V) with `bias[id]` added to column id, and -inf where the bias is -100 (a ban).

    Returns the logits themselves without a bias; an id past V is a ValueError naming it.
    """
    if not bias:
        return logits
    beyond = max(bias)
    if beyond >= logits.size(-1):
        raise ValueError(f"logit_bias names token id {beyond}, outside the model's {logits.size(-1)} ids")
    ids = torch.tensor(list(bias), device=logits.device)  # (K,)
    values = torch.tensor(list(bias.values()), device=logits.device, dtype=torch.float32)  # (K,)
    biased = logits.float().clone()
    biased[..., ids] += values
    biased[..., ids[values <= -100]] = float("-inf")
    return biased


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int) -> None:
    """A ValueError naming the first token id of `bias` outside a tokenizer of `vocab_size` ids."""
    outside = sorted(t for t in bias or {} if t >= vocab_size)
    if outside:
        raise ValueError(f"logit_bias names token id {outside[0]}, outside the tokenizer's {vocab_size} ids "
                         f"(0 to {vocab_size - 1})")


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits (B, V) at -inf wherever `allowed` (V' <= V booleans, or (B, V')) is False or missing: ids
    past V' (a padded model vocabulary beyond the tokenizer's) are never allowed."""
    keep = torch.zeros(*allowed.shape[:-1], logits.size(-1), dtype=torch.bool, device=logits.device)
    keep[..., :allowed.size(-1)] = allowed.to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))


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
        return apply_logit_bias(logits, sampling.logit_bias).argmax(dim=-1, keepdim=True)
    return torch.multinomial(token_probabilities(logits, sampling), num_samples=1, generator=generator)


def sampler(sampling: SamplingConfig, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `sampling.seed` on `device`, or None (the global one) when it has no seed."""
    return None if sampling.seed is None else torch.Generator(device).manual_seed(sampling.seed)
