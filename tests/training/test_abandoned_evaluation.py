"""SIGTERM during an evaluation abandons it: the run saves its last step at once, records no loss for that
evaluation, and the resumed run evaluates it first, ending as an uninterrupted run does."""

from __future__ import annotations

import csv
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import SAT_LINES, assert_identical_runs
from gptlab.checkpoint import BEST, LAST, load_checkpoint, load_header
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.tokens import TokenData
from gptlab.experiments.grid import Cell, Run, RunOptions
from gptlab.experiments.runner import plan_job
from gptlab.training.loop import train
from gptlab.training.resume import resume

MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
TRAIN = TrainConfig(batch_size=4, max_steps=6, lr=3e-3, min_lr=3e-4, warmup_steps=1, eval_interval=3,
                    eval_batches=20, device="cpu", precision="float32")


@pytest.fixture(scope="module")
def data_dir(char_corpus: Callable[[str], Path]) -> Path:
    return char_corpus("\n".join(SAT_LINES * 20))


def val_losses(run: Path) -> dict[str, str]:
    """Step -> validation loss, from the run's metrics.csv."""
    with (run / "metrics.csv").open(encoding="utf-8") as rows:
        return {row["step"]: row["val_loss"] for row in csv.DictReader(rows)}


def sigterm_in_evaluation(monkeypatch: pytest.MonkeyPatch, first: int) -> list[int]:
    """Send this process SIGTERM as validation batch number `first` is drawn; the list holds the number
    of validation batches drawn so far (only evaluations draw them, `eval_batches` each)."""
    drawn = [0]
    get_batch = TokenData.get_batch

    def drawing(self: TokenData, split: str, *args: Any) -> Any:
        drawn[0] += split == "val"
        if split == "val" and drawn[0] == first:
            signal.raise_signal(signal.SIGTERM)
        return get_batch(self, split, *args)

    monkeypatch.setattr(TokenData, "get_batch", drawing)
    return drawn


@pytest.mark.parametrize("evaluation", [1, 2], ids=["mid-run", "last"])
@pytest.mark.slow
def test_sigterm_during_an_evaluation_saves_the_last_step_and_the_resumed_run_evaluates_it(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, evaluation: int) -> None:
    train(tmp_path / "whole", data_dir, MODEL, TRAIN, progress=False)
    first = evaluation * TRAIN.eval_batches + 1  # the first validation batch of that evaluation
    drawn = sigterm_in_evaluation(monkeypatch, first)
    run = tmp_path / "split"
    result = train(run, data_dir, MODEL, TRAIN, progress=False)
    monkeypatch.undo()
    step = evaluation * TRAIN.eval_interval
    assert result.interrupted and result.exit_status == 143 and result.step == step
    assert drawn == [first]  # abandoned after the batch it was drawing, not all of its eval_batches
    saved = load_checkpoint(run, prefer=LAST).state
    assert saved["step"] == step and saved["evaluation_due"] is True
    if step - TRAIN.eval_interval == 0:  # the untrained step 0 is never "best": none yet
        assert not (run / BEST).exists()
    else:
        assert load_header(run / BEST).state["step"] == step - TRAIN.eval_interval  # no forged best
    assert list(val_losses(run)) == [str(s) for s in range(0, step, TRAIN.eval_interval)]
    if evaluation == 2:  # at max_steps: compare's runner resumes it rather than only scoring it
        cell = Cell("base", (), RunOptions(data=str(data_dir)), MODEL, TRAIN)
        job = plan_job(Run(cell, TRAIN.seed, run), data_dir, 1, tmp_path / "logs")
        assert job is not None and job.action == "resume"

    resumed = resume(run, progress=False)
    assert not resumed.interrupted and resumed.step == TRAIN.max_steps
    assert val_losses(run) == val_losses(tmp_path / "whole")
    assert load_header(run / BEST).state["step"] == load_header(tmp_path / "whole" / BEST).state["step"]
    assert_identical_runs(tmp_path / "whole", run)
