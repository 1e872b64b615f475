"""`gptlab finetune` says what its data kept, skipped and why, and the option that keeps the rest, before
step 0 (issue 42, point 3), not after training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptlab.adapt.sft import load_examples
from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer("abcdefgh=\n")
SHORT = ["abc", "bcd", "cde", "def", "efg", "fgh"]  # "abc=cba\n" and its end token: 8 tokens, within 9
LONG = ["abc", "bcd", "cde"]  # "abcabcabc=abc\n": 14 tokens, longer than the context of 9


def write_data(path: Path) -> Path:
    records = [{"prompt": w + "=", "completion": w[::-1] + "\n"} for w in SHORT]
    records += [{"prompt": w * 3 + "=", "completion": w + "\n"} for w in LONG]
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def make_base(root: Path) -> Path:
    """A random char model with an 8-token window, saved as a run."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=TOKENIZER.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=8))
    save_checkpoint(root / "base" / BEST, Checkpoint(model.config, TOKENIZER.to_dict(), model_tensors(model)))
    return root / "base"


def test_the_summary_names_the_context_the_longest_example_and_the_option(tmp_path: Path) -> None:
    data = load_examples(write_data(tmp_path / "d.jsonl"), TOKENIZER, None, block_size=8)
    assert data.summary() == ("6 of 9 examples (prompt-completion), 24 trained and 24 untrained tokens, "
                              "3 skipped as longer than the context of 9 tokens (the longest has 14; "
                              "--too-long truncate keeps them, cut to fit)")


@pytest.mark.slow  # trains a tiny model
def test_finetune_prints_the_data_summary_before_the_first_step(tmp_path: Path, one_thread: None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    base, data = make_base(tmp_path), write_data(tmp_path / "task.jsonl")
    assert main(["finetune", str(base), "--data", str(data), "--out", str(tmp_path / "run"),
                 "--max-steps", "2", "--eval-interval", "2", "--device", "cpu", "--precision", "float32",
                 "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = [i for i, line in enumerate(lines) if line.startswith("data: 6 of 9 examples")]
    trainer = next(i for i, line in enumerate(lines) if "parameters on cpu" in line)
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert len(summary) == 1 and summary[0] < trainer < first_step, lines
    assert "3 skipped as longer than the context" in lines[summary[0]]
    assert "; 5 train and 1 validation examples (too few to choose a best checkpoint" in lines[summary[0]]
