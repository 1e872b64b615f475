"""Figures whose denominator is next to nothing are not printed as results: identical clean and corrupted
prompts are refused (in the library and in one line), pairs the model barely tells apart give no circuit
and no certificate but a sentence saying so, `--top` below 1 is refused, an SAE whose site's ablation
barely changes the loss has no "loss recovered", and a pairs file that is not UTF-8 is named with its
line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import INSPECT_TEXT
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.inspection.attribution import attribute, certify, make_pair, read_pairs
from gptlab.inspection.circuit import find_circuit
from gptlab.model import GPT
from gptlab.sae.metrics import SAEMetrics
from gptlab.text.tokenizer import tokenizer_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

LETTERS = "abcdefgh"  # token i is LETTERS[i]
CLEAN, CORRUPT, TWIN = [0, 1, 2, 0, 1], [0, 1, 3, 0, 1], [0, 1, 7, 0, 1]  # "abcab", "abdab", "abhab"
SEPARATE = "do not separate clean from corrupted"


@pytest.fixture
def blurred(random_gpt: Callable[..., GPT]) -> GPT:
    """A random model to which "h" is "c" but for 1e-3 of noise in its embedding: "abhab" barely differs."""
    model = random_gpt(0, vocab_size=8)
    with torch.no_grad():
        wte = model.transformer.wte.weight
        wte[7] = wte[2] + 1e-3 * torch.randn_like(wte[2])
    return model


@pytest.fixture
def blurred_run(blurred: GPT, tmp_path: Path, save_model: Callable[..., Path]) -> Path:
    return save_model(tmp_path / "blurred", blurred, tokenizer_from_dict({"kind": "char", "chars": LETTERS}))


def test_identical_prompts_are_refused(blurred: GPT) -> None:
    with pytest.raises(ValueError, match="clean and corrupt are the same prompt"):
        make_pair(blurred, CLEAN, list(CLEAN), target=2, foil=4)


def test_pairs_the_model_barely_separates_give_no_circuit_and_no_certificate(blurred: GPT) -> None:
    pair = make_pair(blurred, CLEAN, TWIN, target=2, foil=4)
    exact = attribute(blurred, [pair], "exact")
    assert 1e-6 < abs(exact.clean - exact.corrupt) < 1e-3  # different, but by nothing worth dividing by
    with pytest.raises(ValueError, match=SEPARATE):
        find_circuit(blurred, [pair], exact)
    with pytest.raises(ValueError, match=SEPARATE):
        certify(attribute(blurred, [pair], "eap"), exact)
    separated = make_pair(blurred, CLEAN, CORRUPT, target=2, foil=4)  # "d" is not "c": a real difference
    assert find_circuit(blurred, [separated], attribute(blurred, [separated], "exact")).faithfulness >= 0.8


def test_the_commands_refuse_or_say_so_in_one_line(blurred_run: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = str(blurred_run)
    same = ["--clean", "abcab", "--corrupt", "abcab", "--target", "c", "--foil", "e"]
    for argv, words in ((["attribute", run, *same], "--clean and --corrupt are the same prompt"),
                        (["circuit", run, *same], "--clean and --corrupt are the same prompt"),
                        (["circuit", run, "--clean", "abcab", "--corrupt", "abhab", "--target", "c", "--foil",
                          "e"], SEPARATE),
                        (["attribute", run, "--clean", "abcab", "--corrupt", "abdab", "--target", "c",
                          "--top", "-1"], "argument --top: -1 is not"),
                        (["attribute", run, "--clean", "abcab", "--corrupt", "abdab", "--target", "c",
                          "--top", "0"], "argument --top: 0 is not")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err  # progress lines, then one error line
        assert err.endswith("\n") and err.count("gptlab: error: ") == 1, err
        assert err.splitlines()[-1].startswith("gptlab: error: ") and words in err.splitlines()[-1], err
    assert main(["attribute", run, "--clean", "abcab", "--corrupt", "abhab", "--target", "c", "--foil",
                 "e"]) == 0
    out = capsys.readouterr().out
    assert SEPARATE in out and "Spearman" not in out and "nan" not in out, out


def test_a_pairs_file_not_in_utf8_is_named_with_its_line(blurred: GPT, tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"clean": "abcab", "corrupt": "abdab", "target": "c"}\n{"clean": "ab\xe9ab"}\n')
    tokenizer = tokenizer_from_dict({"kind": "char", "chars": LETTERS})
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 \(byte 0xe9 at column 14\)"):
        read_pairs(blurred, tokenizer, path)


def metrics(clean: float, spliced: float, zero: float) -> SAEMetrics:
    return SAEMetrics(tokens=100, l0=4.0, explained_variance=0.5, loss_clean=clean, loss_spliced=spliced,
                      loss_zero=zero, dead=0.0)


def test_loss_recovered_is_undefined_when_ablating_the_site_barely_changes_the_loss() -> None:
    untrained = metrics(3.0011, 2.9906, 3.0012)  # an untrained model's figures: 113.6 % before
    assert untrained.loss_recovered is None and untrained.to_dict()["loss_recovered"] is None
    assert metrics(1.78, 1.87, 4.32).loss_recovered == pytest.approx((4.32 - 1.87) / (4.32 - 1.78))


def test_sae_train_on_an_untrained_model_prints_no_loss_recovered(
        tmp_path: Path, save_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    chars = "".join(sorted(set(INSPECT_TEXT)))
    (tmp_path / "text.txt").write_text(INSPECT_TEXT, encoding="utf-8")
    model = GPT(ModelConfig(vocab_size=len(chars), n_layer=2, n_head=2, n_embd=16, block_size=24))
    run = save_model(tmp_path / "run", model, tokenizer_from_dict({"kind": "char", "chars": chars}))
    assert main(["sae", "train", str(run), "--site", "h.1.attn.out", "--out", str(tmp_path / "sae"), "--data",
                 str(tmp_path / "text.txt"), "--k", "4", "--expansion", "4", "--tokens", "2048",
                 "--batch-size", "256", "--no-progress"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "zero-ablated" in line)
    assert "loss recovered undefined: ablating the site barely changes the loss" in line and "%" not in line
