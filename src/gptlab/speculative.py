"""Speculative decoding by prompt lookup: draft tokens from the sequence itself, keep what the model accepts.

Text often repeats itself (code, quotations, a summary of the prompt), so the tokens that followed an
earlier copy of the last few tokens are a good guess of what comes next, at no cost: no draft model.
The decoder (`gptlab.generate`) runs the newest token and the d drafted ones through its KV cache in
one forward pass, which gives the model's logits after each of them; this module decides which
tokens to keep, and the decoder forgets the cached keys of the rest (`KVCache.rewind`).

- Drafting (`ngram_draft`, prompt lookup decoding, Saxena 2023): find the most recent earlier
  occurrence of the sequence's last n tokens, falling back to n - 1, ..., 1, and propose the tokens
  that followed it. When that copy runs into the end of the sequence, the draft keeps copying its
  own tokens (a period shorter than the draft repeats).
- Verifying (`accept_draft`), the acceptance rule of speculative sampling (Leviathan et al. 2023,
  Chen et al. 2023) for a draft that is one fixed token per position (q a point mass): drafted token
  x is kept with probability p(x), p being the distribution plain sampling would draw from
  (`sampling.token_probabilities`: temperature, top-k, top-p, on the logits the caller has already
  restricted); the first rejected one is replaced by a draw from p with x removed and renormalised
  (max(0, p - q)); when all are kept, one more token is drawn from the last p. Every kept token is
  therefore distributed as the model's own, and each pass yields at least one token. Greedy decoding
  keeps the drafted tokens that equal the argmax and then the argmax itself: plain greedy's tokens.

The output has the model's distribution, but not plain sampling's random draws: a seeded speculative
sample differs from the unspeculated sample with the same seed (both are samples of the same model).
Greedy tokens equal plain greedy's up to float rounding (a pass over several positions can round the
last bits differently, which changes a token only when two candidates' logits tie to ~1e-6).

Each call is for one row, so a batched server can draft and verify row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptlab.config import Config, SamplingConfig, check_positive, option
from gptlab.sampling import next_token, token_probabilities


@dataclass
class SpeculationConfig(Config):
    """How many tokens prompt lookup drafts per step, and the longest n-gram it looks up."""

    # 4: on a 2-core CPU a pass over 5 tokens of a 135M model costs ~1.5 single steps, over 7 ~2 of them
    draft_tokens: int = option(4, "tokens drafted and verified per step (k)")
    ngram: int = option(3, "look up the last n tokens, falling back to fewer when they never occurred before")

    def validate(self) -> None:
        check_positive("SpeculationConfig", draft_tokens=self.draft_tokens, ngram=self.ngram)


@dataclass
class SpeculationStats:
    """Counters of one or more speculative runs: verifying passes, drafted tokens and accepted ones."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verifying pass that checked `drafted` tokens and kept `accepted` of them."""
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens kept (0 before any was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def ngram_draft(tokens: Sequence[int], max_tokens: int, ngram: int) -> list[int]:
    """Up to `max_tokens` tokens that followed the most recent earlier copy of the last n of `tokens`.

    n is `ngram`, or smaller when that n-gram never occurred before; no copy at all gives [].
    """
    length = len(tokens)
    if max_tokens < 1:
        return []
    for n in range(min(ngram, length - 1), 0, -1):
        tail = list(tokens[-n:])
        # a copy starting at i ends before the last token, so at least one token follows it
        for i in range(length - n - 1, -1, -1):
            if tokens[i + n - 1] == tail[-1] and list(tokens[i:i + n]) == tail:
                follow = i + n  # the copy's next token; when the draft reaches the end it copies itself
                draft: list[int] = []
                for j in range(max_tokens):
                    draft.append(tokens[follow + j] if follow + j < length else draft[follow + j - length])
                return draft
    return []


def accept_draft(logits: torch.Tensor, draft: Sequence[int], sampling: SamplingConfig,
                 generator: torch.Generator | None = None) -> list[int]:
    """The tokens a verifying pass keeps: the accepted start of `draft`, then one token of the model's.

    `logits` (d + 1, V), already restricted as plain sampling restricts them (`within_vocabulary`):
    row i predicts the token after the newest one and the first i drafted ones (module docstring).
    """
    d = len(draft)
    assert logits.size(0) == d + 1, f"{logits.size(0)} rows of logits for {d} drafted tokens; want d + 1"
    drafted = torch.tensor(list(draft), dtype=torch.long, device=logits.device)  # (d,)
    if sampling.greedy:
        chosen = next_token(logits, sampling)[:, 0]  # (d + 1,): plain greedy's token at every position
        kept = leading_true(chosen[:d] == drafted)
        return [*draft[:kept], int(chosen[kept])]
    probs = token_probabilities(logits, sampling)  # (d + 1, V): what plain sampling draws from
    p_drafted = probs[:d].gather(1, drafted[:, None])[:, 0]  # (d,): p(x) of each drafted x
    draws = torch.rand(d, generator=generator, device=logits.device)  # (d,)
    kept = leading_true(draws < p_drafted)  # x is kept with probability p(x)
    residual = probs[kept]  # (V,)
    if kept < d:  # x was rejected: draw from max(0, p - q), p without x (multinomial renormalises)
        residual = residual.clone()
        residual[draft[kept]] = 0.0
    token = torch.multinomial(residual, num_samples=1, generator=generator)  # (1,)
    return [*draft[:kept], int(token)]


def leading_true(flags: torch.Tensor) -> int:
    """How many of the first entries of a boolean vector (d,) are True before the first False."""
    return int(flags.long().cumprod(dim=0).sum())
