"""`gptlab sae train`: the figures printed, the same command twice, and its mistakes as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--site", "h.1.resid_post", "--k", "4", "--expansion", "4", "--tokens", "2048",
         "--batch-size", "256", "--no-progress"]


def test_train_prints_the_figures_and_twice_trains_nothing(trained_run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sae"
    assert main(["sae", "train", str(trained_run), "--out", str(out), *SMALL]) == 0
    first = capsys.readouterr().out.splitlines()
    assert first[0].startswith("64 features at h.1.resid_post, k = 4: trained on 2,048 tokens in ")
    metrics = json.loads((out / "sae.json").read_text())["metrics"]
    assert f"  explained variance              {metrics['explained_variance']:.3f}" in first
    assert any(line.startswith("  next-token loss (nats): clean ") for line in first)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "cfg.json", "features.html", "sae.json", "sae_weights.safetensors", "training.safetensors"]
    assert main(["sae", "train", str(trained_run), "--out", str(out), *SMALL]) == 0
    again = capsys.readouterr().out.splitlines()
    assert again[0] == (f"64 features at h.1.resid_post, k = 4: nothing to train: {out} holds this SAE, "
                        "trained on 2,048 tokens")
    assert again[1:] == first[1:]


def test_mistakes_are_one_line(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sae"
    assert main(["sae", "train", str(trained_run), "--out", str(out), *SMALL]) == 0
    capsys.readouterr()
    calls = {
        "--k": ([*SMALL, "--k", "8"], f"{out} holds an SAE trained with --k 4, not 8: give the same settings "
                "to continue it, or choose another --out (nothing in it was changed)"),
        "both": ([*SMALL, "--width", "64"], "give --width (features) or --expansion (features per "
                 "dimension), not both"),
        "site": ([*SMALL[:-1], "--site", "h.7.resid_post"], "unknown hook point 'h.7.resid_post'"),
    }
    for name, (options, message) in calls.items():
        assert main(["sae", "train", str(trained_run), "--out", str(out), *options]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"gptlab: error: {message}"), err
