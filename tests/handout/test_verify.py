"""`verify` (handout §2.2): the handout's properties measured on a tiny trained model, and each one failing
on a model built or edited to break it, through the library and the `gptlab verify` command."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gptlab.cli import main
from gptlab.handout.verify import verify_model
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.positions import SinusoidalPositions

pytestmark = pytest.mark.usefixtures("one_thread")


def by_name(properties: list) -> dict[str, Any]:
    return {p.name: p for p in properties}


def test_verify_passes_on_a_trained_model(trained_run: Path) -> None:
    properties = by_name(verify_model(load(trained_run).model))
    assert [p.passed for p in properties.values()] == [True, True, True, True, True, None]
    assert properties["logits at i ignore every input after i"].deviation == 0.0
    assert 0 <= properties["attention rows sum to one"].deviation < 1e-5


def test_verify_restores_the_models_mode(random_gpt: Any) -> None:
    model = random_gpt(2).train()
    verify_model(model)  # measures in eval mode, without gradients
    assert model.training and torch.is_grad_enabled()


def unmask_one_block(model: GPT) -> None:
    model.transformer.h[1].attn.causal = False  # through the library's own switch, on one block only


def untie(model: GPT) -> None:
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())


def scale_queries(model: GPT) -> None:
    attn = model.transformer.h[0].attn
    kernel = attn.kernel
    attn.kernel = lambda q, k, v, mask, causal: kernel(2 * q, k, v, mask, causal)


def ignore_cache_mask(model: GPT) -> None:
    for block in model.transformer.h:  # a given mask (the cache's) is dropped; `causal` still applies
        block.attn.kernel = lambda q, k, v, mask, causal: F.scaled_dot_product_attention(q, k, v,
                                                                                          is_causal=causal)


def add_positions(model: GPT) -> None:
    model.transformer.wpe = SinusoidalPositions(model.config)


@pytest.mark.parametrize(("changes", "breaks", "name"), [
    ({}, unmask_one_block, "logits at i ignore every input after i"),
    ({}, ignore_cache_mask, "cached generation = uncached"),
    ({"positions": "rope"}, scale_queries, "fused projection = separate projections"),
    ({}, untie, "tied head is the embedding tensor"),
    ({"positions": "none"}, add_positions, "no positions, no mask: permutation equivariant"),
])
def test_each_property_fails_on_a_model_that_breaks_it(changes: dict, breaks: Any, name: str,
                                                       random_gpt: Any) -> None:
    model = random_gpt(2, block_size=16, **changes)
    assert by_name(verify_model(model))[name].passed is True
    breaks(model)
    broken = by_name(verify_model(model))
    assert broken[name].passed is False
    assert broken["attention rows sum to one"].passed is True  # the others still measure


def test_rows_check_catches_weights_that_are_not_normalised(monkeypatch: pytest.MonkeyPatch,
                                                            random_gpt: Any) -> None:
    model = random_gpt(2)
    monkeypatch.setattr("gptlab.inspection.hooks.masked_softmax",
                        lambda scores, mask: scores.masked_fill(~mask, -math.inf).softmax(-2))  # over queries
    assert by_name(verify_model(model))["attention rows sum to one"].passed is False


def test_verify_command_exit_status(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                    save_model: Any) -> None:
    assert main(["verify", str(trained_run)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and out.count("n/a") == 1 and "0 failed" in out
    lm = load(trained_run)
    model, tokenizer = lm.model, lm.tokenizer
    open_model = GPT(model.config.replace(causal=False))  # the same weights without the mask
    open_model.load_state_dict(model.state_dict())
    save_model(tmp_path / "open", open_model, tokenizer)
    assert main(["verify", str(tmp_path / "open")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("FAIL   §7.3") for line in lines)
    assert any(line.startswith("FAIL   §7.1") and "not causal" in line for line in lines)
    assert "2 failed" in lines[-1]



def test_bfloat16_verify_reports_the_difference_to_float32(trained_run: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    model = load(trained_run).model
    found = by_name(verify_model(copy.deepcopy(model).to(torch.bfloat16), reference=model))
    precision = found["reduced precision: logits vs float32"]
    assert precision.passed and 0 < precision.deviation < 1  # rounded weights: a small difference, never none
    assert main(["verify", str(trained_run), "--dtype", "bfloat16"]) == 0
    assert "logits vs float32" in capsys.readouterr().out
