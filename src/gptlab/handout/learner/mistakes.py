"""The classic attention mistakes, each as a reference computation and as the cause `gptlab check` reports.

Diagnosis is by behaviour: the learner's code and these float64 references run on the same inputs,
and the first mistake whose reference matches the learner's output names the cause. `SLIPS` are
mistakes of the unmasked computation, `MASK_SLIPS` of the causal mask (§7.3); "none" is the handout.

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
MASK_SLIPS: dict[str, str] = {  # a mistake of the causal mask -> its cause and fix
    "none": "",
    "ignored": "no causal mask is applied: hide every key j > i by filling its score with float('-inf') "
               "before the softmax",
    "after softmax": "the mask is applied after the softmax, so hidden keys still share each row's "
                     "denominator: fill the scores with -inf before the softmax",
    "filled with 0": "hidden scores are filled with 0 instead of -inf, and exp(0) = 1 keeps them: "
                     "masked_fill(~mask, float('-inf'))",
}
RANK = ("the key transpose works at one rank only: `.T` reverses every axis and transpose(1, 2) or permute "
        "name fixed axes; use k.transpose(-2, -1), which swaps the last two at any rank")
EINSUM = ("the einsum subscripts name a fixed number of axes: write '...id,...jd->...ij' and "
          "'...ij,...je->...ie' so that batches and head tensors both work")
AVERAGED = ("the heads are averaged, which merges their routing decisions: concatenate their outputs "
            "(y.transpose(1, 2).reshape(B, T, D), or torch.cat(heads, dim=-1)) and keep W_O D x D")
UNKNOWN = ("the output differs from softmax(q k^T / sqrt(d_k)) v in a way none of the classic mistakes "
           "explains")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None,
              slip: str = "none", mask_slip: str = "none", model_width: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k)) v in float64, keys hidden where `keep` (Tq, Tk) is False, with mistakes.

    q (..., Tq, d), k (..., Tk, d), v (..., Tk, dv) -> (..., Tq, dv); `model_width` is D for "scale by D".
    """
    q, k, v = q.double(), k.double(), v.double()
    divisor = {"no scale": 1.0, "scale by d_k": q.size(-1), "scale by d_v": math.sqrt(v.size(-1)),
               "scale by D": math.sqrt(model_width or q.size(-1))}.get(slip, math.sqrt(q.size(-1)))
    scores = q @ k.transpose(-2, -1) / divisor  # (..., Tq, Tk)
    hidden = None if keep is None or mask_slip == "ignored" else ~keep
    if hidden is not None and mask_slip != "after softmax":
        scores = scores.masked_fill(hidden, 0.0 if mask_slip == "filled with 0" else float("-inf"))
    weights = scores.softmax(dim=-2 if slip == "softmax over queries" else -1)
    if hidden is not None and mask_slip == "after softmax":
        weights = weights.masked_fill(hidden, 0.0)
    return weights @ v


def agrees(measured: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> bool:
    """Same shape, finite, and within tol times the expected values' size (at least 1)."""
    if measured.shape != expected.shape or not bool(torch.isfinite(measured).all()) or not measured.numel():
        return False
    return float((measured.double() - expected).abs().max()) <= tol * max(1.0, float(expected.abs().max()))


def first_match(measured: torch.Tensor,
                candidates: Iterable[tuple[str, Callable[[], torch.Tensor]]]) -> str | None:
    """The name of the first candidate whose reference agrees with `measured`, or None."""
    return next((name for name, compute in candidates if agrees(measured, compute())), None)


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, H * hs) -> (B, H, T, hs): head h takes features h * hs .. (h + 1) * hs - 1."""
    B, T, width = x.shape
    return x.view(B, T, n_head, width // n_head).transpose(1, 2)


def heads_reference(x: torch.Tensor, weights: dict[str, torch.Tensor | None], n_head: int, causal: bool,
                    slip: str = "none", mask_slip: str = "none") -> torch.Tensor:
    """§4: H heads of width D / H from W_Q, W_K, W_V (D, D), concatenated (or averaged), then W_O.

    `weights` maps "q", "k", "v", "o" to (out, in) matrices and "bq" ... "bo" to biases or None; a
    W_O whose input width is D / H receives the heads' average, as an averaging module feeds it.
    x (B, T, D) -> (B, T, D).
    """
    x = x.double()
    q, k, v = (split_heads(F.linear(x, _matrix(weights, n), _d(weights["b" + n])), n_head) for n in "qkv")
    T = x.size(1)
    keep = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    y = reference(q, k, v, keep, slip, mask_slip, model_width=x.size(-1))  # (B, H, T, hs)
    w_o = weights["o"]
    if w_o is not None and w_o.size(1) == y.size(-1) != x.size(-1):
        merged = y.mean(dim=1)  # (B, T, hs): the heads averaged
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
    variants = [(causal, slip, "none") for slip in SLIPS for causal in (False, True)]
    variants += [(True, slip, mask) for slip in SLIPS for mask in ("after softmax", "filled with 0")]
    return next((v for v in variants if agrees(measured, heads_reference(x, weights, n_head, *v))), None)


def heads_cause(found: tuple[bool, str, str] | None) -> str:
    """The cause for a multi-head module's diagnosis; UNKNOWN when nothing matched."""
    if found is None:
        return UNKNOWN
    causal, slip, mask_slip = found
    return SLIPS[slip] or MASK_SLIPS[mask_slip] or ("" if causal else MASK_SLIPS["ignored"])
