"""gptlab export-hf on a LoRA run (gptlab.interop.huggingface.export_adapter_run): transformers loads the
exported base and peft puts the exported adapter on it, giving the logits of the run's adapted model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer

# Looked up, not imported: importing peft costs seconds at collection, which every test run would pay.
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("transformers", "peft")),
                                reason="needs transformers and peft (gptlab[hf])")

TOKENIZER = CharTokenizer("abcdefgh=\n")
SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=2, n_head=2, n_embd=32),
    "llama": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, norm="rmsnorm", ffn="swiglu", positions="rope",
                  bias=False, tied=False),
}


def lora_run(root: Path, shape: dict[str, Any]) -> Path:
    """A random base saved as a run and a LoRA run fine-tuned on it by `gptlab finetune` (8 steps)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=TOKENIZER.vocab_size, block_size=8, **shape))
    save_checkpoint(root / "base" / BEST, Checkpoint(model.config, TOKENIZER.to_dict(), model_tensors(model)))
    data = root / "task.jsonl"
    words = ["abc", "bad", "cab", "fed", "gag", "hec", "ace", "deb"]
    lines = [json.dumps({"prompt": w + "=", "completion": w[::-1] + "\n"}) + "\n" for w in words]
    data.write_text("".join(lines), encoding="utf-8")
    assert main(["finetune", str(root / "base"), "--data", str(data), "--out", str(root / "lora"),
                 "--lora", "4", "--max-steps", "8", "--lr", "3e-2", "--batch-size", "4", "--eval-interval",
                 "8", "--eval-batches", "1", "--device", "cpu", "--no-progress"]) == 0
    return root / "lora"


@pytest.mark.slow  # a fine-tuning run, then transformers and peft
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_on_the_exported_base_gives_the_adapted_logits(family: str, tmp_path: Path, one_thread: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import transformers
    from peft import PeftModel

    run = lora_run(tmp_path, SHAPES[family])
    capsys.readouterr()
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    loader = f"transformers.AutoModelForCausalLM.from_pretrained('{tmp_path / 'hf'}')"
    adapter = tmp_path / "hf" / "adapter"
    assert f"peft.PeftModel.from_pretrained({loader}, '{adapter}')" in capsys.readouterr().out
    assert main(["export-hf", str(run), str(tmp_path / "alone"), "--adapter-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "alone").iterdir()  # and export-hf's hidden marker
                  if not p.name.startswith(".")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert main(["export-hf", str(tmp_path / "base"), str(tmp_path / "base_hf")]) == 0

    ours = load(run).model
    plain = load(tmp_path / "base").model
    x = torch.randint(TOKENIZER.vocab_size, (3, 8), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.no_grad():
        adapted, base = ours(x)[0], plain(x)[0]
        assert (adapted - base).abs().max() > 1e-3, "the adapters must matter for this test to mean anything"
        for base_dir, adapter_dir in ((tmp_path / "hf", tmp_path / "hf" / "adapter"),
                                      (tmp_path / "base_hf", tmp_path / "alone")):
            hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
            assert_close(hf_base(x).logits, base, atol=1e-5, rtol=0)  # the exported base is the base run
            theirs = PeftModel.from_pretrained(hf_base, adapter_dir).eval()(input_ids=x).logits
            assert_close(theirs, adapted, atol=1e-5, rtol=0)


def test_adapter_only_is_refused_for_a_run_without_adapters(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = GPT(ModelConfig(vocab_size=TOKENIZER.vocab_size, block_size=8, **SHAPES["gpt2"]))
    save_checkpoint(tmp_path / "base" / BEST,
                    Checkpoint(model.config, TOKENIZER.to_dict(), model_tensors(model)))
    assert main(["export-hf", str(tmp_path / "base"), str(tmp_path / "out"), "--adapter-only"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("holds no LoRA adapters (it is not a gptlab finetune --lora run): export it "
                          "without --adapter-only")
    assert not (tmp_path / "out").exists()
