"""A learner's parts as its model uses them: how the model calls each submodule, recorded on one forward.

A block written as forward(x, freqs_cis, mask) or a multi-head module written as forward(query, key,
value, mask) cannot be called on rows alone, and guessing its other arguments fails correct code. So
the model is run once on a few ids with a pre-hook on every submodule, and a part found inside it is
checked with the arguments the model itself passed, the input rows swapped for the check's own.

Shape legend: B batch, T positions, D model width.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

from gptlab.handout.learner.calling import LanguageModel

Call = tuple[tuple, dict[str, Any]]  # a recorded call: (args, kwargs), args[0] the input rows
T_RECORDED = 6  # positions of the recorded forward: the part checks' rows have as many
ROTARY = re.compile(r"rope|rotary|freqs|inv_freq", re.IGNORECASE)


def record_calls(model: nn.Module, label: str) -> dict[nn.Module, Call]:
    """Each submodule's last call while the model runs on ids (1, T_RECORDED) (after the calls that find
    the model's style, on other lengths)."""
    calls: dict[nn.Module, Call] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        calls[module] = (args, kwargs)

    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            LanguageModel(model, label).logits(torch.arange(T_RECORDED)[None] % 2)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def with_rows(call: Call, x: torch.Tensor) -> Call:
    """The recorded call with its input rows (every argument that is the first one) replaced by x."""
    args, kwargs = call
    rows = args[0]
    return (tuple(x if a is rows else a for a in args), {k: x if v is rows else v for k, v in kwargs.items()})


def needs_arguments(cls: type) -> bool:
    """Whether the class's forward requires more than the input rows (a mask, a key and value, ...)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[2:]  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.default is p.empty and p.kind in positional for p in params)


def rotary(module: nn.Module, call: Call | None) -> bool:
    """Whether positions enter inside the module (rotary embeddings): a complex argument, or a part,
    buffer or attribute named after rotary frequencies."""
    values = [*call[0], *call[1].values()] if call is not None else []
    if any(isinstance(v, torch.Tensor) and v.is_complex() for v in values):
        return True
    names = [type(m).__name__ for m in module.modules()] + [n for n, _ in module.named_buffers()]
    names += [n for m in module.modules() for n in vars(m) if not n.startswith("_")]
    return any(ROTARY.search(name) for name in names)
