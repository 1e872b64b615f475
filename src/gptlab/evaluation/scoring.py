"""Log-likelihood of a continuation given a context, tokenised and windowed as lm-eval's `hf` backend does.

lm-eval (`HFLM._encode_pair` and `_loglikelihood_tokens`): trailing spaces of the context move to the
continuation; the whole text is encoded and split after the context's own token count; the model reads
`(context + continuation)[-(block_size + 1):][:-1]` and the last `len(continuation)` positions are scored.
Shapes: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from gptlab.config import SettingError
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Request:
    """One loglikelihood request, lm-eval's (context, continuation) pair."""

    context: str
    continuation: str


def encode_pair(tokenizer: Tokenizer, request: Request) -> tuple[list[int], list[int]]:
    """Context and continuation ids as lm-eval splits them; ValueError if the tokenizer cannot encode them."""
    context, continuation = request.context, request.continuation
    spaces = len(context) - len(context.rstrip())
    if spaces:  # "Answer: " + "x" is scored as "Answer:" + " x", the way the text is tokenised whole
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:  # lm-eval conditions on the end-of-text token alone
        if tokenizer.eot_id is None:
            raise ValueError("an empty context needs an end-of-text token, and this tokenizer has none")
        return [tokenizer.eot_id], tokenizer.encode_array(continuation).tolist()
    whole = tokenizer.encode_array(context + continuation).tolist()
    context_ids = tokenizer.encode_array(context).tolist()
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def score_pairs(model: GPT, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 16,
                progress: bool = False, label: str | None = None) -> list[tuple[float, bool]]:
    """(sum of log-probabilities, is greedy) of each encoded continuation after its context; with
    `progress`, behind a bar of the requests done, named `label`."""
    if batch_size < 1:
        raise SettingError(f"{{batch_size}}={batch_size} must be at least 1", batch_size="batch_size")
    block = model.config.block_size
    for _, continuation in pairs:
        if not continuation or len(continuation) > block:
            raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored in a window of "
                             f"{block}: it must hold 1 to block_size tokens")
    device = next(model.parameters()).device
    # longest first, as lm-eval orders them: a batch pads little, and memory peaks at once
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    with tqdm(total=len(pairs), disable=not progress, desc=label, unit="req", dynamic_ncols=True,
              leave=False) as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            inputs = [(pairs[i][0] + pairs[i][1])[-(block + 1):][:-1] for i in chunk]
            width = max(len(x) for x in inputs)
            x = torch.zeros(len(chunk), width, dtype=torch.long)  # (B, T), padded on the right: causal
            for row, ids in enumerate(inputs):
                x[row, :len(ids)] = torch.tensor(ids)
            logits, _ = model(x.to(device))  # (B, T, V)
            for row, i in enumerate(chunk):
                answer = torch.tensor(pairs[i][1], device=device)  # (C,) the continuation's ids
                end = len(inputs[row])
                # only the C positions that predict the continuation are normalised: (C, V)
                logprobs = torch.log_softmax(logits[row, end - len(answer):end].float(), dim=-1)
                total = logprobs.gather(1, answer[:, None]).sum().item()
                results[i] = (total, bool((logprobs.argmax(dim=-1) == answer).all()))
            bar.update(len(chunk))
    return results


def loglikelihoods(model: GPT, tokenizer: Tokenizer, requests: list[Request],
                   batch_size: int = 16, progress: bool = False) -> list[tuple[float, bool]]:
    """Sum of log-probabilities of each continuation given its context, and whether it is the greedy
    continuation, tokenised as lm-eval's HF backend does (a context longer than the window cut on the
    left)."""
    pairs = [encode_pair(tokenizer, request) for request in requests]
    return score_pairs(model, pairs, batch_size, progress)
