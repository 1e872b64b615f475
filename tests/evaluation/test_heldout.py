"""Held-out evaluation of a run (gptlab.evaluation.heldout): `evaluation_line` from Python is what
`gptlab eval` prints, and its refusals name arguments, where the command names flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.config import SettingError
from gptlab.evaluation.heldout import evaluation_line


@pytest.mark.parametrize("extra", [[], ["--data", "text"], ["--dtype", "bfloat16", "--max-tokens", "100"]])
def test_evaluation_line_is_what_the_eval_command_prints(trained_run: Path, extra: list[str],
                                                         capsys: pytest.CaptureFixture) -> None:
    text = trained_run.parent / "text.txt"
    argv = [str(text) if arg == "text" else arg for arg in extra]
    assert main(["eval", str(trained_run), *argv]) == 0
    options = dict(zip(argv[::2], argv[1::2], strict=True))
    line = evaluation_line(trained_run, options.get("--data", "val"),
                           int(options["--max-tokens"]) if "--max-tokens" in options else None,
                           dtype=options.get("--dtype", "float32"))
    assert capsys.readouterr().out == line + "\n"
    assert "nats per token, perplexity" in line and "bits per character" in line


def test_evaluation_refusals_name_arguments_and_the_command_names_flags(
        trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SettingError, match="^dtype bfloat16 and quantize int8 both set"):
        evaluation_line(trained_run, "val", None, dtype="bfloat16", quantize="int8")
    assert main(["eval", str(trained_run), "--dtype", "bfloat16", "--quantize", "int8"]) == 2
    assert capsys.readouterr().err.startswith("gptlab: error: --dtype bfloat16 and --quantize int8 both set")
