"""The model, generation and training on a CUDA GPU; skipped where torch sees none.

`benchmarks/gpu.sh` runs these (`pytest -m cuda`). References: the same model in float32 on the same
GPU (bfloat16 autocast must agree within bfloat16's rounding), the decoder without its KV cache, and a
float32 copy on the CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from conftest import SAT_LINES
from gptlab.checkpoint import LAST
from gptlab.config import ModelConfig, TrainConfig
from gptlab.generate import Decoder
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.training.loop import train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                    reason="needs a CUDA GPU and torch built for it")]
CUDA = torch.device("cuda")


def test_bfloat16_autocast_forward_and_backward_agree_with_float32() -> None:
    """Logits, loss and every gradient under bfloat16 autocast match float32 within bfloat16's rounding
    (8 bits of mantissa: about 0.4% a product, compounded over 2 blocks)."""
    model = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)).to(CUDA)
    tokens = torch.randint(64, (4, 33), device=CUDA)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    logits, loss = model(inputs, targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits_bf16, loss_bf16 = model(inputs, targets)
    loss_bf16.backward()
    assert logits_bf16.dtype == torch.bfloat16  # autocast really ran the products in bfloat16
    assert_close(logits_bf16.float(), logits, atol=2e-2, rtol=2e-2)
    assert_close(loss_bf16, loss, atol=1e-2, rtol=0)
    for name, p in model.named_parameters():
        scale = grads[name].abs().max().item()
        assert_close(p.grad, grads[name], atol=0.05 * scale, rtol=0.05, msg=lambda m, n=name: f"{n}: {m}")


def test_cached_logits_equal_recomputed_logits_across_the_window() -> None:
    """The KV-cache decoder's logits on the GPU equal a recompute from scratch at every step, past the
    window's end (where the cached window slides), for two rows of different lengths."""
    model = GPT(ModelConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)).to(CUDA).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached, recomputed = Decoder(model, prompts), Decoder(model, prompts, use_cache=False)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    fast, slow = [], []
    for _ in range(40):
        fast.append(cached.logits())
        slow.append(recomputed.logits())  # (2, V)
        chosen = torch.multinomial(slow[-1].softmax(-1), 1, generator=generator)  # (2, 1): a varied sequence
        cached.append(chosen)
        recomputed.append(chosen)
    assert_close(torch.stack(fast), torch.stack(slow), atol=1e-4, rtol=1e-4)
    assert len(set(cached.rows[0])) > 5


def test_training_on_the_gpu_takes_bfloat16_and_muon_and_the_loss_falls(
        char_corpus: Callable[[str], Path], tmp_path: Path) -> None:
    """A short Muon run on the GPU: precision auto becomes bfloat16 (saved in config.json), the validation
    loss falls well below the untrained model's, and the checkpoint loads on the CPU."""
    data = char_corpus("\n".join(SAT_LINES * 60))
    model_config = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    train_config = TrainConfig(batch_size=8, max_steps=40, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                               eval_interval=20, eval_batches=2, device="cuda", optimizer="muon")
    result = train(tmp_path / "run", data, model_config, train_config, progress=False)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (saved["precision"], saved["muon_precision"]) == ("bfloat16", "bfloat16")
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert result.step == 40
    assert result.best_val_loss < 0.7 * float(rows[1].split(",")[2])  # from about ln(vocab) to well below
    model = load(tmp_path / "run", prefer=LAST).model
    assert next(model.parameters()).device.type == "cpu"
