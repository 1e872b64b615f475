"""Tests for gptlab.handout.properties: the comparisons report both values and never pass a NaN or a shape
mismatch, and the property functions shared by `lab` and `verify` tell a holding property from a broken one
on inputs small enough to work out by hand."""

from __future__ import annotations

import torch

from gptlab.handout import properties as checks
from gptlab.handout.properties import close


def test_a_failed_comparison_reports_both_values() -> None:
    result = close("§0", "demo", torch.tensor([1.0, 2.5]), [1.0, 2.0], 1e-6)
    assert not result.passed
    assert "[1.000000, 2.000000]" in result.expected and "1e-06" in result.expected
    assert "[1.000000, 2.500000]" in result.computed and "5.0e-01" in result.computed
    assert (result.deviation, result.tolerance, result.verdict) == (0.5, 1e-6, "FAIL")
    nan = close("§0", "nan", torch.tensor([float("nan")]), [0.0], 1.0)
    assert not nan.passed, "a NaN must never pass"
    assert not close("§0", "shape", torch.zeros(2), [0.0, 0.0, 0.0], 1.0).passed


def test_relative_tolerance_scales_with_the_largest_reference() -> None:
    eps = torch.finfo(torch.float32).eps
    small, large = torch.tensor([0.5]), torch.tensor([40.0])
    pairs = [(small + 1e-6, small), (large + 2e-4, large)]  # 2e-4 is within 100 eps x 40, not 100 eps x 1
    result = checks.all_close("§0", "pairs", pairs, checks.relative(eps))
    assert result.passed and result.tolerance == checks.EPSILONS * eps * 40.0
    torch.testing.assert_close(result.deviation, 2e-4, rtol=0.01, atol=0.0)
    too_far = [pairs[0], (large + 1e-2, large)]
    assert not checks.all_close("§0", "pairs", too_far, checks.relative(eps)).passed
    assert checks.failed([result, checks.Check("§0", "n/a", None)]) == []


def test_later_inputs_are_caught_by_replacement_exactly() -> None:
    tokens = torch.tensor([[3, 1, 4, 1, 5]])  # (1, T)
    seen = torch.ones(5, 5).tril()  # (T, T): the logits at i are the ids up to i, so no change cancels

    def causal(ids: torch.Tensor) -> torch.Tensor:  # (1, T) -> (1, T, T)
        return ids.float()[:, None, :] * seen

    def reads_ahead(ids: torch.Tensor) -> torch.Tensor:  # the logits at i are the ids from i on
        return ids.float()[:, None, :] * seen.T

    generator = torch.Generator().manual_seed(0)
    evidence = checks.replacement_dependence(causal, tokens, generator, first=0, vocab=10)
    dependence = checks.dependence_matrix(evidence)
    assert torch.all(dependence.triu(1) == 0) and torch.all(dependence[1:, 1:][seen[1:, 1:].bool()] > 0)
    assert checks.ignores_later_inputs(dependence, "causal").passed
    leak = checks.replacement_dependence(reads_ahead, tokens, generator, first=0, vocab=10)
    result = checks.ignores_later_inputs(leak, "reads ahead")
    assert not result.passed and result.deviation > 0 and result.tolerance == 0.0


def test_tied_head_needs_the_same_tensor_not_a_copy() -> None:
    embedding = torch.randn(4, 3)
    assert checks.tied_head(True, embedding, embedding).passed
    assert checks.tied_head(True, embedding.clone(), embedding).passed is False
    assert checks.tied_head(False, torch.randn(4, 3), embedding).passed is None
