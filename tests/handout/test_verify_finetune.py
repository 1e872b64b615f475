"""gptlab verify on fine-tuned runs (gptlab.handout.verify_finetune): every check passes on real runs made
by `gptlab finetune`, and each one fails on the bug it is for (an off-by-one mask above all)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gptlab.adapt.sft as sft
from gptlab.adapt.chat import chat_source
from gptlab.checkpoint import load_checkpoint
from gptlab.cli import main
from gptlab.handout.verify_finetune import (
    DISABLED,
    MASKS,
    MERGED,
    TEMPLATE,
    check_disabled,
    check_masks,
    check_merge,
    check_template,
    data_checks,
)
from gptlab.lora import LoraLinear
from gptlab.text.chat_template import NativeTemplate

STEPS = ["--max-steps", "2", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1",
         "--device", "cpu", "--no-progress"]


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"the {i}"}, {"role": "assistant", "content": "a cat."},
             {"role": "user", "content": "and?"}, {"role": "assistant", "content": f"the {i}."}]
            for i in range(n)]


@pytest.fixture(scope="module")
def runs(hf_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A full fine-tuning run of a bpe GPT-2 on conversations (its chat markers added), and a LoRA run on
    it: both made by `gptlab finetune`, two steps each."""
    root = tmp_path_factory.mktemp("finetuned")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(6)), encoding="utf-8")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["finetune", str(hf_run), "--data", str(data), "--out", str(root / "full"), *STEPS]) == 0
        assert main(["finetune", str(root / "full"), "--data", str(data), "--out", str(root / "lora"),
                     "--lora", "2", "--lr", "3e-2", *STEPS]) == 0
    finally:
        torch.set_num_threads(threads)
    return {"full": root / "full", "lora": root / "lora", "data": data}


def verify_rows(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    """verify's exit status and each printed row's verdict by property name."""
    capsys.readouterr()
    status = main(["verify", str(run)])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in ("PASS", "FAIL", "n/a"):
            rows[rest.split(None, 1)[1].split("  ")[0]] = verdict
    return status, rows


@pytest.fixture
def examples(hf_run: Path, tmp_path: Path) -> tuple[list[sft.Example], Any, Any]:
    """The conversations as fine-tuning builds them for the bpe GPT-2 (markers added), with its tokenizer
    and template: no training needed."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(6)), encoding="utf-8")
    source = chat_source(hf_run)
    built = sft.load_examples(data, source.tokenizer, source.template, source.block_size)
    assert len(built.examples) == 6
    return built.examples, source.tokenizer, source.template


def shifted(example: sft.Example) -> sft.Example:
    """The example with its mask one token late: the classic completion-only collator bug."""
    return dataclasses.replace(example, trained=[False, *example.trained[:-1]])


@pytest.mark.slow  # two fine-tuning runs (a module fixture), then verify on each
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_every_finetune_check_passes_on_a_correct_run(kind: str, runs: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    status, rows = verify_rows(runs[kind], capsys)
    assert status == 0
    assert rows[MASKS] == rows[TEMPLATE] == "PASS"
    expected = "PASS" if kind == "lora" else "n/a"  # a full fine-tuning run has no adapters
    assert rows[MERGED] == rows[DISABLED] == expected
    assert rows["fused projection = separate projections"] == "PASS"  # measured on the merged copy


@pytest.mark.slow
def test_an_off_by_one_mask_is_caught_by_verify(runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    build = sft.build_example
    monkeypatch.setattr(sft, "build_example", lambda *args, **kwargs: shifted(build(*args, **kwargs)))
    status, rows = verify_rows(runs["lora"], capsys)
    assert status == 1
    assert rows[MASKS] == "FAIL" and rows[TEMPLATE] == "PASS"  # the ids are right, their mask is not


def test_mask_check_counts_each_token_of_a_shifted_mask(examples: Any) -> None:
    found, tokenizer, _ = examples
    assert check_masks(found, tokenizer).passed
    wrong = check_masks([found[0], shifted(found[1])], tokenizer)
    # One token late: each assistant turn's first token is left out, and the token after the first turn's
    # end (the next <|user|>) is trained.
    assert not wrong.passed and wrong.deviation == 3 and "line 2" in wrong.note


def test_mask_check_does_not_apply_to_a_tokenizer_that_does_not_spell_its_text(examples: Any) -> None:
    found, tokenizer, _ = examples

    class Sentencepiece:  # spaces come back as ▁, as sentencepiece spells them
        def token_bytes(self, token: int) -> bytes:
            return tokenizer.token_bytes(token).replace(b" ", "▁".encode())

    check = check_masks(found, Sentencepiece())  # type: ignore[arg-type]
    assert check.passed is None and "sentencepiece" in check.note


def test_template_check_catches_ids_and_prompts_that_training_did_not_see(examples: Any) -> None:
    found, tokenizer, template = examples
    talks = {e.line: m for e, m in zip(found, conversations(6), strict=True)}
    assert check_template(found, talks, template, tokenizer).passed
    dropped = dataclasses.replace(found[2], ids=found[2].ids[:5] + found[2].ids[6:])
    check = check_template([found[0], dropped], talks, template, tokenizer)
    assert not check.passed and check.deviation == 1 and "line 3" in check.note

    class SpacedPrompt(NativeTemplate):  # chat opens the assistant's turn with a space training never saw
        def render(self, messages: Any, add_generation_prompt: bool = False) -> str:
            return super().render(messages) + ("<|assistant|> " if add_generation_prompt else "")

    check = check_template(found, talks, SpacedPrompt(), tokenizer)
    assert not check.passed and "message 2 (the assistant's)" in check.note


@pytest.mark.slow
def test_lora_checks_fail_on_a_wrong_merge_or_a_changed_base(runs: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_checkpoint(runs["lora"]).build_model().eval()
    base = load_checkpoint(runs["full"]).build_model().eval()
    idx = torch.randint(model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    eps = torch.finfo(torch.float32).eps
    with torch.no_grad():
        assert check_merge(model, idx, eps).passed and check_disabled(model, base, idx).passed
        assert (model(idx)[0] - base(idx)[0]).abs().max() > 1e-4  # the adapters do change the logits
        base.transformer.h[0].mlp.c_fc.weight[0, 0] += 1e-6
        assert not check_disabled(model, base, idx).passed
        monkeypatch.setattr(LoraLinear, "delta", lambda layer: 2 * (layer.lora_B.weight @ layer.lora_A.weight)
                            * layer.scaling)  # the update twice over
        check = check_merge(model, idx, eps)
    assert not check.passed and "likely cause" in check.note


@pytest.mark.slow
def test_data_checks_say_why_they_cannot_run(runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = load_checkpoint(runs["full"])
    for data, why in ((tmp_path / "gone.jsonl", "is not there"), (tmp_path / "changed.jsonl", "has changed")):
        if why == "has changed":
            data.write_text(runs["data"].read_text(encoding="utf-8") + "\n", encoding="utf-8")
        state = {**checkpoint.state, "sft": {**checkpoint.state["sft"], "data": str(data)}}
        found = data_checks(dataclasses.replace(checkpoint, state=state))
        assert [c.passed for c in found] == [None, None] and all(why in c.note for c in found)
