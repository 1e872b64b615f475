"""Reading and setting a learner's W_Q, W_K, W_V and W_O, however the multi-head module stores them.

Four layouts are recognised (§4, §4.2, §9.1, §9.3): one fused nn.Linear(D, 3D) holding [W_Q; W_K; W_V]
(nanoGPT's c_attn) or, per head interleaved, [q_1; k_1; v_1; q_2; ...] (`layouts` offers both); a
ModuleList of heads, each with its own query, key and value nn.Linear(D, D/H); three separate
nn.Linear(D, D) named after q, k and v; and torch.nn.MultiheadAttention. W_O is the one remaining
nn.Linear into D (absent means the identity). Each matrix is seen as (D, D) in nn.Linear's (out, in)
layout, head h on output rows h * hs .. (h + 1) * hs - 1, whichever pieces hold it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

Piece = tuple[torch.Tensor, torch.Tensor | None, slice]  # (weight, bias, its rows that belong)
ROLE_WORDS = {"q": ("q", "qs", "query", "queries"), "k": ("k", "ks", "key", "keys"),
              "v": ("v", "vs", "value", "values")}
AFFIXES = re.compile(r"^(w_?|to_|proj_|linear_)|(_?proj(ection)?|_?linear|_?layer|_?net)$")
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "nhead", "nheads", "h", "heads", "head_count")


@dataclass
class Wiring:
    """Where a multi-head module keeps each projection: `pieces` for q, k, v; W_O (weight, bias) or None."""

    layout: str  # in words, for the report
    n_head: int
    pieces: dict[str, list[Piece]]
    out: tuple[torch.Tensor, torch.Tensor | None] | None
    batch_first: bool = True  # False for an nn.MultiheadAttention fed (T, B, D)

    def read(self) -> dict[str, torch.Tensor | None]:
        """"q", "k", "v", "o" -> (out, in) matrices and "bq" ... "bo" -> biases or None."""
        found: dict[str, torch.Tensor | None] = {}
        for name, pieces in self.pieces.items():
            found[name] = torch.cat([w[rows] for w, _, rows in pieces])  # (D, D)
            biases = [b[rows] if b is not None else torch.zeros(w[rows].size(0)) for w, b, rows in pieces]
            found["b" + name] = None if all(b is None for _, b, _ in pieces) else torch.cat(biases)
        found["o"], found["bo"] = self.out if self.out is not None else (None, None)
        return found

    def write(self, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, w_o: torch.Tensor) -> None:
        """Set W_Q, W_K, W_V (D, D) and W_O (D, D), every bias to zero.

        A W_O that takes only D/H features (heads averaged) gets W_O's identity tiled, so each output
        feature still reads one feature of the merged heads.
        """
        with torch.no_grad():
            for name, matrix in zip("qkv", (w_q, w_k, w_v), strict=True):
                start = 0
                for weight, bias, rows in self.pieces[name]:
                    n = weight[rows].size(0)
                    weight[rows] = matrix[start:start + n]
                    if bias is not None:
                        bias[rows] = 0.0
                    start += n
            if self.out is not None:
                weight, bias = self.out
                weight.copy_(w_o[:, :weight.size(1)] if weight.size(1) == w_o.size(1) else
                             torch.eye(weight.size(1)).repeat(weight.size(0) // weight.size(1), 1))
                if bias is not None:
                    bias.zero_()


def _role(name: str) -> str | None:
    """q, k or v for a Linear called e.g. `query`, `W_k`, `v_proj` or `to_q`; None otherwise."""
    word = AFFIXES.sub("", name.rsplit(".", 1)[-1].lower())
    return next((r for r, words in ROLE_WORDS.items() if word in words), None)


def _head_count(module: nn.Module, default: int) -> int:
    """The module's own head count attribute, else `default` (the count it was built with)."""
    for name in HEAD_COUNTS:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def find_wiring(module: nn.Module, width: int, n_head: int) -> Wiring | str:
    """The wiring of a multi-head module of width D, or why none of the known layouts fits."""
    mha = next((m for m in module.modules() if isinstance(m, nn.MultiheadAttention)), None)
    if mha is not None:
        if not mha._qkv_same_embed_dim:
            return "its nn.MultiheadAttention has separate key/value widths (kdim, vdim)"
        D = mha.embed_dim
        pieces: dict[str, list[Piece]] = {
            name: [(mha.in_proj_weight, mha.in_proj_bias, slice(i * D, (i + 1) * D))]
            for i, name in enumerate("qkv")}
        return Wiring("torch.nn.MultiheadAttention", mha.num_heads, pieces,
                      (mha.out_proj.weight, mha.out_proj.bias), mha.batch_first)
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    into = [(name, m) for name, m in linears if m.in_features == width]
    fused = [(name, m) for name, m in into if m.out_features == 3 * width]
    if len(fused) == 1:
        weight, bias = fused[0][1].weight, fused[0][1].bias
        pieces = {name: [(weight, bias, slice(i * width, (i + 1) * width))] for i, name in enumerate("qkv")}
        used, layout = {fused[0][0]}, f"one fused projection {fused[0][0]} (D -> 3D)"
    else:
        roles = {r: [(name, m) for name, m in into if _role(name) == r] for r in "qkv"}
        if not all(roles.values()) or len({len(found) for found in roles.values()}) != 1:
            return ("it has neither one fused nn.Linear(D, 3D) nor query, key and value nn.Linears "
                    "(named q/k/v, query/key/value, W_q/W_k/W_v or q_proj/k_proj/v_proj)")
        count = len(roles["q"])
        if sum(m.out_features for _, m in roles["q"]) != width:
            width_q = sum(m.out_features for _, m in roles["q"])
            return f"its query projections give {width_q} features, not D={width}"
        pieces = {r: [(m.weight, m.bias, slice(None)) for _, m in found] for r, found in roles.items()}
        used = {name for found in roles.values() for name, _ in found}
        layout = f"{count} separately parameterised heads" if count > 1 else "separate q, k, v projections"
        n_head = count if count > 1 else n_head
    outs = [m for name, m in linears if name not in used and m.out_features == width
            and m.in_features in (width, width // n_head)]
    if len(outs) > 1:
        return f"it has {len(outs)} nn.Linears into D={width}, so I cannot tell which one is W_O"
    n_head = _head_count(module, n_head) if "separately" not in layout else n_head
    return Wiring(layout, n_head, pieces, (outs[0].weight, outs[0].bias) if outs else None)


def layouts(wiring: Wiring | str) -> list[Wiring]:
    """The ways a module's wiring may be read: as found, and for one fused D -> 3D projection also per
    head interleaved (each head's q, k, v rows side by side: a view as (B, T, H, 3, hs))."""
    if isinstance(wiring, str):
        return []
    if not wiring.layout.startswith("one fused projection"):
        return [wiring]
    (weight, bias, _), = wiring.pieces["q"]
    H = wiring.n_head
    hs = weight.size(0) // (3 * H)
    pieces = {name: [(weight, bias, slice((3 * h + i) * hs, (3 * h + i + 1) * hs)) for h in range(H)]
              for i, name in enumerate("qkv")}
    return [wiring, Wiring(wiring.layout + ", per head interleaved [q_h | k_h | v_h]", H, pieces, wiring.out,
                           wiring.batch_first)]
