"""The first hour, round two (issue 54): what a newcomer met pasting the tour, each held here."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptlab.cli import build_parser, main
from gptlab.evaluation.metrics import Metric
from gptlab.evaluation.results import TaskResult, table
from gptlab.evaluation.tasks import Task


def test_a_mistyped_command_is_one_line_with_the_closest_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'trian'" in err and "did you mean train?" in err


def test_a_wrong_data_is_refused_before_the_configs_are_printed(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--data", "shakspeare", "--out", str(tmp_path / "run")]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and "did you mean shakespeare?" in printed.err and printed.err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_seed_none_is_taken_where_help_offers_it() -> None:
    parser = build_parser()
    assert "INT|none" in parser._subparsers._group_actions[0].choices["sample"].format_help()  # type: ignore
    assert parser.parse_args(["sample", ".", "--seed", "none"]).seed is None
    assert parser.parse_args(["sample", ".", "--seed", "7"]).seed == 7


def test_the_benchmark_table_shows_the_chance_level_beside_accuracies() -> None:
    task = Task("arc_easy", "rc_0shot", 0, (), 4)
    result = TaskResult(task, (Metric("acc", 0.3, 0.01), Metric("acc_norm", 0.31, 0.01)), 4, 0, 1.0, 0.25)
    lines = table([result]).splitlines()
    assert "chance" in lines[0] and all(" 0.2500 " in line for line in lines[1:])


def test_the_loss_plot_marks_the_figure_the_terminal_printed(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from gptlab.training.logs import loss_figure

    (tmp_path / "text.txt").write_text("to be or not to be, that is the question.\n" * 60, encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tmp_path / "text.txt"), "--max-steps", "6",
                 "--eval-interval", "3", "--samples", "0", "--no-progress", "--out", str(run)]) == 0
    printed = capsys.readouterr().out
    figure = next(line for line in printed.splitlines() if line.startswith("best checkpoint (step 6) on"))
    loss = figure.split("loss ")[1].split(" ")[0]
    marks = [t.get_text() for t in loss_figure(run / "metrics.csv", "run").axes[0].texts]
    assert any(f"{loss} on " in mark and "as printed" in mark for mark in marks), (marks, figure)


def test_a_repeated_ngram_order_is_refused_in_one_line(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--preset", "tiny", "--ngram-embeddings", "2", "2", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert "repeats an order" in printed.err and printed.err.count("\n") == 1 and printed.out == ""
    assert not (tmp_path / "r").exists()
