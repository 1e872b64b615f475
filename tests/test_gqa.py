"""Grouped-query attention against an independent reference: multi-head attention whose key/value heads
are copies. A model with n_kv_head = Hkv must compute exactly what an ordinary model computes when its
W_K and W_V rows are each key/value head repeated for the H / Hkv query heads it serves."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

from gptlab.config import POSITIONS, ModelConfig, parameter_count
from gptlab.generate import Decoder
from gptlab.inspection.hooks import recompute_attention
from gptlab.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")

TinyConfig = Callable[..., ModelConfig]
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def grouped_model(tiny_config: TinyConfig, **changes: object) -> GPT:
    """Four query heads of width 4 on `n_kv_head` key/value heads, weights large enough to matter."""
    model = GPT(tiny_config(n_embd=16, n_head=4, block_size=16, **changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return model


def as_multi_head(model: GPT) -> GPT:
    """The same model with n_kv_head = n_head: each key/value head's rows copied to its query heads."""
    config = model.config
    full = GPT(config.replace(n_kv_head=None)).eval()
    state = dict(model.state_dict())
    D, hs, group = config.n_embd, config.head_size, config.n_head // config.kv_heads
    for name in [n for n in state if n.endswith("attn.c_attn.weight") or n.endswith("attn.c_attn.bias")]:
        q, k, v = state[name].split([D, config.kv_heads * hs, config.kv_heads * hs])
        # head h of the full model reads key/value head h // group: repeat each head's hs rows
        k, v = (t.unflatten(0, (config.kv_heads, hs)).repeat_interleave(group, 0).flatten(0, 1)
                for t in (k, v))
        state[name] = torch.cat([q, k, v])
    full.load_state_dict(state)
    return full


@pytest.mark.parametrize("n_kv_head", [1, 2])
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_grouped_heads_equal_multi_head_attention_with_repeated_keys(
    n_kv_head: int, positions: str, attention: str, tiny_config: TinyConfig
) -> None:
    model = grouped_model(tiny_config, n_kv_head=n_kv_head, positions=positions, attention=attention)
    idx = torch.randint(0, 13, (2, 16))
    assert_close(model(idx)[0], as_multi_head(model)(idx)[0], **TOLERANCE)


def test_grouped_model_is_causal_and_counted(tiny_config: TinyConfig) -> None:
    """No output depends on a later input; the parameter count follows the smaller W_K and W_V."""
    model = grouped_model(tiny_config, n_kv_head=2, qkv_bias=True, bias=False)
    idx = torch.randint(0, 13, (1, 16))
    x = model.embed(idx).detach().requires_grad_()
    logits = model.forward_embeddings(x)
    (grad,) = torch.autograd.grad(logits[0, 5].sum(), x)
    assert grad[0, 6:].abs().max() == 0 and grad[0, :6].abs().max() > 0
    assert model.num_parameters() == parameter_count(model.config)["total"]
    attn = model.transformer.h[0].attn
    assert attn.c_attn.weight.shape == (16 + 2 * 2 * 4, 16) and attn.c_attn.bias is not None
    assert attn.c_proj.bias is None  # qkv_bias adds biases to Q, K and V only


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_cached_decoding_of_grouped_heads_equals_recompute_and_stores_fewer_heads(
    positions: str, tiny_config: TinyConfig
) -> None:
    model = grouped_model(tiny_config, n_kv_head=1, positions=positions)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached, recomputed = Decoder(model, prompts), Decoder(model, prompts, use_cache=False)
    assert cached.cache.keys.size(2) == 1  # one key/value head: a quarter of the memory of H = 4
    for _ in range(40):  # crosses the 16-token window twice
        assert_close(cached.logits(), recomputed.logits(), **TOLERANCE)
        token = recomputed.logits().argmax(-1, keepdim=True)
        cached.append(token)
        recomputed.append(token)


def test_attention_maps_have_one_row_per_query_head(tiny_config: TinyConfig) -> None:
    """Inspection sees H query heads; heads sharing a key/value head differ only through their queries."""
    model = grouped_model(tiny_config, n_kv_head=2)
    x = model.embed(torch.randint(0, 13, (1, 16)))
    _, weights = recompute_attention(model.transformer.h[0].attn, x)
    assert weights.shape == (1, 4, 16, 16)
    _, full = recompute_attention(as_multi_head(model).transformer.h[0].attn, x)
    assert_close(weights, full, **TOLERANCE)


@pytest.mark.parametrize("n_kv_head", [0, 3])
def test_n_kv_head_must_divide_n_head(n_kv_head: int) -> None:
    with pytest.raises(ValueError, match="n_kv_head"):
        ModelConfig(n_head=4, n_kv_head=n_kv_head)
