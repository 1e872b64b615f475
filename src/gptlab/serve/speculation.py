"""Speculative decoding in the server, row by row: prompt lookup drafts (`gptlab.speculative.ngram_draft`),
cut to what a constrained row's grammar allows, and the tokens a verifying pass keeps
(`gptlab.speculative.accept_draft`), chosen as plain decoding would choose them.

The scheduler (`batching`) runs each speculating row's newest token in the batched step as usual, then the
drafted tokens in a pass of the row's own, and hands the d + 1 rows of logits here.
- A free row's draft is verified as `generate` verifies it: greedy keeps the drafted tokens that equal
  the argmax (so greedy output is plain greedy's), sampling keeps the model's distribution.
- A constrained row's draft is followed by a copy of its matcher (`Matcher.copy`) and cut before the
  first token the grammar forbids, before an end id, and where the grammar would end; the copy gives the
  mask after the newest token and after each kept drafted one, and every row of logits is masked by its
  own before the acceptance rule, so each kept token is one the grammar allows there, drawn as `choose`
  draws it. The row's own matcher then follows the kept tokens.
- `logit_bias` applies to every row of logits alike (`accept_draft` applies it as `next_token` does); a
  position where the bias bans every token the grammar allows ends the row there, as `choose` does.

Shape legend: d drafted tokens, V the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptlab.config import SamplingConfig
from gptlab.sampling import apply_logit_bias, apply_mask
from gptlab.speculative import SpeculationConfig, accept_draft, leading_true, ngram_draft
from gptlab.structured.grammar import Matcher


def draft_for(ids: Sequence[int], room: int, speculation: SpeculationConfig,
              matcher: Matcher | None) -> tuple[list[int], list[torch.Tensor]]:
    """Up to `room` tokens to verify after a row's tokens `ids`, and for a constrained row the masks (V',)
    of what its grammar allows after the newest token and after each drafted one (d + 1; none when free)."""
    draft = ngram_draft(ids, min(room, speculation.draft_tokens), speculation.ngram)
    if not draft or matcher is None:
        return draft, []
    first = matcher.allowed()
    if first is None:  # the grammar ends the row here: nothing to verify
        return [], []
    twin, masks, kept = matcher.copy(), [first], []
    for token in draft:
        if token in twin.end_ids or not bool(masks[-1][token]) or not twin.advance(token):
            break
        allowed = twin.allowed()
        if allowed is None:  # the grammar would end after this token: verify up to it only
            break
        kept.append(token)
        masks.append(allowed)
    return kept, masks if kept else []


def verified(logits: torch.Tensor, draft: Sequence[int], masks: Sequence[torch.Tensor],
             matcher: Matcher | None, sampling: SamplingConfig,
             generator: torch.Generator | None) -> list[int] | None:
    """The tokens a verifying pass keeps, from logits (d + 1, V): the accepted start of `draft` and one of the
    model's own. A constrained row's matcher follows them; None when its grammar (or logit_bias within it)
    leaves nothing to choose at once, which ends the row as `choose` does."""
    if masks:
        logits = torch.cat([apply_mask(logits[i:i + 1], mask) for i, mask in enumerate(masks)])  # (d + 1, V)
        choosable = ~torch.isinf(apply_logit_bias(logits, sampling.logit_bias)).all(dim=-1)  # (d + 1,)
        usable = leading_true(choosable)
        if usable == 0:
            return None
        # a position with nothing to choose ends the row there: verify only the positions before it
        draft, logits = list(draft[:usable - 1]) if usable < len(masks) else draft, logits[:usable]
    tokens = accept_draft(logits, draft, sampling, generator)
    if matcher is not None:
        for i, token in enumerate(tokens):
            if not matcher.advance(token):  # never kept: the row ends before it (its matcher says so)
                return tokens[:i] or None
    return tokens
