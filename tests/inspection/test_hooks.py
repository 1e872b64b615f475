"""Hook points (handout §2.2): recording every intermediate value of tiny random models, checked against
attention written out from the weight matrices and the residual stream summed by hand."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from gptlab.inspection.hooks import hook_points, hooked, record
from gptlab.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("changes", [{}, {"attention": "naive"}, {"arrangement": "post", "tied": False},
                                     {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu"}])
def test_recording_every_point_leaves_the_logits_bit_identical(changes: dict, random_gpt: Any) -> None:
    model = random_gpt(**changes)
    idx = torch.randint(0, 13, (2, 8))
    plain = model(idx)[0]
    with record(model, hook_points(model)) as values:
        inspected = model(idx)[0]
    assert torch.equal(inspected, plain)
    assert set(values) == set(hook_points(model))
    assert values["h.1.attn.heads"].shape == (2, 8, 2, 4)  # (B, T, H, hs)
    assert values["h.0.attn.weights"].shape == values["h.1.attn.scores"].shape == (2, 2, 8, 8)
    assert torch.equal(model(idx)[0], plain)  # and nothing stays registered


def test_recorded_values_match_a_written_out_forward_pass(random_gpt: Any,
                                                          written_out_attention: Any) -> None:
    model = random_gpt()
    idx = torch.randint(0, 13, (2, 8))
    with record(model, hook_points(model)) as v:
        model(idx)
    rows = model.transformer.wte.weight[idx] + model.transformer.wpe.weight[:8]  # E[w] + p_i, (B, T, D)
    assert_close(v["embed"], rows)
    assert_close(v["h.0.resid_pre"], rows)
    for n, block in enumerate(model.transformer.h):
        assert_close(v[f"h.{n}.attn.in"], block.ln_1(v[f"h.{n}.resid_pre"]))
        scores, weights = written_out_attention(model, n, v[f"h.{n}.attn.in"])
        assert_close(v[f"h.{n}.attn.scores"], scores)  # raw: the future entries are there too
        assert_close(v[f"h.{n}.attn.weights"], weights)
        assert_close(v[f"h.{n}.attn.out"], block.attn.c_proj(v[f"h.{n}.attn.heads"].flatten(2)))
        residual = v[f"h.{n}.resid_pre"] + v[f"h.{n}.attn.out"] + v[f"h.{n}.mlp.out"]  # pre-norm stream
        assert_close(v[f"h.{n}.resid_post"], residual)
    assert_close(v["h.1.resid_pre"], v["h.0.resid_post"])


def test_weights_are_recomputed_only_for_the_heads_asked_for(random_gpt: Any) -> None:
    model = random_gpt(positions="rope")
    idx = torch.randint(0, 13, (1, 8))
    with record(model, ["h.1.attn.weights"]) as every:
        model(idx)
    with record(model, ["h.1.attn.weights"], heads=[1]) as one:
        model(idx)
    assert one["h.1.attn.weights"].shape == (1, 1, 8, 8)
    # one head's scores are a product of another batch size (and layout) than all heads': a BLAS may
    # block them differently, so within float32 rounding, not bit for bit
    assert_close(one["h.1.attn.weights"], every["h.1.attn.weights"][:, [1]])
    assert_close(every["h.1.attn.weights"], model.transformer.h[1].attn.attention_weights(
        model.transformer.h[1].ln_1(model.transformer.h[0](model.embed(idx)))))


def test_hooks_are_removed_even_when_the_forward_pass_fails(random_gpt: Any) -> None:
    model = random_gpt()

    def explode(value: torch.Tensor, name: str) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), hooked(model, dict.fromkeys(hook_points(model), explode)):
        model(torch.zeros(1, 4, dtype=torch.long))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_bad_hook_use_is_one_clear_error(random_gpt: Any) -> None:
    model = random_gpt()
    idx = torch.zeros(1, 4, dtype=torch.long)
    for name in ("h.2.mlp.out", "h.01.mlp.out", "h.-1.mlp.out", "h.0.mlp", "blocks.0.mlp.out"):
        with pytest.raises(ValueError, match=rf"unknown hook point '{re.escape(name)}': .* N in 0\.\.1"):
            with hooked(model, {name: lambda v, n: None}):
                pass
    with pytest.raises(ValueError, match="cannot be replaced: replace h.0.attn.heads instead"):
        with hooked(model, {"h.0.attn.weights": lambda v, n: v * 2}):
            model(idx)
    with pytest.raises(ValueError, match=r"returned shape \(1, 4\); it must keep \(1, 4, 8\)"):
        with hooked(model, {"h.0.mlp.out": lambda v, n: v[..., 0]}):
            model(idx)
    with pytest.raises(ValueError, match="without a KV cache"):
        with record(model, ["h.0.attn.weights"]):
            model(idx, cache=KVCache(model.config, 1))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
