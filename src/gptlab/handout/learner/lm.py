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
from gptlab.handout.learner.mistakes import MASK_SLIPS, NAN, UNKNOWN, diagnose_reads, heads_cause
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
BY_TOKEN = ("a position table is indexed by the token ids, so the same token gets the same row at every "
            "position: index it by position, pos_emb(torch.arange(T))")
BY_BATCH = ("the logits depend on the batch index: a position table indexed by it (pos_emb(torch.arange(B))) "
            "or a reduction over the batch axis: index positions with torch.arange(T)")
OUTSIDE = ("every block is causal on its own, so positions mix outside the blocks: look at the embedding, "
           "the final norm and the head")
SHIFT = ("the loss scores each position against its own input token, not the next one: shift the targets "
         "by one (targets[:, i] = idx[:, i + 1]); the model learns to copy, a future leak generation "
         "never has")
SHIFT_BOTH = ("the loss drops the first position of both the logits and the labels (logits[:, 1:] against "
              "labels[:, 1:]), so each position is still scored against its own token: shift one against the "
              "other, logits[:, :-1] against labels[:, 1:]")


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


def _token_embedding(lm: LanguageModel, idx: torch.Tensor) -> nn.Module | None:
    """The embedding table that the model feeds the ids themselves (the first, if several are)."""
    fed = _fed_ids(lm, idx)
    return fed[0] if fed else None


def _fed_ids(lm: LanguageModel, idx: torch.Tensor, first_block: nn.Module | None = None,
             rows: list[torch.Tensor] | None = None) -> list[nn.Module]:
    """The embedding tables (nn.Embedding, or a class named *Embedding*) fed the token ids themselves while
    the model runs on idx, in the order called; the first block's input rows are kept in `rows`."""
    fed: list[nn.Module] = []
    tables = [m for m in lm.model.modules()
              if isinstance(m, nn.Embedding) or "embedding" in type(m).__name__.lower()]

    def take(module: nn.Module, args: tuple) -> None:
        ids = args[0] if args else None
        if isinstance(ids, torch.Tensor) and ids.shape == idx.shape and torch.equal(ids, idx):
            fed.append(module)

    hooks = [m.register_forward_pre_hook(take) for m in tables]
    if first_block is not None and rows is not None:
        hooks.append(first_block.register_forward_pre_hook(lambda _, args: rows.extend(args[:1])))
    try:
        with torch.no_grad():
            lm.logits(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return list(dict.fromkeys(fed))


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
        return leaf[-1].clone()  # not the leaf itself: the model may write into its input rows in place

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
    """Why output i sees later inputs (or the logits are NaN): which blocks are unmasked, and how the mask
    is wrong in them, by the references on the attention's own weights, else by which rows a block reads."""
    if leaky and len(leaky) < len(blocks):
        masked = [b for b in range(len(blocks)) if b not in leaky]
        return (f"only block(s) {masked} of {len(blocks)} are masked; block(s) {leaky} let row i read later "
                "rows, and an earlier block can copy the future into an allowed row that no later mask "
                "removes: mask every block")
    with torch.no_grad():
        nan = bool(lm.logits(idx).isnan().any())
    if not blocks or not (leaky or nan):
        return OUTSIDE if blocks else LEAK
    suspect = blocks[leaky[0] if leaky else 0]  # NaN logits: the first block is where they start
    cause = heads_cause(diagnose_inside(suspect, lambda: lm.logits(idx), width))
    if cause not in ("", UNKNOWN):
        return cause
    if nan:
        return NAN
    reads = block_dependence(lm, [suspect], idx)[0].abs().amax(-1) > 0  # (T, T): output row i reads row j
    return MASK_SLIPS.get(diagnose_reads(reads) or "none", "") or LEAK


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
        both = F.cross_entropy(logits[0, 1:], idx[0, 1:])  # the first position dropped from both
    inside = scored["the model shifts the targets itself"]
    if own is not None and abs(float(own) - float(inside)) <= 1e-4:  # it shifted the targets inside
        return close("§7.3", name, own.float(), inside, 1e-4, "cross-entropy of logits[i] against idx[i + 1]",
                     note="the model shifts the targets itself: pass targets = idx")
    check = close("§7.3", name, loss, scored["targets are the next tokens"], 1e-4,
                  "cross-entropy of logits[:, i] against targets[:, i] = idx[:, i + 1]")
    unshifted = abs(float(loss) - float(F.cross_entropy(logits[0], idx[0]))) <= 1e-4
    dropped = own is not None and abs(float(own) - float(both)) <= 1e-4
    return explain(check, NAN if bool(loss.isnan()) else SHIFT if unshifted else SHIFT_BOTH if dropped
                   else "the loss is not the cross-entropy of each position's logits against the next token: "
                   "F.cross_entropy(logits.flatten(0, 1), targets.flatten())")


def positions_check(lm: LanguageModel, blocks: list[nn.Module], idx: torch.Tensor) -> Check:
    """§6.1: whether the same token starts with a different row at another position (positions added);
    identical rows while a second table is fed the token ids is a position table indexed by the ids."""
    name = "input rows carry positions"
    if not blocks:
        return skipped("§6.1", name, "no blocks found, so the input rows cannot be read")
    rows: list[torch.Tensor] = []
    same = idx.clone()
    same[0, 4] = same[0, 0]  # the same token at positions 0 and 4
    fed = len(_fed_ids(lm, same, blocks[0], rows))
    differ = float((rows[0][0, 4] - rows[0][0, 0]).abs().max()) if rows else 0.0
    if differ > 1e-6 or fed > 1:
        check = exceeds("§6.1", name, differ, 1e-6, "max |row 4 - row 0|, the same token at two positions",
                        note="positions are added to the input rows" if differ > 1e-6 else
                        f"{fed} embedding tables are fed the token ids")
        return explain(check, BY_TOKEN)
    return skipped("§6.1", name, f"identical rows (max |row 4 - row 0| = {differ:.1e}): a choice, no "
                   "positions are added, so apart from the causal mask (and RoPE, if used inside attention) "
                   "the model is order-blind (§6.1)")


def batch_check(lm: LanguageModel, idx: torch.Tensor) -> Check:
    """§3.2 for the whole model: the same sequence twice in a batch gives the same logits twice (nothing
    depends on the batch index, e.g. a position table indexed by it)."""
    with torch.no_grad():
        twice = lm.logits(torch.cat([idx, idx]))  # (2, T, V)
    return explain(close("§3.2", "the same sequence gives the same logits at every batch index", twice[1],
                         twice[0], 1e-5, "batch item 0's logits"), BY_BATCH, NAN)


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
        skipped("§7.3", "output i ignores inputs after i (gradients)", "no embedding table is fed the ids")
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
    return results + [loss_check(lm, tokens), batch_check(lm, idx), positions_check(lm, blocks, idx)]


def _width(model: nn.Module) -> int:
    """The model width D: the token embedding's."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise LearnerError("the model has no nn.Embedding, so its width cannot be read")
    return embedding.embedding_dim
