"""The handout's worked numbers (§2.1, §3.1, §3.2, §4, §4.1, §5) as checks of any attention or module.

`gptlab lab` runs them on gptlab's own parts (lab.py) and `gptlab check` on a learner's
(gptlab.handout.learner), so both hold an implementation to the same numbers. An attention function here
is `attend(q, k, v) -> y` on rank-3 tensors (B, T, d). Its weights are read off its output for one-hot
values (V = I gives y = a), and its scores off those weights, so no check needs to reach inside the
function.

Shape legend: B batch, Tq queries, Tk keys, d query/key width, dv value width, D model width, H heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gptlab.handout.properties import (
    Check,
    Evidence,
    at_most,
    close,
    differs,
    exceeds,
    identical,
    max_diff,
    rows_sum_to_one,
)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> y (B, Tq, dv)
Scores = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k) -> scaled scores s (B, Tq, Tk)


def weights_of(attend: Attend, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The weights a (..., Tq, Tk) that `attend` applies: its output for one-hot values V = I."""
    n_keys = keys.size(-2)
    eye = torch.eye(n_keys, dtype=keys.dtype).expand(*keys.shape[:-1], n_keys).clone()  # (..., Tk, Tk)
    return attend(queries, keys, eye)


def scores_of(attend: Attend) -> Scores:
    """Scores read off the weights: beside a zero key (score 0), key j's score is log(a_j / a_0)."""

    def scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros_like(keys[..., :1, :])  # (..., 1, d)
        weights = weights_of(attend, queries, torch.cat([zero, keys], dim=-2))  # (..., Tq, 1 + Tk)
        return weights[..., 1:].log() - weights[..., :1].log()

    return scores


# ---------------------------------------------------------------------------------------------
# §2.1 and §3.1: one query, and why the scores are divided by sqrt(d_k)


def retrieval_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§2.1's query q = [1, 0] (1, Tq=1, 2), keys (1, Tk=3, 2) and values (1, 3, dv=2)."""
    query = torch.tensor([[[1.0, 0.0]]])
    keys = torch.tensor([[[math.sqrt(2) * math.log(2), 0.0], [0.0, 1.0], [0.0, -1.0]]])
    values = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [4.0, 4.0]]])
    return query, keys, values


def retrieval(attend: Attend) -> list[Check]:
    """§2.1: weights [1/2, 1/4, 1/4] retrieve y = [2, 1.5], a convex combination of the values."""
    s = "§2.1"
    query, keys, values = retrieval_inputs()
    y = attend(query, keys, values)[0]  # (Tq=1, dv=2)
    weights = weights_of(attend, query, keys)[0]  # (Tq=1, Tk=3)
    nearest = (values[0] - y).norm(dim=-1).min().item()
    return [
        close(s, "weights a", weights[0], [0.5, 0.25, 0.25], 1e-6, "[1/2, 1/4, 1/4]"),
        close(s, "retrieval output y", y[0], [2, 1.5], 1e-6, "[2, 1.5]"),
        at_most(s, "weights are nonnegative", -weights.min().item(), 0.0, "min a >= 0",
                f"{weights.min().item():.6f}"),
        close(s, "weights sum to one", weights.sum(-1), [1.0], 1e-6),
        close(s, "y is the weighted sum of the values", y, weights @ values[0], 1e-6, "a @ V"),
        exceeds(s, "y equals no single value", nearest, 0.1, "distance to the nearest value"),
    ]


def saturation_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """§3.1's unit query at d_k = 64 (1, 1, 64) and two keys (1, 2, 64) with raw scores q.k = [0, 8]."""
    query = torch.full((1, 1, 64), 1 / 8)
    keys = torch.stack([torch.tensor([1.0, -1.0]).repeat(32), torch.ones(64)]).unsqueeze(0)
    return query, keys


def saturation(attend: Attend) -> Check:
    """§3.1: scaled by sqrt(64) = 8 the scores are [0, 1], so the weights are not saturated."""
    query, keys = saturation_inputs()
    weights = weights_of(attend, query, keys)[0, 0]  # (Tk=2,)
    return close("§3.1", "weights at d_k=64", weights, [0.268941, 0.731059], 1e-6)


def score_variance(scores: Scores, sigma: float, samples: int) -> list[Check]:
    """§3.1: for iid N(0, sigma^2) coordinates, q.k has variance d_k sigma^4 and scaled scores sigma^4."""
    generator = torch.Generator().manual_seed(311)
    results = []
    for d_k in (4, 64, 1024):
        q = sigma * torch.randn(samples, 1, d_k, generator=generator)  # (N, Tq=1, d_k)
        k = sigma * torch.randn(samples, 1, d_k, generator=generator)  # (N, Tk=1, d_k)
        for label, value, target in (
            ("scaled scores", scores(q, k).var().item(), sigma**4),
            ("raw q.k", (q * k).sum(-1).var().item(), d_k * sigma**4),
        ):
            error = value / target - 1
            results.append(at_most("§3.1", f"variance of {label}, d_k={d_k}", abs(error), 0.1,
                                   f"{target:.4f} (relative error <= 10%)", f"{value:.4f} ({error:+.1%})"))
    return results


# ---------------------------------------------------------------------------------------------
# §3.2: every row a distribution, every batch item on its own


def rows_and_columns(weights: torch.Tensor, tag: str) -> list[Check]:
    """§3.2 on weights (..., Tq, Tk): every row sums to one over the keys; the columns need not."""
    columns = (weights.sum(-2) - 1).abs().max().item()
    return [rows_sum_to_one([weights], 1e-6, f"rows sum to one ({tag})"),
            exceeds("§3.2", f"columns do not ({tag})", columns, 0.1, "max |column sum - 1|")]


def batch_items_apart(outputs: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, changed: torch.Tensor,
                      tag: str) -> Check:
    """§3.2: item 0's output is bit-identical whatever item 1 holds (`changed` is x with item 1 redrawn)."""
    return identical("§3.2", f"batch items do not mix ({tag})", outputs(changed)[0], outputs(x)[0],
                     "item 0's output after changing item 1")


# ---------------------------------------------------------------------------------------------
# §4 and §4.1: heads


def head_parameters(module: nn.Module, n_embd: int, n_head: int) -> Check:
    """§4: W_Q, W_K, W_V and W_O hold 3D^2 + D^2 weights for any H; biases (vectors) are counted apart."""
    D = n_embd
    weights = sum(p.numel() for p in module.parameters() if p.dim() >= 2)
    biases = sum(p.numel() for p in module.parameters() if p.dim() < 2)
    counted = torch.tensor([weights, biases % D, max(0, biases - 4 * D)])  # each is 0 but the first
    expected = torch.tensor([4 * D * D, 0, 0])
    return Check("§4", f"attention parameters, D={D}, H={n_head}", torch.equal(counted, expected),
                 f"3D^2 + D^2 = {3 * D * D} + {D * D} = {4 * D * D} weights, and 0 to 4D = {4 * D} biases",
                 f"{weights} weights + {biases} biases", evidence=Evidence("equal", (counted, expected)))


TWO_HEADS = (4, 2)  # §4.1's D and H (hs = 2)


def two_head_input() -> torch.Tensor:
    """§4.1's input rows (B=1, T=3, D=4): one-hot e_0, e_1, e_2, so row j of x W^T is column j of W."""
    return torch.eye(4)[:3].unsqueeze(0)


def two_head_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """§4.1's W_Q, W_K, W_V, W_O as (out, in) = (4, 4) matrices, head h on output rows 2h and 2h + 1.

    Column j of each matrix is what position j publishes, the heads side by side. Position 2 asks
    [sqrt 2, 0] in both heads (the sqrt 2 cancels the 1/sqrt(hs) scale); head 1's key at position 0
    and head 2's at position 1 are [log 8, 0], so the scaled scores at position 2 are [log 8, 0, 0]
    and [0, log 8, 0], the weights [0.8, 0.1, 0.1] and [0.1, 0.8, 0.1]. Both heads publish §2.1's
    values, and W_O = I_4 keeps the four features apart.
    """
    w_q, w_k, w_v = torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4, 4)
    w_q[:, 2] = torch.tensor([math.sqrt(2), 0.0, math.sqrt(2), 0.0])
    w_k[0, 0] = w_k[2, 1] = math.log(8)
    for j, v in enumerate(([2.0, 0.0], [0.0, 2.0], [4.0, 4.0])):
        w_v[:, j] = torch.tensor(v + v)
    return w_q, w_k, w_v, torch.eye(4)


def two_heads(y: torch.Tensor, label: str) -> list[Check]:
    """§4.1 on the output row at position 2 (D=4,): the heads' answers side by side, [2, 0.6 | 0.6, 2]."""
    s = "§4.1"
    output = close(s, f"output at position 2{label}", y, [2, 0.6, 0.6, 2], 1e-6, "[2, 0.6 | 0.6, 2]")
    if y.shape != (4,):
        return [output]
    average = y.view(2, 2).mean(0)  # what averaging the heads' answers would give
    return [output, close(s, "averaging the heads instead", average, [1.3, 1.3], 1e-6),
            differs(s, "concatenation is not averaging", y, average.repeat(2), 0.1)]


# ---------------------------------------------------------------------------------------------
# §5: LayerNorm works within a token


def _variance(y: torch.Tensor, width: int) -> Check:
    """Each token's variance over its features is 1, or (D - 1) / D when the norm divided by the unbiased
    variance: the handout says "across features" and fixes no estimator, so both pass (the second noted)."""
    variance = y.var(-1, correction=0)  # (B, T)
    unbiased = torch.full_like(variance, (width - 1) / width)
    if max_diff(variance, unbiased) < max_diff(variance, torch.ones_like(variance)):
        return close("§5", "LayerNorm: per-token variance over features", variance, unbiased, 1e-4,
                     f"(D - 1) / D = {(width - 1) / width:.4f} for every token",
                     note="the unbiased variance x.var(unbiased=True): fine, §5 fixes no estimator (torch's "
                     "nn.LayerNorm uses the biased one)")
    return close("§5", "LayerNorm: per-token variance over features", variance, torch.ones_like(variance),
                 1e-4, "1 for every token")


def layer_norm(norm: Callable[[torch.Tensor], torch.Tensor], width: int = 8) -> list[Check]:
    """LayerNorm gives each token mean 0 and variance 1 over its features, and reads no other token.

    Draws its input from the global generator: callers seed it.
    """
    s = "§5"
    # A per-feature offset gives every token the same feature pattern, which LayerNorm keeps, so
    # means over positions or over batch items stay visibly away from zero.
    x = torch.randn(2, 5, width) + torch.arange(float(width))  # (B, T, D)
    y = norm(x)
    changed = x.clone()
    changed[0, 3] += 5 * torch.randn(width)  # another token of item 0
    changed[1] = torch.randn(5, width)  # another batch item
    kept = [0, 1, 2, 4]  # item 0's untouched tokens
    return [
        close(s, "LayerNorm: per-token mean over features", y.mean(-1), torch.zeros(2, 5), 1e-4,
              "0 for every token"),
        _variance(y, width),
        exceeds(s, "LayerNorm: means over positions are not zero", y.mean(1).abs().max().item(), 0.1,
                "max |mean over T|"),
        exceeds(s, "LayerNorm: means over batch items are not zero", y.mean(0).abs().max().item(), 0.1,
                "max |mean over B|"),
        identical(s, "LayerNorm: other tokens do not affect a token", norm(changed)[0, kept], y[0, kept],
                  "untouched tokens after changing others"),
    ]
