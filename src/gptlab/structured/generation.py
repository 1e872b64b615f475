"""Generation under a grammar (structured output): `gptlab sample --json-schema/--regex/--choice` and the
Python API, on the cached decoder of `generate` (`generate.Decoder`).

Each step the row's matcher says which tokens may come next (`grammar.Matcher.allowed`); every other
logit is set to -inf (`sampling.apply_mask`) and the SamplingConfig chooses among the rest as always
(logit_bias, temperature, top-k, top-p), then the matcher follows the token chosen. The row ends
- when the grammar ends it: the end token chosen once the output is complete ("eot"), or nothing may
  follow a complete output ("stop");
- after max_new_tokens ("length"): the output may be incomplete, and is never said to be valid;
- when nothing allowed is left to choose (logit_bias banned every token the grammar allows, or the
  vocabulary cannot spell what the grammar needs next): "length" too, for the same reason;
- when the grammar engine gives up (its error state, as for a grammar past its limits:
  `grammar.Matcher.gave_up`): a ValueError naming the grammar and the engine's reason, never an output
  that looks cut by max_new_tokens.
Stop strings are refused beside a grammar: a stop string could cut a valid output short while the
reason said "stop".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from gptlab.config import SamplingConfig, SettingError
from gptlab.generate import Chunk, Decoder, prompt_rows, text_chunks
from gptlab.model import GPT
from gptlab.sampling import apply_logit_bias, apply_mask, next_token, sampler
from gptlab.structured.grammar import Grammar, Matcher
from gptlab.text.tokenizer import Tokenizer


def choose(logits: torch.Tensor, matcher: Matcher, sampling: SamplingConfig,
           generator: torch.Generator | None = None) -> int | None:
    """The next token for one row's logits (1, V) under its matcher, or None when the row must end
    (nothing allowed, or every allowed token banned by logit_bias): `matcher.complete` says whether the
    output is complete. The token is not yet followed: call `matcher.advance`."""
    allowed = matcher.allowed()
    if allowed is None:
        return None
    masked = apply_mask(logits, allowed)  # (1, V)
    if bool(torch.isinf(apply_logit_bias(masked, sampling.logit_bias)).all()):
        return None
    return int(next_token(masked, sampling, generator))


def settled(matcher: Matcher) -> bool:
    """Whether a row cut at max tokens is complete anyway: the grammar accepts and allows nothing more."""
    return matcher.allowed() is None and matcher.complete


def structured_tokens(model: GPT, prompt_ids: list[int], sampling: SamplingConfig, matcher: Matcher, *,
                      generator: torch.Generator | None = None, use_cache: bool = True) -> Iterator[int]:
    """The tokens of one row continuing `prompt_ids` under `matcher`, until the grammar or max_new_tokens
    ends it (the module docstring)."""
    model.eval()
    decoder = Decoder(model, prompt_rows([prompt_ids], model.config.block_size), use_cache,
                      sampling.max_new_tokens)
    generator = generator or sampler(sampling, decoder.device)
    for count in range(sampling.max_new_tokens):
        token = choose(decoder.logits(), matcher, sampling, generator)
        if token is None or not matcher.advance(token):  # the grammar ends the row, or the engine gave up
            problem = matcher.gave_up(count)
            if problem is not None:
                raise ValueError(problem)
            return
        decoder.append(torch.tensor([[token]]))
        yield token
        if token in matcher.end_ids:
            return
    settled(matcher)  # cut at max_new_tokens: complete all the same if nothing more may follow


def stream_structured(model: GPT, tokenizer: Tokenizer, prompt: str, sampling: SamplingConfig,
                      grammar: Grammar, *, generator: torch.Generator | None = None,
                      use_cache: bool = True) -> Iterator[Chunk]:
    """Continue `prompt` within `grammar`, yielding chunks as `generate.stream_text` does; the last one's
    stop_reason is "eot" or "stop" only when the output is complete, else "length".

    The prompt and the settings are checked at once, before the first chunk is asked for."""
    if sampling.stop:
        raise SettingError(f"{{stop}}={list(sampling.stop)!r} cannot be combined with a grammar: the "
                           "grammar decides where the output ends", stop="SamplingConfig.stop")
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty prompt")
    matcher = grammar.matcher()
    tokens = structured_tokens(model, prompt_ids, sampling, matcher, generator=generator, use_cache=use_cache)
    return _final_reason(text_chunks(tokens, tokenizer, ()), matcher)


def _final_reason(chunks: Iterator[Chunk], matcher: Matcher) -> Iterator[Chunk]:
    """The chunks, the last one saying "stop" where the grammar completed the output without an end token."""
    for chunk in chunks:
        if chunk.token is None and chunk.stop_reason == "length" and matcher.complete:
            chunk = dataclasses.replace(chunk, stop_reason="stop")
        yield chunk
