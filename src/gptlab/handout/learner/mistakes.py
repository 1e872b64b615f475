"""The classic attention mistakes, each as a reference computation and as the cause `gptlab check` reports.

Diagnosis is by behaviour: the learner's code and these float64 references run on the same inputs,
and the first mistake whose reference matches the learner's output names the cause. `SLIPS` are
mistakes of the unmasked computation, `HEAD_SLIPS` those only a multi-head module can make (they need
the model width or the heads' layout), `MASK_SLIPS` those of the causal mask (§7.3); "none" is the
handout. Where the learner's weights cannot be replayed, `diagnose_reads` names a mask slip from
which rows each output row reads, as each slip's reference reads them.

Shape legend: B batch, H heads, Tq queries, Tk keys, d query/key width, dv value width, D model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

SLIPS: dict[str, str] = {  # a mistake of the unmasked computation -> its cause and fix
    "none": "",
    "no scale": "the scores are not divided by sqrt(d_k): write q @ k.transpose(-2, -1) / "
                "math.sqrt(q.size(-1))",
    "scale by d_k": "the scores are divided by d_k instead of sqrt(d_k): divide by math.sqrt(q.size(-1))",
    "scale by d_v": "the scores are divided by sqrt of the value width: use sqrt(d_k), the query/key width",
    "scale by D": "the scores are divided by sqrt(D), the model width: divide by sqrt(d_h) = sqrt(D / H), "
                  "the width of one head",
    "softmax over queries": "softmax over the query axis: normalise over the keys with softmax(dim=-1), so "
                            "that each row (one query) sums to one",
}
HEAD_SLIPS: dict[str, str] = {  # a mistake only a multi-head module makes -> its cause and fix
    "divide by D": "the scores are divided by D, the model width, with no square root: divide by "
                   "sqrt(d_h) = sqrt(D / H), the square root of one head's width",
    "split without transpose": "the heads are split with view(B, H, T, hs) straight from (B, T, D), so a "
                               "head's rows mix features of different positions: split with "
                               "view(B, T, H, hs).transpose(1, 2)",
    "merge without transpose": "the heads are merged back with view(B, T, D) straight from (B, H, T, hs), "
                               "without transpose(1, 2) first, so an output row is built from other "
                               "positions' head outputs: y.transpose(1, 2).reshape(B, T, D)",
}
MASK_SLIPS: dict[str, str] = {  # a mistake of the causal mask -> its cause and fix
    "none": "",
    "ignored": "no causal mask is applied: hide every key j > i by filling its score with float('-inf') "
               "before the softmax",
    "after softmax": "the mask is applied after the softmax, so hidden keys still share each row's "
                     "denominator: fill the scores with -inf before the softmax",
    "filled with 0": "hidden scores are filled with 0 instead of -inf, and exp(0) = 1 keeps them: "
                     "masked_fill(~mask, float('-inf'))",
    "hides the diagonal": "the mask hides the diagonal too (tril(ones, diagonal=-1), or triu(ones, "
                          "diagonal=0) as the hidden part), so a query cannot see its own key and row 0 sees "
                          "none: NaN with -inf, an even average over every key, the future included, with "
                          "-1e9: hide only j > i, triu(ones, diagonal=1)",
    "off by one": "the mask is off by one: query i also sees key i + 1, the very token it is to predict: "
                  "hide every j > i, triu(ones, diagonal=1), not diagonal=2",
    "inverted": "the mask is inverted (tril and triu swapped): query i sees itself and every later key and "
                "none of the past: keep j <= i, tril(ones), and hide j > i",
}
RANK = ("the key transpose works at one rank only: `.T` reverses every axis and transpose(1, 2) or permute "
        "name fixed axes; use k.transpose(-2, -1), which swaps the last two at any rank")
EINSUM = ("the einsum subscripts name a fixed number of axes: write '...id,...jd->...ij' and "
          "'...ij,...je->...ie' so that batches and head tensors both work")
AVERAGED = ("the heads are averaged, which merges their routing decisions: concatenate their outputs "
            "(y.transpose(1, 2).reshape(B, T, D), or torch.cat(heads, dim=-1)) and keep W_O D x D")
UNKNOWN = ("the output differs from softmax(q k^T / sqrt(d_k)) v in a way none of the classic mistakes "
           "explains")
NAN = ("the output has NaN rows: a softmax row whose every score is -inf gives 0 / 0, a query that sees no "
       "key at all, e.g. when the mask hides the diagonal too (tril(ones, diagonal=-1)) and row 0 is left "
       "with nothing; a NaN can also come from a log or sqrt of a negative or a division by zero")


def slipped_keep(keep: torch.Tensor, mask_slip: str) -> torch.Tensor:
    """The keys a mask slip keeps where the causal `keep` (T, T) should: j < i, j <= i + 1, or j >= i."""
    ones = torch.ones_like(keep, dtype=torch.bool)
    slipped = {"hides the diagonal": ones.tril(-1), "off by one": ones.tril(1), "inverted": ones.triu()}
    return slipped.get(mask_slip, keep)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None,
              slip: str = "none", mask_slip: str = "none", model_width: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k)) v in float64, keys hidden where `keep` (Tq, Tk) is False, with mistakes.

    q (..., Tq, d), k (..., Tk, d), v (..., Tk, dv) -> (..., Tq, dv), NaN where a query sees no key;
    `model_width` is D for the slips by D (a slip of the heads' layout changes nothing here).
    """
    q, k, v = q.double(), k.double(), v.double()
    divisor = {"no scale": 1.0, "scale by d_k": q.size(-1), "scale by d_v": math.sqrt(v.size(-1)),
               "scale by D": math.sqrt(model_width or q.size(-1)),
               "divide by D": float(model_width or q.size(-1))}.get(slip, math.sqrt(q.size(-1)))
    scores = q @ k.transpose(-2, -1) / divisor  # (..., Tq, Tk)
    hidden = None if keep is None or mask_slip == "ignored" else ~slipped_keep(keep, mask_slip)
    if hidden is not None and mask_slip != "after softmax":
        scores = scores.masked_fill(hidden, 0.0 if mask_slip == "filled with 0" else float("-inf"))
    weights = scores.softmax(dim=-2 if slip == "softmax over queries" else -1)
    if hidden is not None and mask_slip == "after softmax":
        weights = weights.masked_fill(hidden, 0.0)
    return weights @ v


def agrees(measured: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> bool:
    """Same shape, and within tol times the expected values' size (at least 1) wherever the reference is
    defined: its NaN entries (a query that sees no key) may hold anything, every other one must be finite."""
    defined = ~expected.isnan()
    if measured.shape != expected.shape or not bool(defined.any()):
        return False
    got, want = measured.double()[defined], expected.double()[defined]
    if not bool(got.isfinite().all()):
        return False
    return float((got - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))


def first_match(measured: torch.Tensor,
                candidates: Iterable[tuple[str, Callable[[], torch.Tensor]]]) -> str | None:
    """The name of the first candidate whose reference agrees with `measured`, or None."""
    return next((name for name, compute in candidates if agrees(measured, compute())), None)


def split_heads(x: torch.Tensor, n_head: int, slip: str = "none") -> torch.Tensor:
    """(B, T, H * hs) -> (B, H, T, hs): head h takes features h * hs .. (h + 1) * hs - 1; with the slip
    "split without transpose" the memory of x is read as (B, H, T, hs), as x.view(B, H, T, hs) does."""
    B, T, width = x.shape
    if slip == "split without transpose":
        return x.reshape(B, n_head, T, width // n_head)
    return x.view(B, T, n_head, width // n_head).transpose(1, 2)


def heads_reference(x: torch.Tensor, weights: dict[str, torch.Tensor | None], n_head: int, causal: bool,
                    slip: str = "none", mask_slip: str = "none") -> torch.Tensor:
    """§4: H heads of width D / H from W_Q, W_K, W_V (D, D), concatenated (or averaged), then W_O.

    `weights` maps "q", "k", "v", "o" to (out, in) matrices and "bq" ... "bo" to biases or None; a
    W_O whose input width is D / H receives the heads' average, as an averaging module feeds it.
    `slip` is one of SLIPS or HEAD_SLIPS. x (B, T, D) -> (B, T, D).
    """
    x = x.double()
    q, k, v = (split_heads(F.linear(x, _matrix(weights, n), _d(weights["b" + n])), n_head, slip)
               for n in "qkv")
    T = x.size(1)
    keep = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    y = reference(q, k, v, keep, slip, mask_slip, model_width=x.size(-1))  # (B, H, T, hs)
    w_o = weights["o"]
    if w_o is not None and w_o.size(1) == y.size(-1) != x.size(-1):
        merged = y.mean(dim=1)  # (B, T, hs): the heads averaged
    elif slip == "merge without transpose":
        merged = y.reshape(x.shape)  # (B, T, D): the (B, H, T, hs) memory read as rows
    else:
        merged = y.transpose(1, 2).reshape(x.shape)  # (B, T, D): the heads side by side
    return merged if w_o is None else F.linear(merged, _matrix(weights, "o"), _d(weights["bo"]))


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    """A float64 copy of a parameter, detached from the learner's graph."""
    return None if t is None else t.detach().double()


def _matrix(weights: dict[str, torch.Tensor | None], name: str) -> torch.Tensor:
    """`_d` of a matrix the wiring always has (W_Q, W_K, W_V; W_O where the caller checked)."""
    matrix = weights[name]
    assert matrix is not None, f"the wiring has no W_{name.upper()}"
    return matrix.detach().double()


def diagnose_heads(measured: torch.Tensor, x: torch.Tensor, weights: dict[str, torch.Tensor | None],
                   n_head: int) -> tuple[bool, str, str] | None:
    """(causal, slip, mask_slip) of the first reference matching a module's output on x (B, T, D), or None.

    The handout's own computation comes first, unmasked then causal, so a correct module is never
    taken for a mistaken one.
    """
    variants = [(causal, slip, "none") for slip in (*SLIPS, *HEAD_SLIPS) for causal in (False, True)]
    masks = [mask for mask in MASK_SLIPS if mask not in ("none", "ignored")]
    variants += [(True, slip, mask) for slip in SLIPS for mask in masks]
    return next((v for v in variants if agrees(measured, heads_reference(x, weights, n_head, *v))), None)


def heads_cause(found: tuple[bool, str, str] | None) -> str:
    """The cause for a multi-head module's diagnosis; UNKNOWN when nothing matched."""
    if found is None:
        return UNKNOWN
    causal, slip, mask_slip = found
    return {**SLIPS, **HEAD_SLIPS}[slip] or MASK_SLIPS[mask_slip] or ("" if causal else MASK_SLIPS["ignored"])


def reads(mask_slip: str, T: int) -> torch.Tensor:
    """(T, T): 1 where row i of the mask slip's causal reference moves when input row j (q = k = v) is
    redrawn, 0 where it does not, NaN on a row it leaves undefined (a query that sees no key)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, 2, dtype=torch.float64, generator=generator)
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    clean = reference(x, x, x, keep, mask_slip=mask_slip)  # (T, 2)
    moved = []
    for j in range(T):
        changed = x.clone()
        changed[j] = torch.randn(2, dtype=torch.float64, generator=generator)
        moved.append((reference(changed, changed, changed, keep, mask_slip=mask_slip) - clean).abs().amax(-1))
    change = torch.stack(moved, dim=1)  # (T, T): [i, j]
    return change.gt(0).double().masked_fill(change.isnan(), float("nan"))


def diagnose_reads(measured: torch.Tensor) -> str | None:
    """The one mask slip whose reference reads, off the diagonal, the rows `measured` (T, T) bool says row i
    reads; None when no slip or several do (no mask, after the softmax and 0-filled all read every row)."""
    T = measured.size(0)
    off = ~torch.eye(T, dtype=torch.bool)
    found = []
    for name in MASK_SLIPS:
        expected = reads(name, T)
        compared = off & ~expected.isnan()
        if torch.equal(measured.bool()[compared], expected[compared].bool()):
            found.append(name)
    return found[0] if len(found) == 1 else None
