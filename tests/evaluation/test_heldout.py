"""Held-out evaluation of a run (gptlab.evaluation.heldout): `evaluation_line` from Python is what
`gptlab eval` prints, and its refusals name arguments, where the command names flags."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlab.cli import main
from gptlab.config import SettingError
from gptlab.evaluation.heldout import EVAL_TOKENS, evaluate_tokens, evaluation_line
from gptlab.model import GPT


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
    assert "(96 tokens scored, spread evenly over all of " in capsys.readouterr().out  # four windows of 24
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


def test_a_token_budget_scores_windows_spread_over_the_whole_text(random_gpt: Callable[..., GPT]) -> None:
    """A corpus read in file order is not judged by its first files: the budget's windows are spread
    evenly, here windows 0, 3 and 6 of 10, each scored as a plain forward pass would score it."""
    model = random_gpt()
    block = model.config.block_size
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 10 * block + 1)
    spread = evaluate_tokens(model, tokens, max_tokens=3 * block)
    with torch.no_grad():
        losses = [model(torch.tensor(tokens[w * block:(w + 1) * block])[None],
                        torch.tensor(tokens[w * block + 1:(w + 1) * block + 1])[None])[1] for w in (0, 3, 6)]
    assert spread.tokens == 3 * block
    assert abs(spread.loss - float(torch.stack(losses).mean())) < 1e-5
    first_three = evaluate_tokens(model, tokens[:3 * block + 1])
    assert abs(spread.loss - first_three.loss) > 1e-4
    assert evaluate_tokens(model, tokens).tokens == 10 * block  # no budget: every window
