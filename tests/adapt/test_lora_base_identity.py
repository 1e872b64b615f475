"""An adapter run (finetune --lora) records its base checkpoint's SHA-256 and refuses, in one line naming
the base, every load and resume once that file has changed (issue 44, point 6); runs from before the hash
was recorded load as before."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from test_finetune import make_base, steps, write_task

from gptlab.adapt.finetune import SFTConfig, finetune, resume_finetune
from gptlab.checkpoint import BEST, LAST, Checkpoint, load_checkpoint, save_checkpoint
from gptlab.cli import main
from gptlab.inference.loading import load
from gptlab.lora import LoraConfig

CHANGED = "which has changed since (its content hash differs): restore that base, or fine-tune again"


@pytest.fixture
def runs(tmp_path: Path, one_thread: None) -> tuple[Path, Path, Path]:
    """A tiny base, its best checkpoint file, and a LoRA run on it stopped after 1 of 2 steps."""
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl", n=10)
    finetune(base, tmp_path / "lora", SFTConfig(data=str(data)), steps(2, eval_interval=1), LoraConfig(r=2),
             stop_at=1, progress=False)
    return base, (base / BEST).resolve(), tmp_path / "lora"


def change_base(base_file: Path) -> None:
    """Rewrite the base's checkpoint with other weights of the same shapes (as training it further would)."""
    saved = load_checkpoint(base_file)
    weights = {name: tensor + 0.01 for name, tensor in saved.model_state.items()}
    save_checkpoint(base_file, Checkpoint(saved.model_config, saved.tokenizer, weights, state=saved.state))


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's stderr, asserting it is one line with no traceback."""
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    return error


def test_an_unchanged_base_loads_and_the_record_holds_its_hash(runs: tuple[Path, Path, Path]) -> None:
    _, base_file, lora = runs
    for name in (BEST, LAST):
        saved = load_checkpoint(lora / name, optimizer=False).state["lora"]
        assert saved["base"] == str(base_file)
        assert saved["base_sha256"] == hashlib.sha256(base_file.read_bytes()).hexdigest()
    model = load(lora).model
    assert any(".lora_" in name for name, _ in model.named_parameters())


def test_a_changed_base_is_refused_by_every_load_naming_it(runs: tuple[Path, Path, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    base, base_file, lora = runs
    original = base_file.read_bytes()
    change_base(base_file)
    with pytest.raises(ValueError, match=re.escape(CHANGED)) as raised:
        load_checkpoint(lora).build_model()
    assert str(base_file) in str(raised.value) and str(lora) in str(raised.value)
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=re.escape(CHANGED)):
        load(lora)

    capsys.readouterr()
    commands = [["sample", str(lora), "--prompt", "abc=", "--max-new-tokens", "2"], ["verify", str(lora)],
                ["merge", str(lora), "--out", str(lora.parent / "merged")]]
    for command in commands:
        assert main(command) == 2, command
        error = one_error_line(capsys)
        assert CHANGED in error and str(base_file) in error, command
    assert not (lora.parent / "merged").exists()

    # Resuming the adapter run refuses too, before it trains anything.
    data = str(lora.parent / "task.jsonl")
    with pytest.raises(ValueError, match=re.escape(CHANGED)):
        resume_finetune(base, lora, SFTConfig(data=data), {}, LoraConfig(r=2), progress=False)
    assert main(["finetune", str(base), "--data", data, "--out", str(lora), "--resume", "--lora", "2",
                 "--max-steps", "2", "--eval-interval", "1", "--batch-size", "8", "--lr", "3e-3",
                 "--min-lr", "3e-4", "--warmup-steps", "5", "--eval-batches", "2", "--device", "cpu",
                 "--precision", "float32", "--save-every", "0", "--no-progress"]) == 2
    error = one_error_line(capsys)
    assert CHANGED in error and str(base_file) in error
    assert load_checkpoint(lora, prefer=LAST).state["step"] == 1

    # The base as it was (its very bytes) is the base again.
    base_file.write_bytes(original)
    load_checkpoint(lora).build_model()
    resume_finetune(base, lora, SFTConfig(data=data), {}, LoraConfig(r=2), progress=False)
    assert load_checkpoint(lora, prefer=LAST).state["step"] == 2


def test_a_run_from_before_the_hash_was_recorded_loads_as_before(runs: tuple[Path, Path, Path]) -> None:
    _, base_file, lora = runs
    saved = load_checkpoint(lora / BEST)
    del saved.state["lora"]["base_sha256"]
    save_checkpoint(lora / BEST, saved)
    change_base(base_file)
    model = load_checkpoint(lora).build_model()  # no hash to compare: loaded on the base as it is now
    base = load_checkpoint(base_file).model_state
    weight = "transformer.wte.weight"
    assert weight in base and torch.equal(dict(model.named_parameters())[weight].detach(), base[weight])
