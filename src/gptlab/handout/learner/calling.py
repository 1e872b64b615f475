"""Calling a learner's code in its own style, and `LearnerError`, the one line when that code fails.

A learner writes attention(q, k, v), attention(q, k, v, mask) or attention(q, k, v, causal=True);
returns y or (y, weights); works on batches or on one matrix at a time; and writes a model whose
forward returns logits, (logits, loss), or, like nanoGPT, only the last position's logits unless
targets are given. `AttentionFunction` and `LanguageModel` find which by behaviour, once, and then
call the code the way it was written. Every call goes through `run`, so a crash is a `LearnerError`
naming the definition (the learner's exception is its __cause__, for a trimmed traceback).

Shape legend: B batch, Tq queries, Tk keys, d query/key width, dv value width, T positions, V vocabulary.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class LearnerError(ValueError):
    """The learner's code crashed or returned the wrong shape: one line naming the definition and problem."""


def describe(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def run(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs); an exception becomes a LearnerError naming `label`, with the original as cause."""
    try:
        return fn(*args, **kwargs)
    except LearnerError:
        raise
    except Exception as error:  # the learner's code may raise anything
        raise LearnerError(f"{label} raised {describe(error)}") from error


def shapes(value: Any) -> str:
    """What a call returned, in shapes: (2, 3, 4), or a tuple of them."""
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(shapes(v) for v in value) + ")"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------
# attention(q, k, v[, mask])

FLAG_NAMES = {"causal", "is_causal", "masked", "use_mask", "autoregressive"}
NOT_MASKS = {"dropout", "dropout_p", "p", "scale", "training", "train", "return_weights", "need_weights",
             "temperature", "dim", "device", "dtype", "eps"}  # a fourth argument that is no mask
# How a mask may encode keep (Tq, Tk), True where query i may see key j; found by behaviour.
CONVENTIONS: dict[str, Callable[[torch.Tensor], Any]] = {
    "bool mask, True = may attend": lambda keep: keep,
    "bool mask, True = hidden": lambda keep: ~keep,
    "additive mask, 0 or -inf": lambda keep: torch.zeros(keep.shape).masked_fill(~keep, float("-inf")),
    "0/1 mask, 1 = may attend": lambda keep: keep.float(),
}
FLAG = "causal flag"  # attention(q, k, v, causal=True): the square causal mask only
ABSENT = object()  # no mask: passed as None (False for a causal flag) if the function takes one


def visible_masks(n_queries: int, n_keys: int) -> list[Any]:
    """A required mask that hides nothing, in each convention a learner may use, to be tried in turn: none,
    an all-True keep, an all-False hide, and ones (1 = may attend, or one shift added to every score)."""
    shape = (n_queries, n_keys)
    return [None, torch.ones(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool),
            torch.ones(shape)]


def mask_parameter(fn: Callable[..., Any]) -> inspect.Parameter | None:
    """fn's mask argument after (q, k, v): one named *mask* or a causal flag, else a fourth positional one."""
    try:
        params = list(inspect.signature(fn).parameters.values())[3:]
    except (TypeError, ValueError):  # a builtin or a C function: no signature to read
        return None
    named = next((p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and (p.name.lower() in FLAG_NAMES or "mask" in p.name.lower())), None)
    fourth = params[0] if params and params[0].kind is params[0].POSITIONAL_OR_KEYWORD else None
    return named or (fourth if fourth is not None and fourth.name.lower() not in NOT_MASKS else None)


def probe(shape: tuple[int, ...], n_queries: int, n_keys: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random q (*shape, Tq, d=5), k (*shape, Tk, 5), v (*shape, Tk, dv=6), spread enough to route."""
    g = torch.Generator().manual_seed(seed)
    return (1.5 * torch.randn(*shape, n_queries, 5, generator=g),
            1.5 * torch.randn(*shape, n_keys, 5, generator=g), torch.randn(*shape, n_keys, 6, generator=g))


class AttentionFunction:
    """A learner's attention function, called batched (rank 3) if it can, else one matrix at a time."""

    def __init__(self, fn: Callable[..., Any], label: str) -> None:
        self.fn, self.label = fn, label
        param = mask_parameter(fn)
        self.mask_param = None if param is None else param.name
        self.flag = param is not None and param.name.lower() in FLAG_NAMES
        self.required = param is not None and param.default is param.empty and not self.flag
        self.visible: int | None = None  # which of visible_masks a required mask takes, once found
        self.convention: str | None = None  # set by the mask checks, once found
        q, k, v = probe((2,), 3, 4, seed=0)
        self.batched = self.works(q, k, v)
        self.returns_weights = False
        if not self.batched and not self.works(q[0], k[0], v[0]):
            self.direct(q, k, v)  # raises the batched call's LearnerError
        inputs = (q, k, v) if self.batched else (q[0], k[0], v[0])
        self.returns_weights = self.direct(*inputs)[1] is not None

    def works(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a direct call on these inputs runs and returns y of the right shape."""
        try:
            self.direct(q, k, v)
        except LearnerError:
            return False
        return True

    def direct(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Any = ABSENT) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One call as written: y (..., Tq, dv) and, if it returns them, the weights (..., Tq, Tk)."""
        if mask is ABSENT and self.required:
            return self._unmasked(q, k, v)
        if mask is ABSENT:  # said explicitly, since a default might mask
            mask = False if self.flag else None
        kwargs = {} if self.mask_param is None else {self.mask_param: mask}
        shown = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}{', mask' * bool(kwargs)}"
        call = f"{self.label}({shown})"
        with torch.no_grad():
            out = run(call, self.fn, q, k, v, **kwargs)
        y_shape, w_shape = (*q.shape[:-1], v.size(-1)), (*q.shape[:-1], k.size(-2))
        found = [out] if isinstance(out, torch.Tensor) else [
            t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
        ys = [t for t in found if tuple(t.shape) == y_shape]
        if not ys:
            raise LearnerError(f"{call} returned {shapes(out)}: expected y of shape {y_shape}, "
                               "or (y, weights)")
        weights = next((t for t in found if t is not ys[0] and tuple(t.shape) == w_shape), None)
        return ys[0].float(), None if weights is None else weights.float()

    def _unmasked(self, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A call with a required mask hiding nothing: the first of `visible_masks` with finite outputs."""
        masks = visible_masks(q.size(-2), k.size(-2))
        if self.visible is not None:
            return self.direct(q, k, v, masks[self.visible])
        for i, mask in enumerate(masks[:-1]):
            try:
                y, weights = self.direct(q, k, v, mask)
            except LearnerError:
                continue
            if bool(y.isfinite().all()):
                self.visible = i
                return y, weights
        self.visible = len(masks) - 1
        return self.direct(q, k, v, masks[-1])

    def encode(self, keep: torch.Tensor) -> Any:
        """The mask argument that hides keys where keep (Tq, Tk) is False, in the learner's convention."""
        assert self.convention is not None, "the mask convention is found before masked calls"
        return True if self.convention == FLAG else CONVENTIONS[self.convention](keep)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        """y for q (..., Tq, d), k, v in the learner's style; keys hidden where keep (Tq, Tk) is False."""
        mask = ABSENT if keep is None else self.encode(keep)
        if self.batched or q.dim() == 2:
            return self.direct(q, k, v, mask)[0]
        items = zip(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]),
                    strict=True)  # one (T, d) matrix at a time
        ys = [self.direct(a, b, c, mask)[0] for a, b, c in items]
        return torch.stack(ys).reshape(*q.shape[:-1], v.size(-1))


# ---------------------------------------------------------------------------------------------
# A whole model: ids (B, T) -> logits (B, T, V)


def _first(out: Any, test: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
    """The first tensor in a forward's result (a tensor, tuple, list, dict or output object) passing test."""
    if isinstance(out, torch.Tensor):
        return out if test(out) else None
    if isinstance(out, dict):
        out = list(out.values())
    elif not isinstance(out, (tuple, list)):
        out = [getattr(out, name, None) for name in ("logits", "loss")]
    return next((t for t in out if isinstance(t, torch.Tensor) and test(t)), None)


class LanguageModel:
    """A learner's model called in its own style; `logits` always gives every position's (B, T, V)."""

    def __init__(self, model: nn.Module, label: str) -> None:
        self.model, self.label = model.eval(), label
        try:
            self.takes_targets = len(inspect.signature(model.forward).parameters) >= 2
        except (TypeError, ValueError):
            self.takes_targets = False
        self.with_targets = False  # whether every position's logits need targets (nanoGPT)
        idx = torch.tensor([[0, 1, 1, 0]])  # ids below 2 fit any vocabulary
        logits = self.forward_logits(idx)
        if logits.dim() == 3 and logits.shape[:2] == (1, 1) and self.takes_targets:
            self.with_targets = True  # only the last position without targets
            logits = self.forward_logits(idx)
        if logits.dim() != 3 or logits.shape[:2] != idx.shape:
            raise LearnerError(f"{label}(idx) gives logits of shape {tuple(logits.shape)} for idx of shape "
                               f"(B, T) = {tuple(idx.shape)}: expected (B, T, V), one row per position")
        self.vocab = logits.size(-1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """The model's own forward, as a LearnerError if it crashes."""
        if targets is None:
            return run(f"{self.label}(idx)", self.model, idx)
        return run(f"{self.label}(idx, targets)", self.model, idx, targets)

    def forward_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for ids (B, T): (B, T, V), or whatever the model returned if it cannot be read as that."""
        out = self.forward(idx, torch.zeros_like(idx) if self.with_targets else None)
        logits = _first(out, lambda t: t.dim() in (2, 3))
        if logits is None:
            raise LearnerError(f"{self.label}(idx) returned {shapes(out)}: expected logits (B, T, V)")
        if logits.dim() == 2 and logits.size(0) == idx.numel():  # flattened to (B * T, V) with targets
            logits = logits.view(*idx.shape, -1)
        return logits.float()

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Every position's logits (B, T, V) for ids (B, T)."""
        logits = self.forward_logits(idx)
        if logits.shape[:2] != idx.shape:
            raise LearnerError(f"{self.label}(idx) gives logits of shape {tuple(logits.shape)} for idx of "
                               f"shape {tuple(idx.shape)}: expected (B, T, V)")
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The model's own loss for (idx, targets), or None if it returns none."""
        if not self.takes_targets:
            return None
        return _first(self.forward(idx, targets), lambda t: t.dim() == 0)
