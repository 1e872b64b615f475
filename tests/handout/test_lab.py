"""Tests for gptlab.handout.lab: every handout check passes, and breaking the model makes the lab fail.

The checks compare the library with the handout's own numbers; the tests here only read the
verdicts, then break `gptlab.model` on purpose (monkeypatch) to show that the verdicts can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptlab import model as M
from gptlab.handout import lab
from gptlab.handout.properties import Check

HANDOUT_SECTIONS = {"§2.1", "§3.1", "§3.2", "§4", "§4.1", "§4.2", "§5", "§6", "§6.1", "§7.1", "§7.3", "§7.4",
                    "§8.1"}


def _describe(result: Check) -> str:
    return f"{result.section} {result.name}: expected {result.expected}, computed {result.computed}"


def _by_name(results: list[Check]) -> dict[str, Check]:
    names = [r.name for r in results]
    assert len(names) == len(set(names)), f"check names must be unique: {names}"
    return {r.name: r for r in results}


@pytest.mark.parametrize("check", lab.CHECKS, ids=[check.__name__ for check in lab.CHECKS])
def test_every_check_passes(check: lab.Section) -> None:
    results = check()
    assert results, f"{check.__name__} reported nothing"
    failed = [_describe(r) for r in results if not r.passed]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_run_lab_passes_and_covers_every_section() -> None:
    results = lab.run_lab()
    failed = [_describe(r) for r in results if not r.passed]
    assert not failed, "\n".join(failed)
    missing = HANDOUT_SECTIONS - {r.section for r in results}
    assert not missing, f"no check for {sorted(missing)}"


@pytest.mark.slow
def test_checks_do_not_depend_on_order_or_disturb_the_callers_generator() -> None:
    torch.manual_seed(0)
    expected_draw = torch.rand(3)
    torch.manual_seed(0)
    backwards = [result for check in reversed(lab.CHECKS) for result in reversed(check())][::-1]
    assert torch.equal(torch.rand(3), expected_draw), "the lab changed the caller's random state"
    forwards = lab.run_lab()
    # Everything printed is identical; the raw deviations may differ in their last bit, because a
    # multithreaded float64 least-squares fit (§5's affine-fit check) sums in a varying order.
    shown = [(r.section, r.name, r.passed, r.expected, r.computed) for r in forwards]
    assert [(r.section, r.name, r.passed, r.expected, r.computed) for r in backwards] == shown
    for back, forth in zip(backwards, forwards, strict=True):
        if forth.deviation is None or back.deviation is None:
            assert back.deviation is forth.deviation, back.name
        else:
            assert back.deviation == pytest.approx(forth.deviation, rel=1e-12, abs=1e-300), back.name


def test_unscaled_scores_fail_the_scaling_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forget the 1/sqrt(d_k): model.py's own functions look the name up at call time, so they break too.
    monkeypatch.setattr(M, "attention_scores", lambda queries, keys: queries @ keys.transpose(-2, -1))
    retrieval = _by_name(lab.check_retrieval())
    for name in ("scaled scores s", "weights a", "retrieval output y"):
        assert not retrieval[name].passed, _describe(retrieval[name])
    scaling = _by_name(lab.check_scaling())
    for name in ("scaled scores at d_k=64", "weights at d_k=64", "variance of scaled scores, d_k=64",
                 "variance of scaled scores, d_k=1024"):
        assert not scaling[name].passed, _describe(scaling[name])
    assert not all(r.passed for r in lab.check_two_heads())


def _break_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every query sees every key: causal_mask allows all, and the sdpa kernel ignores `causal`."""

    def allow_everything(n_queries: int, n_keys: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)

    def sdpa_without_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          causal: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(M, "causal_mask", allow_everything)
    monkeypatch.setitem(M.KERNELS, "sdpa", sdpa_without_mask)


@pytest.mark.slow
def test_a_broken_mask_fails_the_causality_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    _break_the_mask(monkeypatch)
    causality = _by_name(lab.check_causality())
    for kernel in ("sdpa", "naive"):
        for name in (f"appending a token leaves earlier logits unchanged ({kernel})",
                     f"output i ignores inputs after i ({kernel})"):
            assert not causality[name].passed, _describe(causality[name])


def test_a_broken_mask_fails_the_toy_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    _break_the_mask(monkeypatch)
    trace = _by_name(lab.check_trace())
    for name in ("masked weights", "U = X + attention", "mean next-token loss (nats)"):
        assert not trace[name].passed, _describe(trace[name])
    # What the mask cannot touch still agrees with the handout: the inputs, the raw scores, and
    # row 2, the last position, which may see every key anyway.
    for name in ("input rows X = E[w] + p", "raw scores S (future entries exist)", "row 2 retrieves"):
        assert trace[name].passed, _describe(trace[name])
