"""Issue 42's last small points: a prompt longer than the context window is never dropped silently (sample,
attention and ablate read its last block_size tokens after a note on stderr; the commands that name
positions in it refuse it), and the samples `gptlab train` prints are kept in RUN/samples.txt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SAT_LINES
from gptlab.cli import main
from gptlab.cli.sample import print_samples
from gptlab.config import SamplingConfig
from gptlab.inference.loading import load

LONG = "the cat sat on the mat. a dog sat on the rug. "  # 46 characters: past trained_run's window of 24
NOTE = ("note: the prompt is 46 tokens, more than the model's context window of 24: only its last 24 are "
        "read\n")


def test_sample_reads_the_end_of_a_long_prompt_and_says_so(trained_run: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    greedy = ["--temperature", "0", "--max-new-tokens", "8", "--json"]
    assert main(["sample", str(trained_run), "--prompt", LONG, *greedy]) == 0
    long = capsys.readouterr()
    assert long.err == NOTE
    assert main(["sample", str(trained_run), "--prompt", LONG[-24:], *greedy]) == 0
    end = capsys.readouterr()
    assert end.err == ""  # a prompt that fits: no note
    assert json.loads(long.out)["completion"] == json.loads(end.out)["completion"]


@pytest.mark.slow
def test_attention_and_ablate_read_the_end_the_position_commands_refuse(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attention", str(trained_run), "--prompt", LONG, "--out", str(tmp_path / "a.png")]) == 0
    drawn = capsys.readouterr()
    assert drawn.err == NOTE and "over 24 tokens" in drawn.out
    ablate = ["ablate", str(trained_run), "--target", " ", "--out", str(tmp_path / "b.png"), "--force"]
    assert main([*ablate, "--prompt", LONG]) == 0
    long = capsys.readouterr()
    assert long.err == NOTE
    assert main([*ablate, "--prompt", LONG[-24:]]) == 0
    assert capsys.readouterr().out == long.out  # the same table: the same 24 tokens were read
    for command in (["lens", "--out", str(tmp_path / "l.png")], ["intervene", "--drop", "0"]):
        assert main([command[0], str(trained_run), "--prompt", LONG, *command[1:]]) == 2
        assert "--prompt is 46 tokens but the model sees at most block_size=24" in capsys.readouterr().err


def test_print_samples_saves_what_it_printed(trained_run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for as_json in (False, True):
        print_samples(load(trained_run), "the ", 2, SamplingConfig(seed=0, max_new_tokens=12),
                      as_json=as_json, save=tmp_path / "samples.txt")
        assert (tmp_path / "samples.txt").read_text(encoding="utf-8") == capsys.readouterr().out


@pytest.mark.slow  # trains 4 steps through the command, twice
def test_train_keeps_its_samples_in_the_run_folder_and_writes_them_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("\n".join(SAT_LINES * 20), encoding="utf-8")
    run = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--data", str(text), "--out", str(run), "--max-steps", "4",
            "--eval-interval", "4", "--eval-batches", "1", "--samples", "2", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    printed = out[out.index("--- sample 1 ---"):].splitlines(keepends=True)
    assert printed[-1] == f"(these samples are saved in {run / 'samples.txt'})\n"
    assert (run / "samples.txt").read_text(encoding="utf-8") == "".join(printed[:-1])
    (run / "samples.txt").write_text("changed by hand\n", encoding="utf-8")
    assert main(argv) == 0  # the same command again: not refused, the samples written again
    capsys.readouterr()
    assert (run / "samples.txt").read_text(encoding="utf-8") == "".join(printed[:-1])
