"""A fine-tuning run with too few validation examples to tell checkpoints apart keeps the last one as best
(issue 54, the first hour: the tour's chat run held out 2 examples and kept an early step as "best")."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_chat_runs
from gptlab.adapt.finetune import MIN_VAL_EXAMPLES
from gptlab.checkpoint import BEST, LAST, load_header, resolve_checkpoint

WORDS = ["cat", "dog", "sun", "sea", "hat", "cup", "red", "toe", "bee", "ant", "owl", "elm"]


def finetune(root: Path, examples: int, capsys: pytest.CaptureFixture[str]) -> Path:
    """A 3-step base, then 12 steps of fine-tuning on `examples` conversations, evaluated every 4 steps."""
    chats = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
             for w in (WORDS * 40)[:examples]]
    tiny_chat_runs(root, " ".join(f"say {w}." for w in WORDS) * 40 + "\n", chats,
                   ["--max-steps", "12", "--lr", "1e-1", "--batch-size", "4", "--eval-interval", "4",
                    "--eval-batches", "1", "--no-progress"], out="ft")
    return root / "ft"


@pytest.mark.slow  # trains a base and fine-tunes it
def test_too_few_validation_examples_keep_the_last_checkpoint_as_best(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = finetune(tmp_path, 24, capsys)  # 10% held out: 2 examples
    out = capsys.readouterr().out
    assert "2 validation examples (too few to choose a best checkpoint" in out
    assert load_header(run / BEST).state["step"] == load_header(run / LAST).state["step"] == 12


@pytest.mark.slow  # 160 examples: 16 held out
def test_enough_validation_examples_choose_the_best_by_its_loss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = finetune(tmp_path, 10 * MIN_VAL_EXAMPLES, capsys)
    out = capsys.readouterr().out
    assert f"{MIN_VAL_EXAMPLES} validation examples" in out and "too few" not in out
    best = load_header(run / BEST).state
    assert best["best_val_loss"] == min(best["best_val_loss"], load_header(run / LAST).state["last_val_loss"])



@pytest.mark.slow  # a training process, interrupted
def test_a_run_interrupted_before_its_first_evaluation_is_read_from_its_last_checkpoint(
        tmp_path: Path) -> None:
    """Ctrl-C before the first evaluation after step 0 leaves no "best" holding the untrained model."""
    (tmp_path / "text.txt").write_text(" ".join(f"say {w}." for w in WORDS) * 40 + "\n", encoding="utf-8")
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gptlab", "train", "--preset", "tiny", "--data",
               str(tmp_path / "text.txt"), "--max-steps", "100000", "--eval-interval", "50000", "--samples",
               "0", "--no-progress", "--out", str(run)]  # evaluated at step 0, then not for long
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "steps.csv").is_file() or len((run / "steps.csv").read_text().splitlines()) < 4:
            assert process.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)  # after the third step is written: no evaluation since step 0
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, out
    assert "no evaluation since step 0" in out
    assert not (run / BEST).exists() and resolve_checkpoint(run) == run / LAST
    assert load_header(run).state["step"] >= 3
