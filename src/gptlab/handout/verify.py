"""The handout's properties, measured on a trained model (a checkpoint or an imported GPT-2).

`gptlab lab` checks the handout on small models it builds itself; this module runs the same property
functions (`gptlab.handout.properties`) on the user's model, on random token ids from a fixed seed, and
reports each one's deviation next to its tolerance (EPSILONS float epsilons of the model's dtype, times the
compared values' size): rows sum to one (§3.2); position i's logits do not change at all when every
later input changes (§7.3); cached generation gives the logits of rerunning the whole sequence at
every step (§7.1); fused = separate projections and heads, on each layer's real input (§4.2); a tied
head is the embedding tensor (§6); without positions (nor n-gram embeddings), the stack with its mask
off (on a copy) is permutation equivariant (§6.1). Generation needs `gptlab.generate`, hence this
module's place here.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from gptlab.generate import Decoder
from gptlab.handout import properties as checks
from gptlab.inspection.hooks import record, recorded_inputs
from gptlab.model import GPT

GENERATION_STEPS = 8


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[float]:
    """Eval mode without gradients while measuring, the caller's mode restored; yields the dtype's eps."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield torch.finfo(next(model.parameters()).dtype).eps
    finally:
        model.train(training)


def check_rows(model: GPT, idx: torch.Tensor, eps: float) -> checks.Check:
    """§3.2 on every layer's recorded weights (through the hook points, recomputed beside the kernel)."""
    names = [f"h.{n}.attn.weights" for n in range(model.config.n_layer)]
    with record(model, names) as weights:
        model(idx)
    note = f"{len(names)} layers x {model.config.n_head} heads x {idx.size(1)} queries"
    return checks.rows_sum_to_one([weights[name] for name in names], checks.EPSILONS * eps, note=note)


def check_generation(model: GPT, generator: torch.Generator, eps: float) -> checks.Check:
    """§7.1: greedy generation with the KV cache gives the logits of a full forward pass at every step."""
    name = "cached generation = uncached"
    if not model.config.causal:
        return checks.Check("§7.1", name, False, note="the model is not causal, so it cannot generate")
    length = max(1, min(model.config.block_size, 64) - GENERATION_STEPS)  # every step stays in the window
    row = torch.randint(model.config.vocab_size, (1, length), generator=generator)  # (1, T)
    row = row.to(next(model.parameters()).device)
    cached = Decoder(model, row.tolist(), use_cache=True)
    steps = []
    for _ in range(GENERATION_STEPS):
        reference = model(row)[0][:, -1]  # the handout's loop: the whole sequence again, (1, V)
        steps.append((cached.logits(), reference))
        token = reference.argmax(-1, keepdim=True)  # (1, 1)
        cached.append(token)
        row = torch.cat([row, token], dim=1)
    return checks.all_close("§7.1", name, steps, checks.relative(eps),
                            note=f"{length}-token prompt, {GENERATION_STEPS} greedy steps")


def check_projections(model: GPT, idx: torch.Tensor, eps: float) -> checks.Check:
    """§4.2 on every layer's real input: fused = separate projections, fast kernel = heads written out."""
    layers = [block.attn for block in model.transformer.blocks]
    inputs = recorded_inputs(layers, lambda: model(idx))
    pairs = [pair for attn, (x, *_) in zip(layers, inputs, strict=True)
             for pair in checks.fused_and_separate(attn, x)]
    note = "W_QKV and the fast kernel vs three matrices and per-head attention, every layer"
    return checks.all_close("§4.2", "fused projection = separate projections", pairs, checks.relative(eps),
                            note=note)


def check_permutation(model: GPT, idx: torch.Tensor, generator: torch.Generator, eps: float) -> checks.Check:
    """§6.1 on a copy with the mask off (it depends on order); positions and n-grams break it by design."""
    name = "no positions, no mask: permutation equivariant"
    if model.config.positions != "none":
        note = f"the model has {model.config.positions} positions, which break it by design"
        return checks.Check("§6.1", name, None, note=note)
    if model.config.ngram_embeddings:
        note = "the model has n-gram embeddings, which encode local order and so break it by design"
        return checks.Check("§6.1", name, None, note=note)
    unmasked = copy.deepcopy(model)
    for block in unmasked.transformer.blocks:
        block.attn.causal = False
    perm = torch.randperm(idx.size(1), generator=generator).to(idx.device)
    return checks.permutation_equivariant(name, lambda t: unmasked(t)[0], idx, perm, checks.relative(eps),
                                          note="checked on a copy with causal=False")


def check_precision(model: GPT, reference: GPT, idx: torch.Tensor, eps: float) -> checks.Check:
    """Logits of a reduced-precision model (bfloat16 weights) against the same weights in float32."""
    name = "reduced precision: logits vs float32"
    with evaluating(reference):
        expected = reference(idx)[0]
    got = model(idx)[0].float()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    return checks.close("-", name, got, expected, checks.relative(eps),
                        note=f"top-1 token agrees at {agree:.0%} of positions")


def verify_model(model: GPT, seed: int = 0, length: int = 32,
                 reference: GPT | None = None) -> list[checks.Check]:
    """Measure every property on `model` with random prompts of up to `length` tokens (in eval mode).

    `reference`, the same weights in float32 when `model` runs in a lower precision, adds the logit
    difference between the two.
    """
    with evaluating(model) as eps:
        generator = torch.Generator().manual_seed(seed)
        V, T = model.config.vocab_size, min(length, model.config.block_size)
        idx = torch.randint(V, (1, T), generator=generator).to(next(model.parameters()).device)  # (1, T)
        dependence = checks.replacement_dependence(lambda t: model(t)[0], idx, generator, 0, V)
        found = [
            check_rows(model, idx, eps),
            checks.ignores_later_inputs(dependence, "logits at i ignore every input after i",
                                        note=f"{T - 1} cuts, exact comparison"),
            check_generation(model, generator, eps),
            check_projections(model, idx, eps),
            checks.tied_head(model.config.tied, model.lm_head.weight, model.transformer.wte.weight),
            check_permutation(model, idx, generator, eps),
        ]
        return found if reference is None else [*found, check_precision(model, reference, idx, eps)]
