"""Checks of a learner's whole language model: §6.1 positions, §7.1 appending, §7.3 causality and the loss.

Causality is measured twice over the whole model (gradients of each position's logits with respect
to the input rows, and replacing later tokens), then block by block inside the running model: each
block's input is swapped for a leaf tensor by a hook, so a block that lets row i read a later row
is found even when a later block is masked. Where a block's attention module has readable weights,
the call the model makes to it is replayed and compared with the mistakes' references, which names
the mask's mistake (missing, after the softmax, filled with 0).

The model's matrices are redrawn with std 0.25 first (as the lab does), so that attention is far
from uniform and a leak moves the logits visibly, not by 1e-4.

Shape legend: B batch, T positions, D model width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.handout.learner.calling import LanguageModel, LearnerError
from gptlab.handout.learner.mistakes import UNKNOWN, heads_cause
from gptlab.handout.learner.parts import diagnose_inside
from gptlab.handout.properties import (
    Check,
    close,
    exceeds,
    explain,
    gradient_rows,
    ignores_later_inputs,
    replacement_dependence,
    skipped,
)

T = 8  # positions the checks use
LEAK = ("output i depends on a later input: the causal mask is missing, applied after the softmax, filled "
        "with 0 instead of -inf, or not applied in every block")
OUTSIDE = ("every block is causal on its own, so positions mix outside the blocks: look at the embedding, "
           "the final norm and the head")
SHIFT = ("the loss scores each position against its own input token, not the next one: shift the targets "
         "by one (targets[:, i] = idx[:, i + 1]); the model learns to copy, a future leak generation "
         "never has")


def sharpen(model: nn.Module) -> None:
    """Redraw every matrix with std 0.25 (norm gains and biases stay): attention far from uniform."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.25)


def find_blocks(model: nn.Module, block_class: type | None) -> list[nn.Module]:
    """The model's blocks: instances of the learner's block class, else the first ModuleList of one class."""
    if block_class is not None:
        found = [m for m in model.modules() if isinstance(m, block_class)]
        if found:
            return found
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1 and not isinstance(
                m[0], (nn.Linear, nn.Embedding)):
            return list(m)
    return []


def _token_embedding(lm: LanguageModel, idx: torch.Tensor) -> nn.Embedding | None:
    """The nn.Embedding that the model feeds the ids themselves."""
    fed: list[nn.Embedding] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: fed.append(m) if args and torch.equal(args[0], idx)
                                         else None)
             for m in lm.model.modules() if isinstance(m, nn.Embedding)]
    try:
        with torch.no_grad():
            lm.logits(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return fed[0] if fed else None


def _jacobian_rows(outputs: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """(T, T, D): entry (i, j) is d sum(outputs[0, i]) / d inputs[0, j], the gradient row of input j."""
    rows = [torch.autograd.grad(outputs[0, i].sum(), inputs, retain_graph=True, allow_unused=True)[0]
            for i in range(outputs.size(1))]
    return torch.stack([torch.zeros_like(inputs[0]) if r is None else r[0] for r in rows])


def gradient_dependence(lm: LanguageModel, idx: torch.Tensor) -> torch.Tensor | None:
    """§7.3 by gradients: (T, T, D) gradients of each position's logits by each token's embedding row."""
    embedding = _token_embedding(lm, idx)
    if embedding is None:
        return None
    leaf: list[torch.Tensor] = []

    def swap(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        leaf.append(output.detach().requires_grad_())
        return leaf[-1]

    hook = embedding.register_forward_hook(swap)
    try:
        with torch.enable_grad():
            logits = lm.logits(idx)
            return _jacobian_rows(logits, leaf[0])
    finally:
        hook.remove()


def block_dependence(lm: LanguageModel, blocks: list[nn.Module], idx: torch.Tensor) -> list[torch.Tensor]:
    """(T, T, D) for each block in place: the gradients of its output row i by its own input row j."""
    pairs: list[list[torch.Tensor]] = [[] for _ in blocks]

    def take_input(b: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            pairs[b][:] = [args[0].detach().requires_grad_()]
            return (pairs[b][0], *args[1:])

        return hook

    def take_output(b: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            out = output if isinstance(output, torch.Tensor) else output[0]
            if pairs[b]:
                pairs[b].append(out)

        return hook

    hooks = [h for b, block in enumerate(blocks) for h in (block.register_forward_pre_hook(take_input(b)),
                                                           block.register_forward_hook(take_output(b)))]
    try:
        with torch.enable_grad():
            lm.logits(idx)
            return [_jacobian_rows(pair[1], pair[0]) if len(pair) == 2 else torch.zeros(T, T, 1)
                    for pair in pairs]
    finally:
        for hook in hooks:
            hook.remove()


def leak_cause(lm: LanguageModel, blocks: list[nn.Module], leaky: list[int], idx: torch.Tensor,
               width: int) -> str:
    """Why output i sees later inputs: which blocks are unmasked, and how the mask is wrong in them."""
    if leaky and len(leaky) < len(blocks):
        masked = [b for b in range(len(blocks)) if b not in leaky]
        return (f"only block(s) {masked} of {len(blocks)} are masked; block(s) {leaky} let row i read later "
                "rows, and an earlier block can copy the future into an allowed row that no later mask "
                "removes: mask every block")
    if not leaky and blocks:
        return OUTSIDE
    found = diagnose_inside(blocks[leaky[0]], lambda: lm.logits(idx), width) if leaky else None
    cause = heads_cause(found)
    return cause if cause not in ("", UNKNOWN) else LEAK


def loss_check(lm: LanguageModel, tokens: torch.Tensor) -> Check:
    """§7.3: the loss scores position i against the next token, idx[i + 1] (tokens is (1, T + 1))."""
    name = "the loss is next-token (targets shifted by one)"
    idx, targets = tokens[:, :-1], tokens[:, 1:]  # (1, T) each
    with torch.no_grad():
        loss, logits = lm.loss(idx, targets), lm.logits(idx)
        if loss is None:
            return skipped("§7.3", name, f"{lm.label}'s forward takes no targets or returns no loss")
        loss = loss.float()
        scored = {
            "targets are the next tokens": F.cross_entropy(logits[0], targets[0]),
            "the model shifts the targets itself": F.cross_entropy(logits[0, :-1], idx[0, 1:]),
        }
        own = lm.loss(idx, idx)
    inside = scored["the model shifts the targets itself"]
    if own is not None and abs(float(own) - float(inside)) <= 1e-4:  # it shifted the targets inside
        return close("§7.3", name, own.float(), inside, 1e-4, "cross-entropy of logits[i] against idx[i + 1]",
                     note="the model shifts the targets itself: pass targets = idx")
    check = close("§7.3", name, loss, scored["targets are the next tokens"], 1e-4,
                  "cross-entropy of logits[:, i] against targets[:, i] = idx[:, i + 1]")
    unshifted = abs(float(loss) - float(F.cross_entropy(logits[0], idx[0]))) <= 1e-4
    return explain(check, SHIFT if unshifted else "the loss is not the cross-entropy of each position's "
                   "logits against the next token: F.cross_entropy(logits.flatten(0, 1), targets.flatten())")


def positions_check(lm: LanguageModel, blocks: list[nn.Module], idx: torch.Tensor) -> Check:
    """§6.1: whether the same token starts with a different row at another position (positions added)."""
    name = "input rows carry positions"
    if not blocks:
        return skipped("§6.1", name, "no blocks found, so the input rows cannot be read")
    rows: list[torch.Tensor] = []
    hook = blocks[0].register_forward_pre_hook(lambda m, args: rows.append(args[0]) if args else None)
    same = idx.clone()
    same[0, 4] = same[0, 0]  # the same token at positions 0 and 4
    try:
        with torch.no_grad():
            lm.logits(same)
    finally:
        hook.remove()
    differ = float((rows[0][0, 4] - rows[0][0, 0]).abs().max()) if rows else 0.0
    if differ > 1e-6:
        return exceeds("§6.1", name, differ, 1e-6, "max |row 4 - row 0|, the same token at two positions",
                       note="positions are added to the input rows")
    return skipped("§6.1", name, f"identical rows (max |row 4 - row 0| = {differ:.1e}): a choice, no "
                   "positions are added, so apart from the causal mask (and RoPE, if used inside attention) "
                   "the model is order-blind (§6.1)")


def model_checks(model: nn.Module, label: str, block_class: type | None) -> list[Check]:
    """§6.1, §7.1 and §7.3 for a whole model built by the learner's code."""
    sharpen(model)
    lm = LanguageModel(model, label)
    V = lm.vocab
    generator = torch.Generator().manual_seed(71)
    tokens = torch.randint(0, V, (1, T + 1), generator=generator)  # (1, T + 1)
    idx = tokens[:, :T]
    blocks = find_blocks(model, block_class)
    with torch.no_grad():
        before, after = lm.logits(idx[:, :-1]), lm.logits(idx)[:, :-1]
        replaced = replacement_dependence(lm.logits, idx, generator, 0, V)
    gradient = gradient_dependence(lm, idx)
    per_block = block_dependence(lm, blocks, idx) if blocks else []
    leaky = [b for b, rows in enumerate(per_block) if float(rows.abs().amax(-1).triu(1).max()) > 0]
    results = [
        close("§7.1", "appending a token leaves earlier logits unchanged", after, before, 1e-5,
              "logits before appending"),
        ignores_later_inputs(replaced, "output i ignores tokens after i (replacing them)"),
        skipped("§7.3", "output i ignores inputs after i (gradients)", "no nn.Embedding is fed the ids")
        if gradient is None else ignores_later_inputs(gradient_rows(gradient),
                                                      "output i ignores inputs after i (gradients)", "grad"),
    ]
    if blocks:
        widest = max(rows.size(-1) for rows in per_block)  # a block never reached has one zero feature
        worst = gradient_rows(torch.stack([F.pad(rows, (0, widest - rows.size(-1))) for rows in per_block]))
        results.append(ignores_later_inputs(worst, f"every block's output i ignores its rows after i "
                                                   f"({len(blocks)} blocks)", "grad",
                                            note=f"leaking blocks: {leaky or 'none'}"))
    else:
        results.append(skipped("§7.3", "every block's output i ignores its rows after i",
                               "no blocks found: name the block class with --block"))
    if any(c.passed is False for c in results):
        cause = leak_cause(lm, blocks, leaky, idx, _width(model))
        results = [explain(c, cause) for c in results]
    return results + [loss_check(lm, tokens), positions_check(lm, blocks, idx)]


def _width(model: nn.Module) -> int:
    """The model width D: the token embedding's."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise LearnerError("the model has no nn.Embedding, so its width cannot be read")
    return embedding.embedding_dim
