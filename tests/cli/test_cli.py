"""The command line: thin wiring over the library, one clear line for every user mistake."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.inference.loading import load


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m gptlab ARGS` in a fresh process, as a user would."""
    command = [sys.executable, "-m", "gptlab", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n-embd", "100", "--n-head", "3"], "n_embd=100 is not divisible by n_head=3"),
        (["--positions", "rope", "--n-embd", "6", "--n-head", "2"], "needs an even head size"),
        (["--n-layer", "0"], "n_layer=0 must be positive"),
    ],
)
def test_bad_model_options_give_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["model", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.slow  # starts a Python process
def test_bad_option_in_a_real_process_has_no_traceback() -> None:
    result = run_cli("model", "--n-embd", "100", "--n-head", "3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gptlab: error: ModelConfig.n_embd=100 is not divisible by n_head=3: "
        "choose n_embd as a multiple of n_head (for example 99)"
    ]


@pytest.mark.slow  # starts a Python process
def test_unknown_choice_is_refused_by_the_parser() -> None:
    result = run_cli("model", "--norm", "batchnorm")
    assert result.returncode == 2
    assert "invalid choice: 'batchnorm'" in result.stderr and "Traceback" not in result.stderr


def test_model_command_prints_the_handout_parameter_count(capsys: pytest.CaptureFixture) -> None:
    assert main(["model", "--n-embd", "8", "--n-head", "2", "--n-layer", "1", "--no-bias"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert ["attention", "256"] in rows  # §4: 192 + 64


@pytest.mark.slow  # starts a Python process
def test_help_lists_the_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("lab", "model"):
        assert command in result.stdout


@pytest.mark.slow  # trains the tiny preset for 30 steps
def test_prepare_train_eval_sample_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question.\n" * 200, encoding="utf-8")
    assert main(["prepare", str(text), "--out", str(tmp_path / "data"), "--no-progress"]) == 0
    assert "char tokenizer with 16 ids" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tmp_path / "data"), "--out", str(run),
                 "--max-steps", "30", "--no-progress", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "finished at step 30" in out and "best checkpoint (step 30) on the val split: loss" in out
    assert "--- sample 1 ---" in out
    assert main(["eval", str(run), "--data", str(text)]) == 0
    assert "bits per character" in capsys.readouterr().out
    assert main(["sample", str(run), "--prompt", "to be", "--temperature", "0", "--max-new-tokens", "5"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("--- sample 1 ---\nto be") and len(greedy.splitlines()[1]) == len("to be") + 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sample", "{run}", "--temperature", "-1"], "SamplingConfig.temperature=-1.0 must be >= 0"),
        (["sample", "{run}", "--top-k", "0"], "SamplingConfig.top_k=0 must be at least 1"),
        (["sample", "{run}", "--prompt", "xyz"], "character 'x'"),
        (["eval", "{tmp}/nowhere"], "no run folder or checkpoint"),
        (["prepare", "{tmp}/empty.txt", "--out", "{tmp}/d"], "empty"),
    ],
)
def test_user_mistakes_are_one_line(args: list[str], message: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("")
    text = tmp_path / "text.txt"
    text.write_text("abc abc abc\n" * 100)
    run = tmp_path / "run"
    main(["train", "--preset", "tiny", "--data", str(text), "--out", str(run), "--max-steps", "1",
          "--no-progress", "--samples", "0"])
    capsys.readouterr()
    try:
        code = main([a.format(run=run, tmp=tmp_path) for a in args])
    except SystemExit as refused:  # refused while the arguments are read: argparse exits, with one line too
        code = refused.code
    assert code == 2
    err = capsys.readouterr().err
    assert re.match(r"gptlab( \w+)?: error: ", err) and err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "d").exists()


def train_briefly(tmp_path: Path, *extra: str) -> list[str]:
    """`gptlab train` for 4 steps (evaluations at 0, 2 and 4) on a small text, with progress asked for."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question.\n" * 100, encoding="utf-8")
    return ["train", "--preset", "tiny", "--data", str(text), "--out", str(tmp_path / "run"),
            "--max-steps", "4", "--eval-interval", "2", "--eval-batches", "1", "--samples", "0",
            "--device", "cpu", *extra]


@pytest.mark.slow  # trains 4 steps
def test_off_a_terminal_progress_is_one_plain_line_per_evaluation(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(train_briefly(tmp_path)) == 0  # captured: stdout and stderr are not terminals
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "step/s" not in out + err and "it/s" not in out + err  # no bar
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in progress] == ["step 0/4", "step 2/4", "step 4/4"]
    assert all("val loss" in line and "tokens/s" in line for line in progress)


@pytest.mark.slow  # trains 4 steps
def test_on_a_terminal_the_progress_bar_is_drawn(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for stream in (sys.stdout, sys.stderr):  # the capture streams, standing in for a terminal
        monkeypatch.setattr(stream, "isatty", lambda: True)
    assert main(train_briefly(tmp_path)) == 0
    assert "\r" in capsys.readouterr().err  # tqdm redraws its line in place
    assert main(train_briefly(tmp_path / "quiet", "--no-progress")) == 0
    assert "\r" not in capsys.readouterr().err


@pytest.mark.slow  # trains 4 steps
def test_training_ends_with_one_validation_figure_the_best_checkpoint_on_the_val_split(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One validation loss is printed, said to be the best checkpoint's on the val split, and it is that:
    the loss `evaluate_tokens` gives the best checkpoint on the run's val split."""
    from gptlab.data.tokens import TokenData
    from gptlab.evaluation.heldout import EVAL_TOKENS, evaluate_tokens

    assert main(train_briefly(tmp_path, "--no-progress")) == 0
    report = capsys.readouterr().out.split("\nfinished at step 4")[1].splitlines()
    figures = [line for line in report if re.search(r"loss \d", line)]
    assert len(figures) == 1 and figures[0].startswith("best checkpoint (step 4) on the val split: loss "), \
        report
    printed = float(figures[0].split("loss ")[1].split()[0])
    model = load(tmp_path / "run").model
    val = TokenData(tmp_path / "run" / "data").split("val")
    reference = evaluate_tokens(model, val, max_tokens=EVAL_TOKENS)
    assert printed == pytest.approx(reference.loss, abs=1e-4)
