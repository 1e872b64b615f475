"""Checks of a learner's multi-head module (§3.2, §4, §4.1, §4.2, §6.1) and block (§3.2, §5, §6.1).

Each part is built at the handout's sizes with `build` (D=8, H=2 for §4's count; D=4, H=2 for §4.1),
called on rows (B, T, D), and compared with gptlab.handout.worked's numbers and with its own weights
written out (mistakes.heads_reference). A check that needs weights it cannot read or set is skipped
with the reason.

Shape legend: B batch, T positions, D model width, H heads.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gptlab.handout.learner.build import BuildError, build, sizes
from gptlab.handout.learner.calling import LearnerError, run, shapes, visible_masks
from gptlab.handout.learner.inside import Call, needs_arguments, rotary, with_rows
from gptlab.handout.learner.mistakes import (
    AVERAGED,
    NAN,
    UNKNOWN,
    diagnose_heads,
    heads_cause,
    heads_reference,
)
from gptlab.handout.learner.projections import Wiring, find_wiring, layouts
from gptlab.handout.properties import Check, at_most, close, explain, permutation_equivariant, skipped
from gptlab.handout.worked import (
    TWO_HEADS,
    batch_items_apart,
    head_parameters,
    layer_norm,
    two_head_input,
    two_head_weights,
    two_heads,
)

Rows = Callable[[torch.Tensor], torch.Tensor]  # rows (B, T, D) -> rows (B, T, D)
BATCH = ("batch items mix: something reduces over the batch axis (dim 0), e.g. a softmax, mean or norm "
         "over it, or (T, B, D) inputs given to a layer that expects (B, T, D)")
MHA_LAYOUT = ("nn.MultiheadAttention reads (T, B, D) unless it is built with batch_first=True, so it attends "
              "across the batch: pass batch_first=True")
NORM = ("LayerNorm normalises each token over its D features, the last axis: nn.LayerNorm(D), or "
        "x.mean(-1, keepdim=True) and x.var(-1, keepdim=True, unbiased=False)")
ORDER = ("the output does not follow a permutation of the rows: something uses the position index "
         "(a position table or a fixed mask inside the part)")


def _rows_in(out: Any) -> torch.Tensor | None:
    """The output rows of a forward: the tensor it returned, or the first tensor of a tuple it returned."""
    return out if isinstance(out, torch.Tensor) else next(
        (t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)


def _required_mask(module: nn.Module) -> bool:
    """Whether the module's forward needs a second argument (a mask without a default)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.default is p.empty and p.kind in positional for p in params)


def rows_of(module: nn.Module, label: str, width: int, recorded: Call | None = None) -> Rows:
    """module(x) as a function of rows (B, T, D), reading the output rows out of a tuple if it returns one.

    Called as the model called it when that call was `recorded`, x in place of its rows. Otherwise a forward
    that requires a mask gets one that hides nothing: the first of `visible_masks` it runs with and gives
    finite rows for (the checks here are of unmasked parts; the model's own mask is checked whole)."""
    chosen: list[int] = []

    def call(x: torch.Tensor) -> Any:
        shown = f"{label}(x {tuple(x.shape)})"
        if recorded is not None:
            args, kwargs = with_rows(recorded, x)
            return run(f"{shown} as the model calls it", module, *args, **kwargs)
        if not _required_mask(module):
            return run(shown, module, x)
        masks = visible_masks(x.size(1), x.size(1))
        if chosen:
            return run(f"{shown}, mask", module, x, masks[chosen[0]])
        for i, mask in enumerate(masks[:-1]):
            try:
                out = run(f"{shown}, mask", module, x, mask)
            except LearnerError:
                continue
            rows = _rows_in(out)
            if rows is not None and bool(rows.isfinite().all()):
                chosen.append(i)
                return out
        chosen.append(len(masks) - 1)
        return run(f"{shown}, mask", module, x, masks[-1])

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = call(x)
        found = _rows_in(out)
        if found is None or found.shape != x.shape:
            raise LearnerError(f"{label}(x) returned {shapes(out)} for x of shape {tuple(x.shape)}: "
                               f"expected rows of the same shape (B, T, D)")
        return found.float()

    return forward


def input_width(module: nn.Module, default: int) -> int:
    """The width D a module reads: its nn.MultiheadAttention's, or its first nn.Linear's input width."""
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention):
            return m.embed_dim
        if isinstance(m, nn.Linear):
            return m.in_features
    return default


def build_at(cls: type, label: str, width: int, heads: int,
             namespace: dict[str, Any]) -> tuple[nn.Module, int]:
    """The part built at width D and H heads, and the width it reads: a part that takes its width from
    the file's globals (MultiHeadAttention(num_heads, head_size) with a global n_embd) is rebuilt there."""
    part = build(cls, label, sizes(width, heads), namespace)
    actual = input_width(part, width)
    if actual != width and actual % heads == 0:
        part = build(cls, label, sizes(actual, heads), namespace)
    return part, actual


def part_at(cls: type, label: str, width: int, heads: int, namespace: dict[str, Any],
            instance: nn.Module | None) -> tuple[nn.Module, int]:
    """`build_at`, or, where the class cannot be built, the instance found inside the learner's model."""
    try:
        return build_at(cls, label, width, heads, namespace)
    except BuildError:
        if instance is None:
            raise
        return instance.eval(), input_width(instance, width)


def later_dependence(forward: Rows, x: torch.Tensor) -> torch.Tensor:
    """(T, T): entry (i, j) is max |change| of output row i when every row from j on is redrawn."""
    clean = forward(x)
    T = x.size(1)
    dependence = torch.zeros(T, T)
    generator = torch.Generator().manual_seed(5)
    for cut in range(1, T):
        changed = x.clone()
        changed[:, cut:] = torch.randn(x.size(0), T - cut, x.size(2), generator=generator)
        dependence[:, cut] = (forward(changed) - clean).abs().amax(dim=(0, 2))
    return dependence


def is_causal(forward: Rows, x: torch.Tensor) -> bool:
    """Whether no output row moves when later rows change."""
    return float(later_dependence(forward, x).triu(1).max()) == 0.0


def _rows(width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x (B=2, T=6, D), spread enough to route, and x with batch item 1 redrawn."""
    generator = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(2, 6, width, generator=generator)
    changed = x.clone()
    changed[1] = 3 * torch.randn(6, width, generator=generator)
    return x, changed


def equivariance(forward: Rows, x: torch.Tensor, causal: bool, label: str) -> Check:
    """§6.1: an unmasked part without positions is permutation equivariant (skipped for a causal one)."""
    name = f"{label} is permutation equivariant"
    if causal:
        return skipped("§6.1", name, f"{label} masks later rows (§7.3): §6.1 is about unmasked attention")
    perm = torch.randperm(x.size(1), generator=torch.Generator().manual_seed(61))
    check = permutation_equivariant(name, forward, x, perm, 1e-4, f"{label}(x)[:, perm]")
    return explain(check, ORDER)


def diagnose_inside(container: nn.Module, trigger: Callable[[], object],
                    width: int) -> tuple[bool, str, str] | None:
    """(causal, slip, mask_slip) of the attention inside `container` (or `container` itself), or None.

    `trigger()` runs the code that calls it; each module with readable W_Q, W_K, W_V is called again
    with the arguments it got (the mask included) and its output matched with the mistakes' references.
    """
    candidates = [(m, w) for m in container.modules() for w in [find_wiring(m, width, 1)]
                  if isinstance(w, Wiring)]
    calls: dict[nn.Module, tuple[tuple, dict]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, kwargs: calls.setdefault(m, (args, kwargs)) and None,
                                         with_kwargs=True) for m, _ in candidates]
    try:
        with torch.no_grad():
            trigger()
    finally:
        for hook in hooks:
            hook.remove()
    for module, wiring in candidates:
        args, kwargs = calls.get(module, ((), {}))
        if not args or not isinstance(args[0], torch.Tensor):
            continue
        with torch.no_grad():
            out = run(f"{type(module).__name__}", module, *args, **kwargs)
        out = out if isinstance(out, torch.Tensor) else out[0]
        x, out = (args[0], out) if wiring.batch_first else (args[0].transpose(0, 1), out.transpose(0, 1))
        heads = [wiring.n_head] if wiring.n_head > 1 else [h for h in (1, 2, 4, 8) if width % h == 0]
        for n_head in heads:
            found = diagnose_heads(out.float(), x.float(), wiring.read(), n_head)
            if found is not None:
                return found
    return None


def masked(part: nn.Module, forward: Rows, x: torch.Tensor, width: int) -> bool:
    """Whether a part means to hide later rows: its attention's diagnosis says so, else no row reads later."""
    found = diagnose_inside(part, lambda: forward(x), width)
    return found[0] if found is not None else is_causal(forward, x)


# ---------------------------------------------------------------------------------------------
# The multi-head module


def _parameter_cause(module: nn.Module, width: int, n_head: int) -> str:
    """Why §4's count is off, from the numbers: a missing W_O, averaged heads, heads of full width."""
    D = width
    weights = sum(p.numel() for p in module.parameters() if p.dim() >= 2)
    known = {3 * D * D: "there is no output projection W_O: add nn.Linear(D, D) after concatenating the "
                        "heads",
             3 * D * D + D * D // n_head: AVERAGED,
             3 * n_head * D * D + D * D: "each head projects to D features instead of D / H: give each head "
                                         "head_size = D // H, so that the H heads together hold 3 D^2"}
    return known.get(weights, "§4 counts 3 D^2 weights in W_Q, W_K, W_V and D^2 in W_O (biases apart): "
                              "something is missing or extra")


def written_out(forward: Rows, wiring: Wiring | str, x: torch.Tensor) -> Check:
    """§4.2: the module's output equals its own W_Q, W_K, W_V and W_O written out, head by head."""
    name = "module equals its projections written out per head"
    if isinstance(wiring, str):
        return skipped("§4.2", name, f"cannot read W_Q, W_K, W_V and W_O: {wiring}")
    measured = forward(x)
    weights = wiring.read()
    found = diagnose_heads(measured, x, weights, wiring.n_head)
    correct = found is not None and found[1:] == ("none", "none")
    causal = found[0] if found is not None and correct else False
    check = close("§4.2", name, measured, heads_reference(x, weights, wiring.n_head, causal).float(), 1e-4,
                  "softmax(Q_h K_h^T / sqrt(d_h)) V_h per head, concatenated, then W_O",
                  f"{wiring.layout}, H={wiring.n_head}, {'causal' if causal else 'unmasked'}")
    return explain(check, heads_cause(found))


def _two_heads_checks(cls: type, label: str, namespace: dict[str, Any], cause: str) -> list[Check]:
    """§4.1 with the handout's weights set into a fresh D=4, H=2 module."""
    D, H = TWO_HEADS
    try:
        module, width = build_at(cls, label, D, H, namespace)
    except BuildError as error:
        return [skipped("§4.1", "output at position 2", f"needs a fresh module at D={D}, H={H}: {error}")]
    if width != D:
        return [skipped("§4.1", "output at position 2", f"{label} reads width D={width} from the file, not "
                        f"the D={D} it was built with, so §4.1's 4 x 4 weights do not fit")]
    wiring = read_as(module, rows_of(module, label, D), _rows(D, seed=41)[0], D, H)
    if isinstance(wiring, str):
        return [skipped("§4.1", "output at position 2", f"needs W_Q, W_K, W_V and W_O set: {wiring}")]
    if wiring.n_head != H:
        return [skipped("§4.1", "output at position 2", f"{label} built with H={H} has {wiring.n_head} "
                        "heads")]
    wiring.write(*two_head_weights())
    y = rows_of(module, label, D)(two_head_input())[0, 2]  # (D,): position 2, which sees every key
    averaged = wiring.out is not None and wiring.out[0].size(1) == D // H or bool(
        torch.allclose(y, torch.full_like(y, 1.3), atol=1e-4))
    return [explain(c, AVERAGED if averaged else cause) for c in two_heads(y, "")]


def read_as(module: nn.Module, forward: Rows, x: torch.Tensor, width: int, n_head: int) -> Wiring | str:
    """The module's wiring in the layout its own output agrees with (the first when none does)."""
    found = find_wiring(module, width, n_head)
    candidates = layouts(found)
    with torch.no_grad():
        for wiring in candidates[1:]:
            diagnosis = diagnose_heads(forward(x), x, wiring.read(), wiring.n_head)
            if diagnosis is not None and diagnosis[1:] == ("none", "none"):
                return wiring
    return found


def checked_part(cls: type, label: str, width: int, namespace: dict[str, Any], instance: nn.Module | None,
                 calls: dict[nn.Module, Call]) -> tuple[nn.Module, int, Rows, Call | None]:
    """The part to check, its width, its rows function and the model's call of it: the instance inside the
    model, called as the model calls it, when the class's forward needs more than rows; else a fresh one."""
    recorded = calls.get(instance) if instance is not None else None
    if instance is not None and recorded is not None and recorded[0] and needs_arguments(cls):
        D = input_width(instance, width)
        return instance.eval(), D, rows_of(instance, label, D, recorded), recorded
    module, D = part_at(cls, label, width, 2, namespace, instance)
    return module, D, rows_of(module, label, D), None


def heads_checks(cls: type, label: str, namespace: dict[str, Any], instance: nn.Module | None = None,
                 calls: dict[nn.Module, Call] | None = None) -> list[Check]:
    """§3.2, §4, §4.1, §4.2 and §6.1 for a multi-head module class (or its instance in the model)."""
    module, D, forward, recorded = checked_part(cls, label, 8, namespace, instance, calls or {})
    x, changed = _rows(D, seed=40)
    wiring = read_as(module, forward, x, D, 2)
    mha_layout = isinstance(wiring, Wiring) and not wiring.batch_first
    results = [explain(head_parameters(module, D, 2), _parameter_cause(module, D, 2)),
               explain(batch_items_apart(forward, x, changed, label), MHA_LAYOUT if mha_layout else BATCH,
                       NAN)]
    inside = rotary(module, recorded)
    if inside:
        why = (f"{label} adds positions inside attention (rotary embeddings), which §4.1 and §4.2's "
               "formulas leave out: its output is checked in the model (§7)")
        results += [skipped("§4.2", "module equals its projections written out per head", why),
                    skipped("§4.1", "output at position 2", why)]
    else:
        with torch.no_grad():
            results.append(written_out(forward, wiring, x))
        results += (_two_heads_checks(cls, label, namespace, results[-1].cause or UNKNOWN) if recorded is None
                    else [skipped("§4.1", "output at position 2", f"{label}'s forward takes more than rows: "
                                  "§4.1 needs a fresh module of D=4 called on its own")])
    results.append(equivariance(forward, x, masked(module, forward, x, D), label))
    return results


# ---------------------------------------------------------------------------------------------
# The block


def _norms(block: nn.Module) -> list[nn.Module]:
    """One instance of each normalisation class in the block (nn.LayerNorm, nn.RMSNorm, or *Norm*)."""
    found: dict[type, nn.Module] = {}
    for m in block.modules():
        if m is not block and "norm" in type(m).__name__.lower():
            found.setdefault(type(m), m)
    return list(found.values())


def _rms_checks(norm: nn.Module, label: str, width: int) -> list[Check]:
    """§9.3's RMSNorm: each token's features get root-mean-square 1, and no other token is read."""
    x = torch.randn(2, 5, width) + torch.arange(float(width))  # (B, T, D)
    y = run(label, norm, x)
    changed = x.clone()
    changed[0, 3] += 5
    return [close("§5", f"RMSNorm ({label}): per-token mean square over features", y.pow(2).mean(-1),
                  torch.ones(2, 5), 1e-3, "1 for every token"),
            close("§5", f"RMSNorm ({label}): other tokens do not affect a token",
                  run(label, norm, changed)[0, :3], y[0, :3], 0.0, "untouched tokens after changing another")]


def arrangement(forward: Rows, x: torch.Tensor) -> Check:
    """§5.1, from behaviour: pre-norm x + g(LN(x)) returns huge inputs almost unchanged (LN(s x) = LN(x)
    bounds each update); post-norm LN(x + g(x)) returns normalised rows whatever the input's size."""
    big = 1e3 * x
    out = forward(big)
    moved = float((out - big).norm() / big.norm())
    spread = float((out.pow(2).mean(-1) - 1).abs().max())  # how far the rows are from normalised
    normalised = spread < 0.05
    kind = "pre-norm" if moved < 0.01 else "post-norm" if normalised else "neither"
    measured = moved / 0.01 if kind == "pre-norm" else spread / 0.05  # below 1 for either arrangement
    kept = float(out.norm() / big.norm())  # near 0: bounded rows that no longer carry the input
    causes = {"nan": NAN,
              "no residual": f"the block's output does not carry its input (|block(s x)| / |s x| = "
                             f"{kept:.1e} at s = 1000): a sublayer has no residual connection, "
                             "x = attn(ln1(x)) replaces the stream: add it, x = x + attn(ln1(x)); "
                             "x = x + mlp(ln2(x))",
              "no norm": "the block has no norm on the residual path as §5 draws it: pre-norm x = x + "
                         "attn(ln1(x)); x = x + mlp(ln2(x)), or post-norm x = ln1(x + attn(x)); ..."}
    why = "nan" if bool(out.isnan().any()) else "no residual" if kept < 0.01 else "no norm"
    return at_most("§5", "pre-norm or post-norm arrangement", measured, 1.0,
                   "pre-norm x + g(LN(x)) or post-norm LN(x + g(x))",
                   f"{kind} (|block(s x) - s x| / |s x| = {moved:.1e} at s = 1000)",
                   cause="" if kind != "neither" else causes[why])


def block_checks(cls: type, label: str, namespace: dict[str, Any], instance: nn.Module | None = None,
                 calls: dict[nn.Module, Call] | None = None) -> list[Check]:
    """§3.2, §5 and §6.1 for a block class (or its instance in the model)."""
    block, D, forward, _ = checked_part(cls, label, 16, namespace, instance, calls or {})
    x, changed = _rows(D, seed=50)
    results = [explain(batch_items_apart(forward, x, changed, label), BATCH, NAN)]
    for norm in _norms(block):
        norm_label = type(norm).__name__
        if isinstance(norm, nn.RMSNorm) or "rms" in norm_label.lower():
            results += _rms_checks(norm, norm_label, D)
        else:
            results += [explain(c, NORM) for c in layer_norm(functools.partial(run, norm_label, norm), D)]
    with torch.no_grad():
        results.append(arrangement(forward, x))
    results.append(equivariance(forward, x, masked(block, forward, x, D), label))
    return results

