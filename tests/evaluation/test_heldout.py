"""Held-out evaluation of a run (gptlab.evaluation.heldout): `evaluation_line` from Python is what
`gptlab eval` prints, and its refusals name arguments, where the command names flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.config import SettingError
from gptlab.evaluation.heldout import EVAL_TOKENS, evaluation_line


@pytest.mark.parametrize("extra", [[], ["--data", "text"], ["--dtype", "bfloat16", "--max-tokens", "100"]])
@pytest.mark.slow
def test_evaluation_line_is_what_the_eval_command_prints(trained_run: Path, extra: list[str],
                                                         capsys: pytest.CaptureFixture) -> None:
    text = trained_run.parent / "text.txt"
    argv = [str(text) if arg == "text" else arg for arg in extra]
    assert main(["eval", str(trained_run), *argv]) == 0
    options = dict(zip(argv[::2], argv[1::2], strict=True))
    line = evaluation_line(trained_run, options.get("--data", "val"),
                           int(options["--max-tokens"]) if "--max-tokens" in options else EVAL_TOKENS,
                           dtype=options.get("--dtype", "float32"))
    assert capsys.readouterr().out == line + "\n"
    assert "nats per token, perplexity" in line and "bits per character" in line


def test_evaluation_refusals_name_arguments_and_the_command_names_flags(
        trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SettingError, match="^dtype bfloat16 and quantize int8 both set"):
        evaluation_line(trained_run, "val", None, dtype="bfloat16", quantize="int8")
    assert main(["eval", str(trained_run), "--dtype", "bfloat16", "--quantize", "int8"]) == 2
    assert capsys.readouterr().err.startswith("gptlab: error: --dtype bfloat16 and --quantize int8 both set")


def test_eval_scores_the_first_tokens_unless_told_all_and_says_which(trained_run: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", str(trained_run), "--max-tokens", "100"]) == 0
    assert "(96 tokens scored, the first of " in capsys.readouterr().out  # four whole windows of 24
    assert main(["eval", str(trained_run), "--all"]) == 0
    whole = capsys.readouterr().out
    assert ", the whole of " in whole and "in windows of 24)" in whole
    assert main(["eval", str(trained_run)]) == 0  # a val split under EVAL_TOKENS: the default is all of it
    assert capsys.readouterr().out == whole
    assert main(["eval", str(trained_run), "--all", "--max-tokens", "5"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["eval", str(trained_run), "--tasks", "piqa", "--all"]) == 2
    assert "--all goes with the held-out loss, not with --tasks" in capsys.readouterr().err


def test_the_help_names_the_default_number_of_tokens(capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", "--help"]) == 0
    assert f"{EVAL_TOKENS:,}" in " ".join(capsys.readouterr().out.split())
