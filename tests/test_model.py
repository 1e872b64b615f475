"""The model against independent references: written-out loops, textbook formulas, and its own kernels."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from conftest import covering
from gptlab.config import ARRANGEMENTS, FFNS, NORMS, POSITIONS, ModelConfig, parameter_count
from gptlab.model import (
    ACTIVATIONS,
    GPT,
    KERNELS,
    Block,
    CausalSelfAttention,
)
from gptlab.positions import Rotary, SinusoidalPositions

TinyConfig = Callable[..., ModelConfig]  # the `tiny_config` fixture of conftest.py

ALL_OPTIONS = list(itertools.product(NORMS, ARRANGEMENTS, POSITIONS, FFNS, (True, False)))


def future_gradient(model: GPT, idx: torch.Tensor) -> tuple[float, float]:
    """Largest |d output_i / d input_j| over j > i, and over j <= i, for every position i."""
    x = model.embed(idx).detach().requires_grad_()
    logits = model.forward_embeddings(x)
    T = idx.size(1)
    future, past = 0.0, 0.0
    for i in range(T):
        (grad,) = torch.autograd.grad(logits[:, i].sum(), x, retain_graph=True)
        future = max(future, grad[:, i + 1 :].abs().max().item() if i + 1 < T else 0.0)
        past = max(past, grad[:, : i + 1].abs().max().item())
    return future, past


@pytest.mark.parametrize(("norm", "arrangement", "positions", "ffn", "tied"), covering(ALL_OPTIONS))
def test_every_option_combination_builds_trains_and_stays_causal(
    norm: str, arrangement: str, positions: str, ffn: str, tied: bool, tiny_config: TinyConfig
) -> None:
    config = tiny_config(norm=norm, arrangement=arrangement, positions=positions, ffn=ffn, tied=tied)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size))
    logits, loss = model(idx, torch.roll(idx, -1, dims=1))
    assert logits.shape == (2, config.block_size, config.vocab_size)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    future, past = future_gradient(model, idx)
    assert future == 0.0, "an output depends on a later input"
    assert past > 0.0
    assert model.num_parameters() == parameter_count(config)["total"]


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_naive_and_sdpa_kernels_agree(positions: str, arrangement: str, tiny_config: TinyConfig) -> None:
    config = tiny_config(positions=positions, arrangement=arrangement, n_embd=16, n_head=4)
    fast = GPT(config)
    naive = GPT(config.replace(attention="naive"))
    naive.load_state_dict(fast.state_dict())
    idx = torch.randint(0, config.vocab_size, (3, config.block_size))
    assert_close(naive(idx)[0], fast(idx)[0], atol=1e-5, rtol=1e-5)


def loop_attention(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Multi-head causal attention written as loops over heads and query positions (no positions)."""
    B, T, D = x.shape
    H = attn.n_head
    hs = D // H
    W_q, W_k, W_v = attn.c_attn.weight.split(D, dim=0)
    b_q, b_k, b_v = attn.c_attn.bias.split(D)
    out = torch.zeros(B, T, D)
    for h in range(H):
        rows = slice(h * hs, (h + 1) * hs)
        q = x @ W_q[rows].T + b_q[rows]
        k = x @ W_k[rows].T + b_k[rows]
        v = x @ W_v[rows].T + b_v[rows]
        for i in range(T):
            scores = torch.stack([(q[:, i] * k[:, j]).sum(-1) / math.sqrt(hs) for j in range(i + 1)], -1)
            weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
            weights = weights / weights.sum(-1, keepdim=True)
            out[:, i, rows] = (weights.unsqueeze(-1) * v[:, : i + 1]).sum(1)
    return out @ attn.c_proj.weight.T + attn.c_proj.bias


@pytest.mark.parametrize("kernel", ["sdpa", "naive"])
def test_attention_matches_a_written_out_loop(kernel: str, tiny_config: TinyConfig) -> None:
    attn = CausalSelfAttention(tiny_config(n_embd=12, n_head=3, attention=kernel))
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5)  # large enough that every weight matters
    x = torch.randn(2, 5, 12)
    assert_close(attn(x), loop_attention(attn, x), atol=1e-5, rtol=1e-5)


def test_attention_weights_are_causal_rows_of_a_distribution(tiny_config: TinyConfig) -> None:
    attn = CausalSelfAttention(tiny_config())
    weights = attn.attention_weights(torch.randn(3, 6, 8))
    assert weights.shape == (3, 2, 6, 6)
    assert_close(weights.sum(-1), torch.ones(3, 2, 6))
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))


def test_loss_is_mean_next_token_cross_entropy_and_skips_minus_one(tiny_config: TinyConfig) -> None:
    model = GPT(tiny_config())
    idx = torch.randint(0, 13, (2, 8))
    targets = torch.randint(0, 13, (2, 8))
    targets[0, :3] = -1
    logits, loss = model(idx, targets)
    log_probs = torch.log_softmax(logits, dim=-1)
    scored = [(b, t) for b in range(2) for t in range(8) if targets[b, t] >= 0]
    expected = -sum(log_probs[b, t, targets[b, t]] for b, t in scored) / len(scored)
    assert_close(loss, expected)


def test_sinusoidal_table_follows_the_formula(tiny_config: TinyConfig) -> None:
    config = tiny_config(n_embd=6, n_head=2, positions="sinusoidal")
    table = SinusoidalPositions(config).table
    for pos, k in itertools.product(range(config.block_size), range(3)):
        angle = pos / 10000 ** (2 * k / 6)
        assert table[pos, 2 * k].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[pos, 2 * k + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_rope_scores_depend_only_on_relative_position(tiny_config: TinyConfig) -> None:
    rotary = Rotary(tiny_config(n_embd=16, n_head=2, block_size=12, positions="rope"))
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> torch.Tensor:
        qs = torch.zeros(1, 1, 12, 8)
        ks = torch.zeros(1, 1, 12, 8)
        qs[0, 0, m], ks[0, 0, n] = q, k
        return rotary(qs)[0, 0, m] @ rotary(ks)[0, 0, n]

    assert_close(score(5, 2), score(9, 6))
    assert_close(score(3, 3), q @ k)  # equal positions: the rotations cancel
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rmsnorm_and_swiglu_follow_their_formulas(tiny_config: TinyConfig) -> None:
    block = Block(tiny_config(norm="rmsnorm", ffn="swiglu", n_embd=8))
    x = torch.randn(2, 4, 8)
    expected_norm = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * block.ln_1.weight
    assert_close(block.ln_1(x), expected_norm)
    mlp = block.mlp
    gate = x @ mlp.c_gate.weight.T + mlp.c_gate.bias
    feat = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    expected_ffn = (gate * torch.sigmoid(gate) * feat) @ mlp.c_proj.weight.T + mlp.c_proj.bias
    assert_close(mlp(x), expected_ffn)


def test_post_norm_block_output_is_normalised_pre_norm_is_not(tiny_config: TinyConfig) -> None:
    x = 3 * torch.randn(2, 5, 8) + 1
    post = Block(tiny_config(arrangement="post"))(x)
    assert_close(post.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    pre = Block(tiny_config(arrangement="pre"))(x)
    assert pre.mean(-1).abs().max() > 0.1


def test_gpt2_initialisation(tiny_config: TinyConfig) -> None:
    model = GPT(tiny_config(n_embd=64, n_head=4, n_layer=8, vocab_size=500, block_size=64))
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert residual == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert model.transformer.h[0].mlp.c_fc.bias.abs().max() == 0


def test_tied_head_is_the_embedding_tensor(tiny_config: TinyConfig) -> None:
    tied, untied = GPT(tiny_config(tied=True)), GPT(tiny_config(tied=False))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 13 * 8


def test_too_long_input_is_a_clear_error(tiny_config: TinyConfig) -> None:
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_dropout_only_in_training_mode(tiny_config: TinyConfig) -> None:
    model = GPT(tiny_config(dropout=0.5))
    idx = torch.randint(0, 13, (1, 8))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_handout_attention_parameter_count(tiny_config: TinyConfig) -> None:
    # §4: D=8, H=2 without biases: 3D^2 + D^2 = 192 + 64 = 256, for any head count
    for n_head in (1, 2, 4, 8):
        config = tiny_config(n_embd=8, n_head=n_head, n_layer=1, bias=False)
        attention = CausalSelfAttention(config)
        assert sum(p.numel() for p in attention.parameters()) == 256
        assert parameter_count(config)["attention"] == 256


def test_fast_path_matches_float64_reference(tiny_config: TinyConfig) -> None:
    model = GPT(tiny_config(n_embd=16, n_head=4))
    idx = torch.randint(0, 13, (2, 8))
    reference = GPT(tiny_config(n_embd=16, n_head=4, attention="naive")).double()
    reference.load_state_dict(model.state_dict())
    assert_close(model(idx)[0].double(), reference(idx)[0], atol=1e-5, rtol=1e-5)
    assert F.softmax(model(idx)[0], -1).sum(-1).sub(1).abs().max() < 1e-5


def test_kernels_agree_when_queries_are_the_last_positions() -> None:
    # Cached decoding asks a few new queries against all keys: both kernels must align the mask alike.
    q, k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    assert_close(KERNELS["sdpa"](q, k, v, None, True), KERNELS["naive"](q, k, v, None, True))


def test_activations_match_their_formulas() -> None:
    x = torch.linspace(-4, 4, 101)
    assert_close(ACTIVATIONS["gelu_exact"]()(x), 0.5 * x * (1 + torch.erf(x / math.sqrt(2))))
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert_close(ACTIVATIONS["gelu"]()(x), tanh_form)
    assert_close(ACTIVATIONS["relu2"]()(x), torch.clamp(x, min=0) ** 2)
    assert set(ACTIVATIONS) | {"swiglu", "none"} == set(FFNS)


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_attention_only_block_is_the_attention_sublayer_alone(arrangement: str,
                                                              tiny_config: TinyConfig) -> None:
    config = tiny_config(ffn="none", arrangement=arrangement)
    block = GPT(config).transformer.h[0]
    assert block.mlp is None and block.ln_2 is None
    assert not any(".ln_2." in name or ".mlp." in name for name, _ in GPT(config).named_parameters())
    x = torch.randn(2, config.block_size, config.n_embd)
    expected = (x + block.attn(block.ln_1(x)) if arrangement == "pre"
                else block.ln_1(x + block.attn(x)))  # no second norm after the missing FFN
    assert_close(block(x), expected, rtol=0, atol=0)
    full = parameter_count(config.replace(ffn="gelu"))
    assert full["norms"] - parameter_count(config)["norms"] == config.n_layer * 2 * config.n_embd
