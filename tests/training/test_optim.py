"""Training-schedule options: the trapezoid learning rate, batch and window warm-up, Muon's settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from conftest import SAT_LINES, assert_identical_runs
from gptlab.checkpoint import LAST, load_checkpoint
from gptlab.config import ModelConfig, TrainConfig
from gptlab.model import GPT
from gptlab.training.curriculum import batch_size_at, block_size_at
from gptlab.training.loop import train
from gptlab.training.optim import hidden_matrices, learning_rate, make_optimizer
from gptlab.training.presets import resolve_configs
from gptlab.training.resume import resume

# The tiny preset, 20 steps, evaluated twice: every option on, in one run.
TINY_MODEL, TINY_TRAIN = resolve_configs("tiny", train_overrides=dict(
    max_steps=20, eval_interval=10, eval_batches=2, device="cpu", precision="float32", warmup_steps=2))
MUON_MODEL = TINY_MODEL.replace(vocab_size=20, n_layer=1, n_embd=16)
ALL_ON = TINY_TRAIN.replace(schedule="trapezoid", cooldown=0.3, batch_warmup=8, seq_warmup=6,
                            optimizer="muon", muon_lr=0.02, muon_nesterov=False, muon_ns_steps=3)


@pytest.fixture(scope="module")
def data_dir(char_corpus: Callable[[str], Path]) -> Path:
    """A prepared character corpus with obvious structure, so a tiny model learns it in 40 steps."""
    return char_corpus("\n".join(SAT_LINES * 60))


def test_trapezoid_warms_up_holds_and_cools_down_linearly() -> None:
    # warm-up over steps 0-9, lr 1.0 up to step 88, a line down to 0.1 at step 110 (the last 22 steps)
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, schedule="trapezoid")
    expected = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 50: 1.0, 88: 1.0, 99: 0.55, 105: 1.0 - 17 / 22 * 0.9,
                110: 0.1, 300: 0.1}
    assert {step: learning_rate(step, config) for step in expected} == pytest.approx(expected)


def test_trapezoid_follows_decay_steps_and_the_cooldown_fraction() -> None:
    base = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=0, max_steps=110, schedule="trapezoid")
    short = base.replace(decay_steps=50, cooldown=0.2)  # cools down over steps 40-50, holds min_lr after
    steps = (40, 45, 50, 60, 109)
    assert [learning_rate(s, short) for s in steps] == pytest.approx([1.0, 0.55, 0.1, 0.1, 0.1])
    sudden = base.replace(cooldown=0.0)  # no cool-down: lr to the end, then min_lr
    assert [learning_rate(s, sudden) for s in (109, 110)] == pytest.approx([1.0, 0.1])
    whole = base.replace(cooldown=1.0)  # a straight line from step 0
    assert [learning_rate(s, whole) for s in (0, 55, 110)] == pytest.approx([1.0, 0.55, 0.1])


def test_new_options_are_validated_and_old_configs_load_with_todays_behaviour() -> None:
    for bad in (dict(cooldown=1.5), dict(cooldown=-0.1), dict(schedule="linear"), dict(batch_warmup=-1),
                dict(seq_warmup=-1), dict(muon_ns_steps=0), dict(muon_precision="half")):
        with pytest.raises(ValueError, match=f"TrainConfig.{next(iter(bad))}="):
            TrainConfig(**bad)
    old = TrainConfig.from_dict(dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110))  # no new keys
    assert (old.schedule, old.batch_warmup, old.seq_warmup) == ("cosine", 0, 0)
    assert (old.muon_nesterov, old.muon_ns_steps) == (True, 5)  # torch.optim.Muon's defaults
    # A run saved before Muon's precision was decided at start-up resumes in torch's bfloat16, as it ran.
    assert old.muon_precision == "auto"
    model = GPT(ModelConfig(vocab_size=20, n_layer=1, n_head=2, n_embd=16, block_size=8))
    muon_groups = make_optimizer(model, old.replace(optimizer="muon")).optimizers[1].param_groups
    assert {group["ns_dtype"] for group in muon_groups} == {torch.bfloat16}


def test_batch_warmup_grows_from_a_quarter_in_multiples_of_the_processes() -> None:
    config = TrainConfig(batch_size=12, batch_warmup=10)
    # 3 + 9 * step // 10: 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, then 12
    assert [batch_size_at(s, config) for s in range(12)] == [3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12]
    # two processes: from 2 (a quarter, 3, rounded down to even) by 10 / 10 per step, rounded down to even
    assert [batch_size_at(s, config, processes=2) for s in (0, 1, 5, 9, 10)] == [2, 2, 6, 10, 12]
    assert batch_size_at(0, TrainConfig(batch_size=2, batch_warmup=5)) == 1  # at least one sequence
    assert batch_size_at(0, TrainConfig(batch_size=12, batch_warmup=0)) == 12  # off


def test_seq_warmup_grows_from_16_tokens_in_steps_of_16() -> None:
    config = TrainConfig(seq_warmup=10)
    # 16 + 84 * step // 10, rounded down to a multiple of 16: 16 at step 0, 58 -> 48 at 5, 91 -> 80 at 9
    assert [block_size_at(s, config, 100) for s in (0, 1, 2, 5, 9, 10, 50)] == [16, 16, 32, 48, 80, 100, 100]
    assert [block_size_at(s, config, 8) for s in (0, 5, 10)] == [8, 8, 8]  # shorter than 16: no warm-up
    assert block_size_at(0, TrainConfig(seq_warmup=0), 100) == 100  # off


@pytest.mark.slow  # trains 20 steps twice
def test_every_option_on_trains_and_resumes_bit_exactly(data_dir: Path, tmp_path: Path) -> None:
    whole = train(tmp_path / "whole", data_dir, TINY_MODEL, ALL_ON, progress=False)
    assert whole.step == 20
    train(tmp_path / "split", data_dir, TINY_MODEL, ALL_ON, stop_at=5, progress=False)  # mid warm-ups
    resume(tmp_path / "split", progress=False)
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")
    # Every target is scored, so tokens_seen counts the batches' shapes: 2 + 6 * step // 8 windows for
    # steps 0-7, then 8; of 16 tokens for steps 0-5 (16 + 16 * step // 6 < 32), then 32.
    sizes = [2, 2, 3, 4, 5, 5, 6, 7] + [8] * 12
    windows = [16] * 6 + [32] * 14
    tokens = sum(size * window for size, window in zip(sizes, windows, strict=True))
    assert load_checkpoint(tmp_path / "whole", prefer=LAST).state["tokens_seen"] == tokens


def muon_step(config: TrainConfig) -> list[torch.Tensor]:
    """The blocks' matrices of a fixed tiny GPT after two steps of make_optimizer's Muon on set gradients."""
    torch.manual_seed(0)
    model = GPT(MUON_MODEL)
    optimizer = make_optimizer(model, config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return [p.detach().clone() for p in hidden_matrices(model)]


def torch_muon_step(nesterov: bool, ns_steps: int) -> list[torch.Tensor]:
    """The same matrices after torch.optim.Muon with the given settings on the same gradients."""
    torch.manual_seed(0)
    model = GPT(MUON_MODEL)
    matrices = list(hidden_matrices(model))
    ids = {id(p) for p in matrices}
    reference = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0, adjust_lr_fn="original",
                                 nesterov=nesterov, ns_steps=ns_steps)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for param in model.parameters():  # the same draws, in the same order, as muon_step
            grad = torch.randn(param.shape, generator=generator)
            if id(param) in ids:
                param.grad = grad
        reference.step()
    return [p.detach().clone() for p in matrices]


# gptlab's Muon runs Newton-Schulz as batched products (bmm), torch's one matrix at a time (mm): a BLAS may
# block them differently, and a flipped bfloat16 rounding moves an update by about lr * 2**-7, so within
# that per step, not bit for bit. 2 steps at lr 0.02: 3.1e-4; a setting changes these weights by > 6e-3.
MUON_TOLERANCE = dict(rtol=0, atol=2 * 0.02 * 2**-7)


def test_muon_settings_reach_the_optimiser_and_the_defaults_are_torchs(one_thread: None) -> None:
    muon = TINY_TRAIN.replace(optimizer="muon", muon_lr=0.02)
    default = muon_step(muon)
    assert_close(default, torch_muon_step(nesterov=True, ns_steps=5), **MUON_TOLERANCE)
    three = muon_step(muon.replace(muon_ns_steps=3))
    assert_close(three, torch_muon_step(nesterov=True, ns_steps=3), **MUON_TOLERANCE)
    assert not all(torch.equal(a, b) for a, b in zip(default, three, strict=True))
    plain = muon_step(muon.replace(muon_nesterov=False))
    assert_close(plain, torch_muon_step(nesterov=False, ns_steps=5), **MUON_TOLERANCE)
    assert not all(torch.equal(a, b) for a, b in zip(default, plain, strict=True))


@pytest.mark.slow  # starts three Python processes that import torch
def test_batch_warmup_in_two_processes_equals_one(data_dir: Path, tmp_path: Path) -> None:
    gptlab = ["-m", "gptlab", "train", "--data", str(data_dir), "--n-layer", "2", "--n-head", "2", "--n-embd",
              "32", "--block-size", "32", "--batch-size", "8", "--max-steps", "6", "--eval-interval", "3",
              "--eval-batches", "2", "--warmup-steps", "2", "--batch-warmup", "3", "--seq-warmup", "4",
              "--device", "cpu", "--precision", "float32", "--samples", "0", "--no-progress"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for launcher, run in (([sys.executable], "one"), (torchrun, "two")):
        done = subprocess.run([*launcher, *gptlab, "--out", str(tmp_path / run)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_checkpoint(tmp_path / run, prefer=LAST) for run in ("one", "two"))
    # windows per step 2, 4, 6, 8, 8, 8 (even on one process too, so both runs draw the same batches),
    # of 16 tokens for steps 0-3 (16 + 16 * step // 4 < 32) and 32 after
    assert one.state["tokens_seen"] == two.state["tokens_seen"] == (2 + 4 + 6 + 8) * 16 + (8 + 8) * 32
    for name, tensor in one.model_state.items():
        assert_close(two.model_state[name], tensor, atol=1e-5, rtol=1e-5, msg=name)
