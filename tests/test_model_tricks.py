"""The four GPU-speedrun options of ModelConfig (qk_norm, logit_softcap, zero_init, unet) against formulas
written out here; then, for each option on, causality, cached = recomputed generation, a checkpoint round
trip, and the exporters' refusals.

Shape legend: B batch, T positions, D width, H query heads, Hkv key/value heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, Seq2SeqConfig
from gptlab.generate import Decoder
from gptlab.inference.loading import load
from gptlab.inspection.lens import logit_lens
from gptlab.interop import huggingface
from gptlab.interop.gguf import export_gguf
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models only lose time to a 2nd thread

RandomGPT = Callable[..., GPT]  # conftest's `random_gpt(seed=0, **changes)`
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
WINDOW = 16
# Each option on, in a shape that exercises what it touches: qk_norm with RoPE and grouped keys, unet
# with an odd number of blocks (the middle one has no skip).
OPTIONS: dict[str, dict[str, Any]] = {
    "qk_norm": {"qk_norm": True, "positions": "rope", "n_kv_head": 1},
    "logit_softcap": {"logit_softcap": 2.0},
    "zero_init": {"zero_init": True},
    "unet": {"unet": True, "n_layer": 5},
}
REFUSED = [name for name in OPTIONS if name != "zero_init"]  # zero_init changes only the starting weights


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * gain over the last dimension."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rotate_half(x: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE written out on (B, H, T, hs): pair (i, i + hs/2) at position t turns by t * base^(-2i/hs)."""
    T, hs = x.size(-2), x.size(-1)
    angles = torch.arange(T).unsqueeze(1) * base ** (-torch.arange(0, hs, 2) / hs)  # (T, hs/2)
    x1, x2 = x[..., : hs // 2], x[..., hs // 2:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], dim=-1)


def save_run(run: Path, model: GPT) -> None:
    """Write `model` as the run folder's best checkpoint, with a character tokenizer."""
    tokenizer = CharTokenizer("abc").to_dict()
    save_checkpoint(run / BEST, Checkpoint(model.config, tokenizer, model_tensors(model)))


# ---------------------------------------------------------------------------------------------- the math


def test_qk_norm_normalises_then_rotates_with_grouped_heads(random_gpt: RandomGPT) -> None:
    """Attention's output against q, k, v computed from c_attn's weights, RMS-normalised with their gains,
    then rotated, then the scores, causal softmax and W_O, one head at a time."""
    model = random_gpt(n_head=4, n_kv_head=2, n_embd=16, positions="rope", qk_norm=True)
    attn, config = model.transformer.h[0].attn, model.config
    x = torch.randn(2, 6, 16)  # (B, T, D)
    H, Hkv, hs, T = 4, 2, 4, 6
    W, b = attn.c_attn.weight, attn.c_attn.bias  # (D + 2 Hkv hs, D)
    q = (x @ W[: H * hs].T + b[: H * hs]).view(2, T, H, hs).transpose(1, 2)  # (B, H, T, hs)
    k = (x @ W[H * hs: (H + Hkv) * hs].T + b[H * hs: (H + Hkv) * hs]).view(2, T, Hkv, hs).transpose(1, 2)
    v = (x @ W[(H + Hkv) * hs:].T + b[(H + Hkv) * hs:]).view(2, T, Hkv, hs).transpose(1, 2)
    q = rotate_half(rms_norm(q, attn.q_norm.weight, config.norm_eps), config.rope_base)
    k = rotate_half(rms_norm(k, attn.k_norm.weight, config.norm_eps), config.rope_base)
    future = torch.ones(T, T).triu(1).bool()
    heads = []
    for h in range(H):
        kv = h // (H // Hkv)  # query heads 0, 1 share key/value head 0; 2, 3 share head 1
        scores = q[:, h] @ k[:, kv].transpose(-2, -1) / math.sqrt(hs)  # (B, T, T)
        heads.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[:, kv])  # (B, T, hs)
    expected = torch.cat(heads, dim=-1) @ attn.c_proj.weight.T + attn.c_proj.bias  # (B, T, D)
    assert_close(attn(x), expected, **TOLERANCE)


def test_qk_norm_gains_start_at_one_one_per_head_feature(tiny_config: Callable[..., ModelConfig]) -> None:
    model = GPT(tiny_config(qk_norm=True, n_head=2, n_embd=8))
    for block in model.transformer.h:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            assert_close(norm.weight.detach(), torch.ones(4))  # (hs,): one gain per head feature
    assert model.num_parameters() == GPT(tiny_config()).num_parameters() + 2 * 2 * 4  # L x (q, k) x hs


def test_softcap_is_cap_tanh_of_the_uncapped_logits(random_gpt: RandomGPT) -> None:
    """The same weights uncapped give raw logits; the model's are 2 tanh(raw / 2), as the loss sees."""
    capped = random_gpt(logit_softcap=2.0)
    plain = random_gpt(logit_softcap=0.0)
    plain.load_state_dict(capped.state_dict())
    idx = torch.randint(0, 13, (2, 8))
    targets = torch.randint(0, 13, (2, 8))
    raw = plain(idx)[0]  # (B, T, V)
    assert raw.abs().max() > 3.0  # past the cap of 2 somewhere, where tanh bends it most
    logits, loss = capped(idx, targets)
    assert_close(logits, 2.0 * torch.tanh(raw / 2.0), **TOLERANCE)
    expected = -(2.0 * torch.tanh(raw / 2.0)).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).mean()
    assert_close(loss, expected, **TOLERANCE)


def test_softcap_must_not_be_negative_and_is_gpt_only() -> None:
    with pytest.raises(ValueError, match=r"logit_softcap=-1.0 must be >= 0"):
        ModelConfig(logit_softcap=-1.0)
    for changes in ({"logit_softcap": 30.0}, {"unet": True}):
        with pytest.raises(ValueError, match="offered for the GPT only"):
            Seq2SeqConfig(**changes)


def test_zero_init_output_is_the_embedding_path_alone(tiny_config: Callable[..., ModelConfig]) -> None:
    """At init every W_O is 0, so the logits are LN_f(E[w] + p) E^T, written out here."""
    model = GPT(tiny_config(zero_init=True)).eval()
    projections = [name for name, _ in model.named_parameters() if name.endswith("c_proj.weight")]
    assert len(projections) == 2 * model.config.n_layer  # attention's and the MLP's, in every block
    for name in projections:
        assert torch.count_nonzero(model.get_parameter(name)) == 0
    assert model.transformer.h[0].attn.c_attn.weight.std() > 0.01  # the rest keeps GPT-2's init
    idx = torch.randint(0, 13, (2, 8))
    t = model.transformer
    rows = t.wte.weight[idx] + t.wpe.weight[:8]  # (B, T, D)
    expected = F.layer_norm(rows, (8,), t.ln_f.weight, t.ln_f.bias, model.config.norm_eps) @ t.wte.weight.T
    assert_close(model(idx)[0], expected, **TOLERANCE)


def test_without_zero_init_the_projections_are_random(tiny_config: Callable[..., ModelConfig]) -> None:
    model = GPT(tiny_config())
    projections = [p for name, p in model.named_parameters() if name.endswith("c_proj.weight")]
    assert all(torch.count_nonzero(p) > 0 for p in projections)


@pytest.mark.parametrize("n_layer", [4, 5])
def test_unet_against_a_written_out_loop(n_layer: int, random_gpt: RandomGPT) -> None:
    """Block n of the second half first adds w_j times the output of its mirror block L-1-n, j counting the
    skips in order; an odd middle block gets none."""
    model = random_gpt(unet=True, n_layer=n_layer)
    half = n_layer // 2
    assert model.skip_weights.shape == (half,)
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.5, -1.5]))  # distinct, so a swapped skip would show
    idx = torch.randint(0, 13, (2, 8))
    x = model.embed(idx)
    outputs = []
    for n, block in enumerate(model.transformer.h):
        if n >= n_layer - half:
            x = x + model.skip_weights[n - (n_layer - half)] * outputs[n_layer - 1 - n]
        x = block(x)
        outputs.append(x)
    expected = model.lm_head(model.transformer.ln_f(x))
    assert_close(model(idx)[0], expected, **TOLERANCE)


def test_unet_skip_weights_start_at_one(tiny_config: Callable[..., ModelConfig]) -> None:
    model = GPT(tiny_config(unet=True, n_layer=4))
    assert_close(model.skip_weights.detach(), torch.ones(2))
    assert model.num_parameters() == GPT(tiny_config(n_layer=4)).num_parameters() + 2


# ------------------------------------------------------------------------- every option, in the whole model


@pytest.mark.parametrize("option", OPTIONS)
def test_logits_ignore_later_tokens(option: str, random_gpt: RandomGPT) -> None:
    model = random_gpt(**OPTIONS[option])
    idx = torch.randint(0, 13, (1, 8))
    logits = model(idx)[0]
    for i in range(7):
        changed = idx.clone()
        changed[:, i + 1:] = (changed[:, i + 1:] + 1) % 13
        assert_close(model(changed)[0][:, : i + 1], logits[:, : i + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(model(changed)[0][:, i + 1:], logits[:, i + 1:])  # later ones do move


@pytest.mark.parametrize("option", OPTIONS)
def test_cached_generation_equals_recomputing(option: str, random_gpt: RandomGPT) -> None:
    """Two rows of different lengths, past the window: each cached step against the whole rows rerun."""
    model = random_gpt(block_size=WINDOW, **OPTIONS[option])
    cached, recomputed = Decoder(model, [[3, 1, 4, 1, 5], [9, 2]]), Decoder(model, [[3, 1, 4, 1, 5], [9, 2]],
                                                                             use_cache=False)
    for step in range(2 * WINDOW):
        fast, slow = cached.logits(), recomputed.logits()
        assert_close(fast, slow, **TOLERANCE)
        token = torch.tensor([[step % 13], [(5 * step + 1) % 13]])  # (B, 1)
        cached.append(token)
        recomputed.append(token)


@pytest.mark.parametrize("option", OPTIONS)
def test_checkpoint_round_trip(option: str, random_gpt: RandomGPT, tmp_path: Path) -> None:
    model = random_gpt(**OPTIONS[option])
    save_run(tmp_path, model)
    loaded = load(tmp_path).model
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():  # the weights come back bit for bit
        assert torch.equal(loaded.state_dict()[name], tensor), name
    idx = torch.randint(0, 13, (2, 8))
    # The logits within float32 rounding: an AVX2 CPU (AMD EPYC) may sum in another order.
    assert_close(loaded(idx)[0], model(idx)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("option", REFUSED)
def test_exporters_refuse_the_option_in_one_line(option: str, random_gpt: RandomGPT, tmp_path: Path) -> None:
    model = random_gpt(**OPTIONS[option])
    save_run(tmp_path, model)
    for export in (huggingface.export_hf, export_gguf):
        with pytest.raises(ValueError, match=option.replace("_", "[_-]")) as err:  # a field or its --flag
            export(tmp_path, tmp_path / "out")
        assert "\n" not in str(err.value)
        assert not (tmp_path / "out").exists()


def test_a_zero_init_model_exports_as_gpt2(tiny_config: Callable[..., ModelConfig]) -> None:
    """zero_init only chooses the starting weights: the function is GPT-2's, so it is not refused."""
    assert huggingface.export_family(tiny_config(zero_init=True)) == "gpt2"


@pytest.mark.parametrize("option", ["logit_softcap", "unet"])
def test_the_logit_lens_last_stage_is_the_model_output(option: str, random_gpt: RandomGPT) -> None:
    """The lens reads the streams through the model's own head (cap included); unet's skips are inside
    the blocks' stream, so the last block's output is still the final stream."""
    model = random_gpt(**OPTIONS[option])
    ids = [1, 5, 2, 7, 3]
    lens = logit_lens(model, CharTokenizer("abcdefghijklm"), "", ids, k=3)
    probs = model(torch.tensor([ids]))[0][0].softmax(-1)  # (T, V)
    assert_close(lens.top_probs[-1], probs.topk(3, dim=-1).values, **TOLERANCE)


def test_the_options_are_command_line_flags(capsys: pytest.CaptureFixture) -> None:
    args = ["model", "--n-layer", "4", "--n-embd", "8", "--n-head", "2", "--block-size", "8", "--qk-norm",
            "--logit-softcap", "30", "--zero-init", "--unet"]
    assert main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    for field in ("qk_norm", "zero_init", "unet"):
        assert [field, "=", "True"] in rows
    assert ["logit_softcap", "=", "30.0"] in rows and ["skip", "weights", "2"] in rows


@pytest.mark.parametrize("option", OPTIONS)
def test_verify_passes_with_the_option_on(option: str, random_gpt: RandomGPT) -> None:
    """`gptlab verify`'s checks rebuild attention by hand: they must follow each option, e.g. the fused =
    separate projections check normalises queries and keys under qk_norm as the model does."""
    from gptlab.handout.properties import failed
    from gptlab.handout.verify import verify_model

    assert [c.name for c in failed(verify_model(random_gpt(**OPTIONS[option])))] == []
