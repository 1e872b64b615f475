"""One validation figure (issue 42): the end of `gptlab train`, `gptlab eval RUN` and metrics.csv give the
same number for the same tokens, the per-evaluation lines say they are estimates, and a finished run
reported again reads its figure back instead of scoring again."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import SAT_LINES
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.training import final
from gptlab.training.final import final_evaluation
from gptlab.training.loop import train
from gptlab.training.resume import resume

MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
TRAIN = TrainConfig(batch_size=4, max_steps=4, lr=3e-3, min_lr=3e-4, warmup_steps=1, eval_interval=2,
                    eval_batches=2, device="cpu", precision="float32")


@pytest.fixture(scope="module")
def data_dir(char_corpus: Callable[[str], Path]) -> Path:
    return char_corpus("\n".join(SAT_LINES * 20))


def rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def scored(rows: list[dict[str, str]]) -> list[tuple[str, str]]:
    """(step, final_val_loss) of the rows that hold a final figure."""
    return [(row["step"], row["final_val_loss"]) for row in rows if row.get("final_val_loss")]


@pytest.mark.slow  # trains 4 steps through the command, twice, and evaluates
def test_the_end_of_training_eval_and_metrics_csv_give_one_figure(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    text = tmp_path / "text.txt"
    text.write_text("\n".join(SAT_LINES * 20), encoding="utf-8")
    argv = ["train", "--preset", "tiny", "--data", str(text), "--out", str(tmp_path / "run"), "--max-steps",
            "4", "--eval-interval", "2", "--eval-batches", "2", "--samples", "0", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("val loss" in line and "(estimate, 2 batches, perplexity" in line
                                   for line in steps)
    report = out.split("\nfinished at step 4")[1].splitlines()
    assert report[1].startswith("scoring best checkpoint (step ")  # what the wait is for, said first
    ended = report[2]
    assert main(["eval", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == ended + "\n"  # the same line, to the last digit
    (step, loss), = scored(rows(tmp_path / "run"))
    assert ended.startswith(f"best checkpoint (step {step}) on the val split: loss {float(loss):.4f} ")
    assert main(argv) == 0  # the same command again: the figure is read back, not scored again
    again = capsys.readouterr().out.split("\nfinished at step 4")[1].splitlines()
    assert again[1] == ended and not any(line.startswith("scoring") for line in again)


@pytest.mark.slow  # trains 6 steps and scores twice
def test_a_recorded_figure_is_read_back_and_kept_through_an_extension(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, progress=False)
    assert scored(rows(run)) == []  # train() alone leaves metrics.csv as it was
    announced: list[str] = []
    first = final_evaluation(run, announce=announced.append)
    assert len(announced) == 1 and announced[0].startswith("scoring best checkpoint")
    (step, loss), = scored(rows(run))
    assert float(loss) == first.result.loss and f"(step {step})" in first.checkpoint

    def no_scoring(*args: object, **kwargs: object) -> None:
        raise AssertionError("scored again")

    monkeypatch.setattr(final, "evaluate_run", no_scoring)
    assert final_evaluation(run).line() == first.line()
    monkeypatch.undo()
    resume(run, progress=False, changes={"max_steps": 6})
    extended = rows(run)
    assert [row["step"] for row in extended] == ["0", "2", "4", "6"]
    assert scored(extended) == [(step, loss)]  # the resumed log kept the column and its figure
    final_evaluation(run)
    assert len(scored(rows(run))) in (1, 2)  # a better checkpoint at step 6 adds its own


def test_the_figure_goes_on_its_checkpoints_row_and_a_missing_row_records_nothing(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n0,3,3,0,0,0\n5,2,2,0,1,1\n")
    final.record_loss(metrics, 5, 1.25, 1024)
    assert metrics.read_text().splitlines() == [
        "step,train_loss,val_loss,lr,tokens_per_s,elapsed_s,final_val_loss,final_val_tokens,final_val_windows",
        "0,3,3,0,0,0,,,", "5,2,2,0,1,1,1.25,1024,spread"]
    assert final.recorded_loss(metrics, 5, 1024) == 1.25
    assert final.recorded_loss(metrics, 5, 2048) is None  # another number of tokens: score again
    before = metrics.read_text()
    final.record_loss(metrics, 7, 1.0, 1024)
    assert metrics.read_text() == before
