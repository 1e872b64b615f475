"""Issue 39, diagnose by experiment: the new mistakes of gptlab.handout.learner.mistakes against naive loops.

Each reference (scores divided by D, the mask that hides the diagonal, is off by one or inverted, heads
split or merged without the transpose) is compared with a plain Python loop over queries and keys
written here, not with the library's code; then the diagnoses built on them (`diagnose_heads`,
`diagnose_reads`, the block arrangement, the loss and the leak of a whole model) are held to naming
each mistake, and to naming nothing when no single mistake fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptlab.handout.learner.calling import LanguageModel
from gptlab.handout.learner.lm import LEAK, SHIFT_BOTH, loss_check, model_checks
from gptlab.handout.learner.mistakes import (
    HEAD_SLIPS,
    MASK_SLIPS,
    NAN,
    agrees,
    diagnose_heads,
    diagnose_reads,
    heads_cause,
    heads_reference,
    reads,
    reference,
)
from gptlab.handout.learner.parts import arrangement

Allowed = Callable[[int, int], bool]  # (query i, key j) -> whether i may read j
ALLOWED: dict[str, Allowed] = {
    "none": lambda i, j: j <= i,
    "hides the diagonal": lambda i, j: j < i,
    "off by one": lambda i, j: j <= i + 1,
    "inverted": lambda i, j: j >= i,
}


def naive(q: list[list[float]], k: list[list[float]], v: list[list[float]], allowed: Allowed,
          divisor: float) -> list[list[float]]:
    """One (T, d) attention by loops: row i averages v over the keys it may read, NaN if it may read none."""
    out = []
    for i, qi in enumerate(q):
        keys = [j for j in range(len(k)) if allowed(i, j)]
        if not keys:
            out.append([math.nan] * len(v[0]))
            continue
        scores = {j: sum(a * b for a, b in zip(qi, k[j], strict=True)) / divisor for j in keys}
        top = max(scores.values())
        weights = {j: math.exp(s - top) for j, s in scores.items()}
        total = sum(weights.values())
        out.append([sum(weights[j] * v[j][c] for j in keys) / total for c in range(len(v[0]))])
    return out


def _close(got: torch.Tensor, want: list[list[float]]) -> None:
    """got (T, d) equals the loop's rows, NaN where the loop's row is NaN."""
    expected = torch.tensor(want, dtype=torch.float64)
    assert torch.equal(got.isnan(), expected.isnan())
    torch.testing.assert_close(got[~got.isnan()], expected[~expected.isnan()], rtol=1e-9, atol=1e-12)


def _qkv(T: int = 4, d: int = 3, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(T, d, dtype=torch.float64, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("mask_slip", ["hides the diagonal", "off by one", "inverted"])
def test_each_new_mask_slip_reads_the_keys_a_loop_gives_it(mask_slip: str) -> None:
    q, k, v = _qkv()
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    got = reference(q, k, v, keep, mask_slip=mask_slip)
    _close(got, naive(q.tolist(), k.tolist(), v.tolist(), ALLOWED[mask_slip], math.sqrt(3)))
    if mask_slip == "hides the diagonal":
        assert bool(got[0].isnan().all()) and not bool(got[1:].isnan().any())  # row 0 sees no key


def test_dividing_by_the_model_width_against_a_loop() -> None:
    q, k, v = _qkv(T=3, d=2, seed=1)
    keep = torch.ones(3, 3, dtype=torch.bool).tril()
    got = reference(q, k, v, keep, "divide by D", model_width=8)
    _close(got, naive(q.tolist(), k.tolist(), v.tolist(), ALLOWED["none"], 8.0))


def _weights(D: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(D, D, generator=generator) for n in "qkvo"}


def _loop_heads(x: torch.Tensor, weights: dict[str, torch.Tensor], H: int, layout: str) -> torch.Tensor:
    """x (T, D) -> (T, D) by loops: heads read from the projected rows' memory, merged, then W_O."""
    T, D = x.shape
    hs = D // H
    flat = {n: [c for row in (x.double() @ weights[n].double().T).tolist() for c in row] for n in "qkv"}
    heads = []
    for h in range(H):
        if layout == "split without transpose":  # head h row t is the memory after h * T + t rows of hs
            part = {n: [flat[n][(h * T + t) * hs:(h * T + t + 1) * hs] for t in range(T)] for n in "qkv"}
        else:  # head h row t is position t's features h * hs .. (h + 1) * hs - 1
            part = {n: [flat[n][t * D + h * hs:t * D + (h + 1) * hs] for t in range(T)] for n in "qkv"}
        heads.append(naive(part["q"], part["k"], part["v"], ALLOWED["none"], math.sqrt(hs)))
    if layout == "merge without transpose":  # the (H, T, hs) memory read as T rows of D
        memory = [c for head in heads for row in head for c in row]
        merged = [memory[t * D:(t + 1) * D] for t in range(T)]
    else:
        merged = [[c for h in range(H) for c in heads[h][t]] for t in range(T)]
    return torch.tensor(merged, dtype=torch.float64) @ weights["o"].double().T


@pytest.mark.parametrize("layout", ["none", "split without transpose", "merge without transpose"])
def test_the_heads_layouts_against_loops(layout: str) -> None:
    x = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(2))
    weights = _weights(4, seed=3)
    no_biases: dict[str, torch.Tensor | None] = {"b" + n: None for n in "qkvo"}
    got = heads_reference(x, {**weights, **no_biases}, 2, causal=True, slip=layout)[0]
    torch.testing.assert_close(got, _loop_heads(x[0], weights, 2, layout), rtol=1e-9, atol=1e-9)


def test_agrees_skips_only_the_rows_the_reference_leaves_undefined() -> None:
    expected = torch.tensor([[math.nan, math.nan], [1.0, 2.0]], dtype=torch.float64)
    assert agrees(torch.tensor([[0.5, 0.5], [1.0, 2.0]]), expected)  # an even average where -1e9 was used
    assert agrees(torch.tensor([[math.nan, math.nan], [1.0, 2.0]]), expected)  # NaN where -inf was used
    assert not agrees(torch.tensor([[0.5, 0.5], [1.0, math.nan]]), expected)
    assert not agrees(torch.tensor([[0.5, 0.5], [1.0, 2.1]]), expected)
    assert not agrees(torch.zeros(2, 2), torch.full((2, 2), math.nan, dtype=torch.float64))


class PlainHeads(nn.Module):
    """Causal multi-head attention written out plainly, with one mistake chosen by name."""

    def __init__(self, D: int, H: int, mistake: str) -> None:
        super().__init__()
        self.n_head, self.mistake = H, mistake
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H, hs = self.n_head, D // self.n_head
        if self.mistake == "split without transpose":
            q, k, v = (p(x).view(B, H, T, hs) for p in (self.q, self.k, self.v))
        else:
            q, k, v = (p(x).view(B, T, H, hs).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / (D if self.mistake == "divide by D" else math.sqrt(hs))
        hidden = {"off by one": 2, "inverted": None}.get(self.mistake, 1)
        mask = torch.ones(T, T).tril(-1).bool() if hidden is None else torch.ones(T, T).triu(hidden).bool()
        y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v  # (B, H, T, hs)
        if self.mistake == "merge without transpose":
            return self.o(y.reshape(B, T, D))
        return self.o(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("mistake", ["none", *HEAD_SLIPS, "off by one", "inverted"])
def test_diagnose_heads_names_the_one_mistake_a_module_makes(mistake: str) -> None:
    torch.manual_seed(4)
    module = PlainHeads(8, 2, mistake)
    x = 3 * torch.randn(2, 6, 8)
    weights: dict[str, torch.Tensor | None] = {n: getattr(module, n).weight for n in "qkvo"}
    weights |= {"b" + n: None for n in "qkvo"}
    with torch.no_grad():
        found = diagnose_heads(module(x), x, weights, 2)
    assert found is not None
    causal, slip, mask_slip = found
    assert causal
    assert (slip, mask_slip) == ((mistake, "none") if mistake in HEAD_SLIPS else ("none", mistake))
    assert heads_cause(found) == {**HEAD_SLIPS, **MASK_SLIPS}[mistake]


def test_reads_is_each_mask_slips_pattern() -> None:
    lower = torch.ones(4, 4).tril()
    assert torch.equal(reads("none", 4), lower.double())
    assert torch.equal(reads("off by one", 4), torch.ones(4, 4).tril(1).double())
    assert torch.equal(reads("inverted", 4), torch.ones(4, 4).triu().double())
    assert torch.equal(reads("ignored", 4), torch.ones(4, 4).double())
    hidden = reads("hides the diagonal", 4)
    assert bool(hidden[0].isnan().all())  # row 0 sees no key: undefined
    assert torch.equal(hidden[1:, :1], torch.ones(3, 1).double())  # later rows read row 0


def test_diagnose_reads_names_a_pattern_only_one_slip_has() -> None:
    T = 5
    eye = torch.eye(T, dtype=torch.bool)
    assert diagnose_reads(torch.ones(T, T).triu().bool()) == "inverted"
    assert diagnose_reads(torch.ones(T, T).tril(1).bool()) == "off by one"
    row0_reads_all = torch.ones(T, T).tril().bool()
    row0_reads_all[0] = True  # a -1e9 fill on a row that sees no key: an even average over every key
    assert diagnose_reads(row0_reads_all) == "hides the diagonal"
    assert diagnose_reads(torch.ones(T, T, dtype=torch.bool)) is None  # no mask, after softmax, 0-filled
    assert diagnose_reads(torch.ones(T, T).tril().bool()) is None  # causal: none and the hidden diagonal
    assert diagnose_reads(eye) is None


def _block(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A toy block x (B, T, D) -> (B, T, D) in one arrangement, its sublayer a fixed linear map."""
    torch.manual_seed(5)
    sub, norm = nn.Linear(8, 8), nn.LayerNorm(8)
    blocks = {"pre-norm": lambda x: x + sub(norm(x)), "post-norm": lambda x: norm(x + sub(x)),
              "no residual": lambda x: sub(norm(x)), "no norm": lambda x: x + sub(x),
              "nan": lambda x: x + sub(norm(x)) * torch.tensor([math.nan] + [1.0] * (x.size(1) - 1))[:, None]}
    return blocks[kind]


@pytest.mark.parametrize(("kind", "cause"), [("pre-norm", None), ("post-norm", None),
                                             ("no residual", "no residual connection"),
                                             ("no norm", "no norm on the residual path"), ("nan", NAN)])
def test_arrangement_tells_a_missing_residual_from_a_missing_norm(kind: str, cause: str | None) -> None:
    x = 3 * torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        check = arrangement(_block(kind), x)
    assert check.passed is (cause is None)
    assert cause is None or cause in check.cause


class TinyLM(nn.Module):
    """A causal LM of one-head blocks whose attention weights are bare parameters (unreadable as nn.Linear),
    with its mask and loss chosen by name."""

    def __init__(self, mask: str = "none", fill: float = float("-inf"), loss: str = "next") -> None:
        super().__init__()
        self.mask, self.fill, self.loss_kind = mask, fill, loss
        self.tok, self.pos = nn.Embedding(11, 8), nn.Embedding(16, 8)
        self.wqkv = nn.ParameterList([nn.Parameter(torch.randn(8, 24) / 3) for _ in range(2)])
        self.blocks = nn.ModuleList([TinyBlock(self, b) for b in range(2)])
        self.head = nn.Linear(8, 11)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        if self.loss_kind == "drop both":  # the HF-style "shift" that drops position 0 of both
            return logits, F.cross_entropy(logits[:, 1:].flatten(0, 1), targets[:, 1:].flatten())
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TinyBlock(nn.Module):
    """x + attention(x) with the owning TinyLM's mask."""

    def __init__(self, lm: TinyLM, index: int) -> None:
        super().__init__()
        self.settings, self.index = [lm], index  # a list, so the block does not register its own model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lm, T = self.settings[0], x.size(1)
        q, k, v = (x @ lm.wqkv[self.index]).split(8, dim=-1)
        keep = {"none": torch.ones(T, T).tril(), "inverted": torch.ones(T, T).triu(),
                "off by one": torch.ones(T, T).tril(1), "hides the diagonal": torch.ones(T, T).tril(-1),
                "ignored": torch.ones(T, T)}[lm.mask].bool()
        scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~keep, lm.fill)
        return x + scores.softmax(-1) @ v


@pytest.mark.parametrize(("mask", "fill", "cause"), [
    ("inverted", float("-inf"), MASK_SLIPS["inverted"]),
    ("off by one", float("-inf"), MASK_SLIPS["off by one"]),
    ("hides the diagonal", -1e9, MASK_SLIPS["hides the diagonal"]),
    ("hides the diagonal", float("-inf"), NAN),
    ("ignored", float("-inf"), LEAK),
])
def test_a_model_leak_is_named_by_which_rows_its_blocks_read(mask: str, fill: float, cause: str) -> None:
    torch.manual_seed(7)
    results = model_checks(TinyLM(mask, fill), "TinyLM", TinyBlock)
    leaks = [c for c in results if c.section in ("§7.1", "§7.3") and "loss" not in c.name]
    assert leaks and all(c.passed is False for c in leaks)
    assert {c.cause for c in leaks} == {cause}


def test_a_correct_tiny_model_fails_nothing() -> None:
    torch.manual_seed(7)
    failed = [c for c in model_checks(TinyLM(), "TinyLM", TinyBlock) if c.passed is False]
    assert not failed, failed


def test_the_loss_that_drops_position_zero_of_both_is_named_a_missing_shift() -> None:
    torch.manual_seed(8)
    tokens = torch.randint(0, 11, (1, 9))
    check = loss_check(LanguageModel(TinyLM(loss="drop both"), "TinyLM"), tokens)
    assert check.passed is False and check.cause == SHIFT_BOTH
    assert loss_check(LanguageModel(TinyLM(), "TinyLM"), tokens).passed is True
