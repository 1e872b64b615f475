"""The handout's properties, measured on a trained model (a checkpoint or an imported GPT-2).

`gptlab lab` checks the handout on small models it builds itself; this module runs the same
statements on the user's model, on random token ids from a fixed seed, and reports the measured
deviation of each next to its tolerance:
- §3.2: every row of every head's attention weights sums to one;
- §7.1, §7.3: position i's logits do not change at all (exactly zero difference) when every input
  after i changes;
- §7.1: generation with the KV cache gives the logits of the handout's loop, which runs the whole
  sequence again at every step (up to the end of the context window);
- §4.2: the fused projection W_QKV equals three separate projections, and separate heads (written-out
  attention, concatenated, W_O) equal the module's fast kernel, on each layer's real input;
- §6: a tied vocabulary head is one tensor with the token embedding;
- §6.1: without positions, the stack with its mask switched off (on a copy) is permutation equivariant.
Tolerances are relative to the compared values' size: 100 float epsilons of the model's dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlab.generate import Decoder
from gptlab.inspection.hooks import record
from gptlab.model import GPT, attention, causal_mask

EPSILONS = 100  # tolerances are this many machine epsilons of the model's dtype, times the values' size
GENERATION_STEPS = 8


@dataclass(frozen=True)
class Property:
    """One property measured on the model; `passed` is None where it does not apply to this model."""

    section: str
    name: str
    deviation: float | None  # the measured max |difference|
    tolerance: float | None
    passed: bool | None
    note: str = ""


def _device(model: GPT) -> torch.device:
    return next(model.parameters()).device


def gap_of(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """max |got - want|, and the size of want (max |want|, at least 1) that tolerances scale with."""
    return float((got - want).abs().max()), max(1.0, float(want.abs().max()))


def measured(section: str, name: str, gaps: Iterable[tuple[float, float]], eps: float,
              note: str = "") -> Property:
    """A property that holds when each difference is within EPSILONS * eps times its values' size."""
    gaps = list(gaps)
    deviation = max(gap for gap, _ in gaps)
    tolerance = EPSILONS * eps * max(size for _, size in gaps)
    return Property(section, name, deviation, tolerance, deviation <= tolerance, note)


def check_rows(model: GPT, idx: torch.Tensor, eps: float) -> Property:
    """§3.2: the weights of every head, layer and query sum to one over the keys."""
    names = [f"h.{n}.attn.weights" for n in range(model.config.n_layer)]
    with record(model, names) as weights:
        model(idx)
    gaps = ((float((weights[name].sum(-1) - 1).abs().max()), 1.0) for name in names)
    return measured("§3.2", "attention rows sum to one", gaps, eps,
                     f"{len(names)} layers x {model.config.n_head} heads x {idx.size(1)} queries")


def check_causality(model: GPT, idx: torch.Tensor, generator: torch.Generator) -> Property:
    """§7.1/§7.3: changing every token after position i leaves the logits up to i exactly unchanged."""
    clean = model(idx)[0]  # (1, T, V)
    V, T = model.config.vocab_size, idx.size(1)
    worst = 0.0
    for cut in range(T - 1):
        changed = idx.clone()
        shift = torch.randint(1, max(2, V), (T - cut - 1,), generator=generator).to(idx.device)
        changed[0, cut + 1:] = (idx[0, cut + 1:] + shift) % V  # a different token at every later position
        worst = max(worst, float((model(changed)[0][:, : cut + 1] - clean[:, : cut + 1]).abs().max()))
    return Property("§7.3", "logits at i ignore every input after i", worst, 0.0, worst == 0.0,
                    f"{T - 1} cuts, exact comparison")


def check_generation(model: GPT, generator: torch.Generator, eps: float) -> Property:
    """§7.1: greedy generation with the KV cache gives the logits of a full forward pass at every step."""
    name = "cached generation = uncached"
    if not model.config.causal:
        return Property("§7.1", name, None, None, False, "the model is not causal, so it cannot generate")
    length = max(1, min(model.config.block_size, 64) - GENERATION_STEPS)  # every step stays in the window
    row = torch.randint(model.config.vocab_size, (1, length), generator=generator)  # (1, T)
    row = row.to(_device(model))
    cached = Decoder(model, row.tolist(), use_cache=True)
    gaps = []
    for _ in range(GENERATION_STEPS):
        reference = model(row)[0][:, -1]  # the handout's loop: the whole sequence again, (1, V)
        gaps.append(gap_of(cached.logits(), reference))
        token = reference.argmax(-1, keepdim=True)  # (1, 1)
        cached.append(token)
        row = torch.cat([row, token], dim=1)
    return measured("§7.1", name, gaps, eps, f"{length}-token prompt, {GENERATION_STEPS} greedy steps")


def _projection_gaps(model: GPT, idx: torch.Tensor) -> Iterator[tuple[float, float]]:
    """Per layer: fused q, k, v against separate projections; the module against separate heads."""
    names = [f"h.{n}.attn.in" for n in range(model.config.n_layer)]
    with record(model, names) as inputs:
        model(idx)
    H = model.config.n_head
    for block, name in zip(model.transformer.h, names, strict=True):
        attn, x = block.attn, inputs[name]
        B, T, D = x.shape
        biases = attn.c_attn.bias.split(D) if attn.c_attn.bias is not None else (None,) * 3
        separate = []
        for i, (weight, bias, fused) in enumerate(zip(attn.c_attn.weight.split(D), biases, attn.project(x),
                                                      strict=True)):
            own = F.linear(x, weight, bias).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, hs)
            own = attn.rotate(own) if i < 2 else own  # RoPE turns queries and keys, not values
            separate.append(own)
            yield gap_of(fused, own)
        mask = causal_mask(T, T, x.device) if attn.causal else None
        heads = [attention(*(t[:, h] for t in separate), mask)[0] for h in range(H)]  # H x (B, T, hs)
        yield gap_of(attn(x), attn.c_proj(torch.cat(heads, dim=-1)))


def check_tied(tied: bool, head: torch.Tensor, embedding: torch.Tensor) -> Property:
    """§6: a tied vocabulary head is the token embedding tensor itself, not a copy."""
    name = "tied head is the embedding tensor"
    if not tied:
        return Property("§6", name, None, None, None, "untied model: its head is a matrix of its own")
    same = head is embedding and head.data_ptr() == embedding.data_ptr()
    return Property("§6", name, gap_of(head, embedding)[0], 0.0, same, f"same object and storage: {same}")


def check_permutation(model: GPT, idx: torch.Tensor, generator: torch.Generator, eps: float) -> Property:
    """§6.1: without positions or mask, permuting the inputs permutes the logits and nothing else."""
    name = "no positions, no mask: permutation equivariant"
    if model.config.positions != "none":
        return Property("§6.1", name, None, None, None,
                        f"the model has {model.config.positions} positions, which break it by design")
    unmasked = copy.deepcopy(model)
    for block in unmasked.transformer.h:
        block.attn.causal = False  # the mask depends on order, so the property is about the stack without it
    perm = torch.randperm(idx.size(1), generator=generator).to(idx.device)
    gap = gap_of(unmasked(idx[:, perm])[0], unmasked(idx)[0][:, perm])
    return measured("§6.1", name, [gap], eps, "checked on a copy with causal=False")


@torch.no_grad()
def verify_model(model: GPT, seed: int = 0, length: int = 32) -> list[Property]:
    """Measure every property on `model` with random prompts of up to `length` tokens (in eval mode)."""
    training = model.training
    model.eval()
    try:
        generator = torch.Generator().manual_seed(seed)
        T = min(length, model.config.block_size)
        idx = torch.randint(model.config.vocab_size, (1, T), generator=generator).to(_device(model))  # (1, T)
        eps = torch.finfo(next(model.parameters()).dtype).eps
        return [
            check_rows(model, idx, eps),
            check_causality(model, idx, generator),
            check_generation(model, generator, eps),
            measured("§4.2", "fused projection = separate projections", _projection_gaps(model, idx), eps,
                      "W_QKV and the fast kernel vs three matrices and per-head attention, every layer"),
            check_tied(model.config.tied, model.lm_head.weight, model.transformer.wte.weight),
            check_permutation(model, idx, generator, eps),
        ]
    finally:
        model.train(training)


def failed(properties: list[Property]) -> list[Property]:
    """The properties that apply to the model and do not hold."""
    return [p for p in properties if p.passed is False]

