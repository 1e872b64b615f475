"""export-hf and import-hf count their tensors on a bar (issue 42): a GPT-2 small takes several seconds
each way. Like every bar of gptlab's it is drawn on a terminal only: off one, or with progress=False,
stderr stays empty."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.config import ModelConfig
from gptlab.interop import huggingface
from gptlab.model import GPT
from gptlab.text.tokenizer import ByteTokenizer

GPT2_SHAPED = ModelConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=8)
LLAMA_SHAPED = ModelConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                           positions="rope", norm="rmsnorm", ffn="swiglu", tied=False, bias=False)


def on_terminal(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    monkeypatch.setattr("gptlab.interop.huggingface.on_terminal", lambda: value)


@pytest.mark.parametrize("config", [GPT2_SHAPED, LLAMA_SHAPED], ids=["gpt2", "llama"])
def test_export_and_import_count_every_tensor_on_a_terminal(
        config: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    save_checkpoint(tmp_path / "run" / BEST, Checkpoint(config, ByteTokenizer().to_dict(),
                                                         model_tensors(GPT(config)), state={"step": 0}))
    on_terminal(monkeypatch, True)
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    exported = capsys.readouterr()
    count = len(load_file(tmp_path / "hf" / "model.safetensors"))
    assert exported.out == ""
    assert "converting:   0%" in exported.err and "writing model.safetensors: 100%" in exported.err
    assert f"| {count}/{count} [" in exported.err
    huggingface.import_hf(tmp_path / "hf", tmp_path / "back")
    imported = capsys.readouterr().err
    assert "reading:   0%" in imported and f"writing {BEST}: 100%" in imported
    assert f"| {count}/{count} [" in imported


def test_no_bar_off_a_terminal_or_when_asked_for_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    save_checkpoint(tmp_path / "run" / BEST, Checkpoint(GPT2_SHAPED, ByteTokenizer().to_dict(),
                                                         model_tensors(GPT(GPT2_SHAPED)), state={"step": 0}))
    on_terminal(monkeypatch, False)
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf")
    huggingface.import_hf(tmp_path / "hf", tmp_path / "back")
    on_terminal(monkeypatch, True)
    huggingface.export_hf(tmp_path / "run", tmp_path / "hf", progress=False)
    huggingface.import_hf(tmp_path / "hf", tmp_path / "back", progress=False)
    assert capsys.readouterr().err == ""
