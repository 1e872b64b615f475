"""Checks that a learner's model can learn (§7.2): the bugs that pass every unit test but stop training.

On a deep copy of the model as its constructor built it (call this before anything redraws its weights),
seeded and at the check's tiny size: the loss at initialisation is near ln V (uniform guessing, as small
random weights give), one backward pass reaches every parameter (none detached or unused), and Adam
memorises one small batch whose prefixes all differ, so that a loss near 0 is reachable.

Shape legend: B batch, T positions, V vocabulary.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.handout.learner.calling import LanguageModel, run
from gptlab.handout.properties import Check, at_most

SECTION = "§7.2"
B, T = 4, 8  # the batch memorised: B sequences of T inputs (and T targets)
SEED = 72
INITIAL_GAP = 1.0  # |initial loss - ln V| allowed: logits of std up to ~sqrt(2) (loss ~ ln V + std^2 / 2)
LR = 1e-2  # Adam's learning rate for memorising the batch
BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults
STEPS = 200  # at most this many steps
MEMORISED = 0.1  # the batch counts as memorised below this fraction of ln V
TOO_LARGE = ("the logits start far from uniform, a wrong initial scale: scores not divided by sqrt(d_k), or "
             "an embedding or head drawn with std 1 and no norm before the head; draw the head small (std "
             "0.02) or normalise its input (a final LayerNorm)")
TOO_SMALL = ("random weights already predict the next token better than uniform guessing: the logits read "
             "the answer (the targets, or later tokens through a missing causal mask)")
DETACHED = ("no gradient reaches {names}: a module created but never called in forward, or its output cut "
            "off from the loss by .detach(), .data, torch.no_grad() or a round trip through .item() or numpy")
NOT_FINITE = ("the loss is NaN or infinite: a softmax over a row whose every score is -inf (a mask that "
              "hides all the keys of some query, e.g. its own position, the diagonal), or an overflow")
OWN_LOSS = ("the logits start near uniform (their next-token cross-entropy is {scored:.3f}), but the model's "
            "own loss is {loss:.3f}: it is not the mean cross-entropy of the logits against the next tokens "
            "(a sum instead of a mean? see the §7.3 loss check)")
PROBABILITIES = ("the forward returns probabilities (a softmax) where logits are expected: cross-entropy "
                 "applies its own log-softmax, so the loss cannot fall below ln(1 + (V - 1) / e); return "
                 "the head's output as it is")
STUCK = ("the model cannot memorise {B} sequences of {T} tokens in {steps} Adam steps (lr {lr:g}), which a "
         "correct model does in a few dozen: a missing residual connection (x = x + sublayer(x)), a wrong "
         "initial scale, a detached or unused parameter, or a norm or softmax over the wrong axis")


def learning_checks(model: nn.Module, label: str) -> list[Check]:
    """§7.2 on a copy of `model`: the initial loss, gradients to every parameter, memorising one batch."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(SEED)
        torch.set_num_threads(1)  # ~200 tiny steps: a second thread only adds hand-over time (10x here)
        try:
            lm = LanguageModel(run(f"copy.deepcopy({label})", copy.deepcopy, model), label)
            tokens = batch(lm.vocab)
            idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each: .view works
            results = [initial_loss(lm, idx, targets), gradients(lm, idx, targets)]
            return results + [memorises(lm, idx, targets, detached=results[1].passed is False)]
        finally:
            torch.set_num_threads(threads)


def batch(vocab: int) -> torch.Tensor:
    """(B, T + 1) random ids whose first tokens differ, so that every prefix has one next token."""
    tokens = torch.randint(0, vocab, (B, T + 1))
    tokens[:, 0] = torch.randperm(vocab)[:B] if vocab >= B else torch.arange(B) % vocab
    return tokens


def next_token_loss(lm: LanguageModel, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of every position's logits against the next token."""
    return F.cross_entropy(lm.logits(idx).flatten(0, 1), targets.flatten())


def initial_loss(lm: LanguageModel, idx: torch.Tensor, targets: torch.Tensor) -> Check:
    """The loss before training is near ln V: the model's own loss if it returns one, else cross-entropy."""
    with torch.no_grad():
        own, scored = lm.loss(idx, targets), float(next_token_loss(lm, idx, targets))
    loss, uniform = scored if own is None else float(own), math.log(lm.vocab)
    what = "the model's own loss" if own is not None else "cross-entropy of the logits"
    cause = (NOT_FINITE if not math.isfinite(loss) else
             OWN_LOSS.format(scored=scored, loss=loss) if abs(scored - uniform) <= INITIAL_GAP else
             TOO_SMALL if loss < uniform else TOO_LARGE)
    return at_most(SECTION, "the loss at initialisation is near ln V", abs(loss - uniform), INITIAL_GAP,
                   f"|loss - ln V| <= {INITIAL_GAP:g}, ln V = {uniform:.3f} for V = {lm.vocab}",
                   f"{loss:.3f} ({what})", note=f"{what} on {B} random sequences of {T} tokens", cause=cause)


def gradients(lm: LanguageModel, idx: torch.Tensor, targets: torch.Tensor) -> Check:
    """One backward pass gives every trainable parameter a gradient (a matrix a nonzero one).

    A vector may get exactly zero: a key projection's bias shifts every score of a query alike, which
    the softmax ignores."""
    lm.model.zero_grad(set_to_none=True)
    loss = next_token_loss(lm, idx, targets)
    if loss.requires_grad:  # else nothing reaches any parameter: forward under torch.no_grad()
        run(f"the backward pass through {lm.label}", loss.backward)
    params = [(name, p) for name, p in lm.model.named_parameters() if p.requires_grad]
    missing = [name for name, p in params if p.grad is None or (p.dim() >= 2 and not bool(p.grad.any()))]
    lm.model.zero_grad(set_to_none=True)
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    return at_most(SECTION, "every parameter gets a gradient", len(missing), 0,
                   f"a gradient for each of the {len(params)} trainable parameters",
                   f"{len(missing)} without one" + (f": {shown}" if missing else ""),
                   note="one backward pass of the next-token cross-entropy",
                   cause=DETACHED.format(names=shown))


def memorises(lm: LanguageModel, idx: torch.Tensor, targets: torch.Tensor, detached: bool) -> Check:
    """Adam drives the next-token loss on one batch to MEMORISED * ln V or below within STEPS steps."""
    params = [p for p in lm.model.parameters() if p.requires_grad]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    bound = MEMORISED * math.log(lm.vocab)
    for step in range(STEPS + 1):  # eval mode throughout: a dropout the learner hard-coded stays off
        value = next_token_loss(lm, idx, targets)
        loss = value.item()
        if loss <= bound or not math.isfinite(loss) or step == STEPS or not value.requires_grad:
            break
        grads = run(f"the backward pass through {lm.label}", torch.autograd.grad, value, params,
                    allow_unused=True)
        adam_step(params, grads, moments, step + 1)
    return at_most(SECTION, f"memorises one batch ({B} x {T} tokens)", loss, bound,
                   f"next-token loss <= {MEMORISED:g} ln V = {bound:.3f} within {STEPS} Adam steps",
                   f"{loss:.3f} after {step} steps", note=f"Adam, lr {LR:g}, on {B} sequences of {T} tokens "
                   "whose prefixes all differ",
                   cause="" if loss <= bound else stuck_cause(lm, idx, loss, detached))


def adam_step(params: list[nn.Parameter], grads: tuple[torch.Tensor | None, ...],
              moments: list[tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
    """One step of Adam (AdamW without weight decay), written out: torch.optim would import torch._dynamo,
    ~2 s in each fresh check process."""
    with torch.no_grad():
        for param, grad, (mean, square) in zip(params, grads, moments, strict=True):
            if grad is None:
                continue
            mean.lerp_(grad, 1 - BETAS[0])
            square.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
            denominator = (square / (1 - BETAS[1] ** step)).sqrt_().add_(EPS)
            param.addcdiv_(mean, denominator, value=-LR / (1 - BETAS[0] ** step))


def stuck_cause(lm: LanguageModel, idx: torch.Tensor, loss: float, detached: bool) -> str:
    """Why the batch was not memorised: probabilities given as logits, a NaN, or the usual suspects."""
    if not math.isfinite(loss):
        return NOT_FINITE
    with torch.no_grad():
        logits = lm.logits(idx)
    if bool((logits >= 0).all()) and float((logits.sum(-1) - 1).abs().max()) <= 1e-4:
        return PROBABILITIES
    untrained = "some parameters get no gradient (the check above), so they never train: " if detached else ""
    return untrained + STUCK.format(B=B, T=T, steps=STEPS, lr=LR)
