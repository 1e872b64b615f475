"""gptlab finetune and merge (gptlab.adapt.finetune): learning a task, masked loss, exact resume, LoRA runs
that save only adapters and load on their base, merged = adapted logits, early stopping, bad data."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from conftest import assert_identical_runs
from gptlab.adapt.finetune import SFTConfig, SFTData, finetune
from gptlab.checkpoint import (
    BEST,
    LAST,
    Checkpoint,
    load_checkpoint,
    model_tensors,
    save_checkpoint,
)
from gptlab.cli import main
from gptlab.config import ModelConfig, SettingError, TrainConfig
from gptlab.inference.loading import load
from gptlab.lora import LoraConfig, LoraLinear, adapters_disabled, add_lora
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer

LETTERS = "abcdefgh"
TOKENIZER = CharTokenizer(LETTERS + "=\n")


def answer(word: str) -> str:
    """The task: a word's last letter, then its first (learnable from positions, so it generalises)."""
    return word[-1] + word[0] + "\n"


def words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(n)]


def write_task(path: Path, n: int = 40, seed: int = 0, completion: Any = answer) -> Path:
    lines = [json.dumps({"prompt": w + "=", "completion": completion(w)}) for w in words(n, seed)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_base(root: Path, n_embd: int = 16, seed: int = 0) -> Path:
    """A randomly initialised char model saved as a run: the base to fine-tune."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=TOKENIZER.vocab_size, block_size=8, n_layer=2, n_head=2, n_embd=n_embd)
    model = GPT(config)
    save_checkpoint(root / "base" / BEST, Checkpoint(model.config, TOKENIZER.to_dict(), model_tensors(model)))
    return root / "base"


def steps(max_steps: int, **changes: Any) -> TrainConfig:
    settings = dict(batch_size=8, max_steps=max_steps, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                    eval_interval=max_steps, eval_batches=2, device="cpu", precision="float32", save_every=0)
    return TrainConfig(**{**settings, **changes})


def greedy(model: torch.nn.Module, prompt: str, n: int) -> str:
    """n tokens chosen by argmax, one full forward pass each (no cache: the plain reference)."""
    ids = torch.tensor([TOKENIZER.encode(prompt)])  # (1, T)
    for _ in range(n):
        logits, _ = model(ids)  # (1, T, V)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return TOKENIZER.decode(ids[0, -n:].tolist())


@pytest.mark.slow
def test_finetune_learns_a_task_and_answers_held_out_prompts(tmp_path: Path, one_thread: None) -> None:
    base, data = make_base(tmp_path, n_embd=32), write_task(tmp_path / "task.jsonl", n=60)
    result, sft, _ = finetune(base, tmp_path / "run", SFTConfig(data=str(data)),
                              steps(150, lr=1e-2, min_lr=1e-3, eval_interval=50), progress=False)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert float(rows[-1]["val_loss"]) < 0.2 * float(rows[0]["val_loss"])
    model = load(tmp_path / "run").model
    seen = {w for w in words(60, 0)}
    held_out = [w for w in words(40, seed=1) if w not in seen][:20]
    assert [greedy(model, w + "=", 3) for w in held_out] == [answer(w) for w in held_out]
    assert float(rows[-1]["val_token_accuracy"]) == 1.0 and result.step == 150
    assert len(sft.splits["val"]) == 6 and len(sft.splits["train"]) == 54


def test_loss_is_the_mean_over_trained_tokens_only(tmp_path: Path, random_gpt: Any) -> None:
    data = write_task(tmp_path / "task.jsonl", n=12)
    (tmp_path / "mixed.jsonl").write_text("".join(  # examples of different lengths, so batches are padded
        json.dumps({"prompt": "a" * (i % 4) + w + "=", "completion": answer(w)}) + "\n"
        for i, w in enumerate(words(12, 0))), encoding="utf-8")
    model = random_gpt(vocab_size=TOKENIZER.vocab_size, block_size=8)
    for path in (data, tmp_path / "mixed.jsonl"):
        sft = SFTData(SFTConfig(data=str(path)), TOKENIZER, None, 8, {})  # type: ignore[arg-type]
        inputs, targets = sft.get_batch("train", 6, 8, torch.Generator().manual_seed(0))  # (B, T)
        with torch.no_grad():
            _, loss = model(inputs, targets)
        # Naive: each example alone, unpadded; -log p of each trained token, averaged over all of them.
        total, count = 0.0, 0
        for x, y in zip(inputs, targets, strict=True):
            length = int((y != -1).nonzero().max()) + 1  # an example ends with its completion
            with torch.no_grad():
                logits, _ = model(x[None, :length])  # (1, t, V)
            logp = torch.log_softmax(logits[0].double(), dim=-1)  # (t, V)
            for t in range(length):
                if y[t] != -1:
                    total -= float(logp[t, y[t]])
                    count += 1
        assert count == 6 * 3  # each completion's two letters and its line break
        assert_close(loss.double(), torch.tensor(total / count, dtype=torch.double), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # three short runs
@pytest.mark.parametrize("lora", [None, 2])
def test_resume_from_the_same_command_line_equals_one_go(tmp_path: Path, one_thread: None,
                                                          lora: int | None) -> None:
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl")
    adapter = [] if lora is None else ["--lora", str(lora), "--lora-dropout", "0.1"]

    def command(out: str, *extra: str) -> int:
        return main(["finetune", str(base), "--data", str(data), "--out", str(tmp_path / out), "--max-steps",
                     "4", "--eval-interval", "2", "--batch-size", "4", "--device", "cpu", "--precision",
                     "float32", "--no-progress", *adapter, *extra])

    assert command("one") == 0
    assert command("two", "--stop-at", "3") == 0
    assert load_checkpoint(tmp_path / "two", prefer=LAST).state["step"] == 3
    assert command("two", "--resume") == 0
    assert_identical_runs(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow  # a short run, then three refusals
def test_resume_refuses_changed_data_and_options(tmp_path: Path, one_thread: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl")
    common = ["finetune", str(base), "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "4",
              "--eval-interval", "2", "--device", "cpu", "--no-progress"]
    assert main([*common, "--stop-at", "2"]) == 0
    capsys.readouterr()
    assert main([*common, "--resume", "--loss-on", "all", "--lr", "0.1"]) == 2
    error = capsys.readouterr().err
    assert "--loss-on (loss_on completion -> all)" in error and "--lr" in error
    assert main([*common, "--resume", "--lora", "4"]) == 2
    assert "--lora" in capsys.readouterr().err
    write_task(data, seed=5)
    assert main([*common, "--resume"]) == 2
    error = capsys.readouterr().err
    assert f"{data} has changed" in error and len(error.strip().splitlines()) == 1
    assert load_checkpoint(tmp_path / "run", prefer=LAST).state["step"] == 2  # nothing was trained


def test_bad_data_is_one_line_and_leaves_no_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl", n=5)
    with data.open("a", encoding="utf-8") as f:
        f.write('{"prompt": "abc=", "answer": "x"}\n')
    assert main(["finetune", str(base), "--data", str(data), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"gptlab: error: {data}:6: missing key 'completion' of a prompt-completion example"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_same_command_twice_just_works_and_a_changed_one_is_refused(
        tmp_path: Path, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl", n=10)
    command = ["finetune", str(base), "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "2",
               "--eval-interval", "2", "--no-progress"]
    assert main(command) == 0
    first = load_checkpoint(tmp_path / "run", prefer=LAST).model_state
    assert main(command) == 0  # repeating continues the finished run: nothing changes
    assert "already holds a fine-tuning run" in capsys.readouterr().out
    again = load_checkpoint(tmp_path / "run", prefer=LAST).model_state
    assert all(torch.equal(tensor, again[name]) for name, tensor in first.items())
    assert main([*command, "--lr", "0.5"]) == 2
    assert "would change it" in capsys.readouterr().err

@pytest.mark.slow
def test_lora_run_saves_only_adapters_and_loads_as_the_adapted_model(tmp_path: Path, one_thread: None,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       ) -> None:
    base, data = make_base(tmp_path, n_embd=64), write_task(tmp_path / "task.jsonl")
    finetune(base, tmp_path / "lora", SFTConfig(data=str(data)), steps(8, lr=1e-2, min_lr=1e-3),
             LoraConfig(r=2), progress=False)
    files = {name: (tmp_path / name / BEST).stat().st_size for name in ("base", "lora")}
    assert files["lora"] < files["base"] / 4  # adapters, their optimiser slots and state: no base weights
    saved = load_checkpoint(tmp_path / "lora")
    assert saved.model_state and all(".lora_" in name for name in saved.model_state)

    adapted = load_checkpoint(tmp_path / "lora").build_model().eval()
    plain = load_checkpoint(base).build_model().eval()
    assert any(isinstance(m, LoraLinear) for m in load(tmp_path / "lora").model.modules())
    idx = torch.tensor([TOKENIZER.encode("abc=ca\nh")])  # (1, 8)
    with torch.no_grad():
        tuned, base_logits = adapted(idx)[0], plain(idx)[0]
        with adapters_disabled(adapted):
            disabled = adapted(idx)[0]
    assert torch.equal(disabled, base_logits)  # the base is untouched and the adapters are all the change
    assert (tuned - base_logits).abs().max() > 1e-3

    assert main(["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    merged = load_checkpoint(tmp_path / "merged")
    assert not merged.state.get("lora") and "chat_template" in merged.state
    with torch.no_grad():
        merged_logits = merged.build_model().eval()(idx)[0]
    assert_close(merged_logits, tuned, rtol=1e-5, atol=1e-5)  # float32 sums in another order
    # and the same greedy answer, adapted or merged, through `gptlab sample` as a user runs it
    answers = []
    for run in ("lora", "merged"):
        capsys.readouterr()
        assert main(["sample", str(tmp_path / run), "--prompt", "abc=", "--temperature", "0",
                     "--max-new-tokens", "12", "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out)["tokens"])
    assert answers[0] == answers[1] and len(answers[0]) > 0
    capsys.readouterr()
    assert main(["merge", str(base), "--out", str(tmp_path / "again")]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()

    # The same merge again redoes its own output; a new train or finetune run there is refused.
    assert main(["merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    merged_bytes = (tmp_path / "merged" / BEST).read_bytes()
    capsys.readouterr()
    for command in (["train", "--preset", "tiny", "--data", str(data), "--max-steps", "1", "--no-progress"],
                    ["finetune", str(base), "--data", str(data), "--max-steps", "1", "--no-progress"]):
        assert main([*command, "--out", str(tmp_path / "merged")]) == 2
        assert "holds a model (best.safetensors, as import-hf and merge write)" in capsys.readouterr().err
        assert (tmp_path / "merged" / BEST).read_bytes() == merged_bytes


@pytest.mark.slow
def test_patience_stops_where_the_validation_loss_stopped_improving(tmp_path: Path, one_thread: None) -> None:
    # Completions unrelated to their prompts: the model memorises the training answers, so the validation
    # loss falls to chance and then rises.
    rng = random.Random(3)
    data = write_task(tmp_path / "noise.jsonl", n=24, completion=lambda w: rng.choice(LETTERS) * 2 + "\n")
    base = make_base(tmp_path, n_embd=32)
    result, _, _ = finetune(base, tmp_path / "run", SFTConfig(data=str(data), patience=2, val_fraction=0.25),
                            steps(600, lr=1e-2, min_lr=1e-2, eval_interval=10), progress=False)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    losses = [float(r["val_loss"]) for r in rows]
    best = losses.index(min(losses))
    assert result.step < 600 and len(rows) == best + 3  # the best, then two evaluations without a better one
    # 6 validation examples are too few to choose a best checkpoint by: best is the last one saved
    assert load_checkpoint(tmp_path / "run").state["step"] == result.step


def test_messages_on_a_model_without_chat_markers_grow_its_vocabulary(tmp_path: Path, hf_run: Path,
                                                                      one_thread: None) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"the cat sat {i}"},
                                                     {"role": "assistant", "content": "on the mat."}]}) + "\n"
                            for i in range(4)), encoding="utf-8")
    _, _, notes = finetune(hf_run, tmp_path / "lora", SFTConfig(data=str(data)), steps(2), LoraConfig(r=2),
                           progress=False)  # with LoRA, the new rows train (tests/adapt/test_chat_lora.py)
    assert "LoRA r=2 and the 4 new tokens' rows" in notes[1]
    _, _, notes = finetune(hf_run, tmp_path / "run", SFTConfig(data=str(data)), steps(2), progress=False)
    assert "<|user|>" in notes[0]
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    base_tokenizer = load(hf_run).tokenizer
    marker = tokenizer.encode_array("<|assistant|>").tolist()  # a new id, with its row in the model
    assert len(marker) == 1 and base_tokenizer.vocab_size <= marker[0] < model.config.vocab_size
    assert load_checkpoint(tmp_path / "run").state["chat_template"] == {"kind": "native"}


def test_a_lora_rank_above_the_layers_width_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl")
    out = tmp_path / "wide"
    assert main(["finetune", str(base), "--data", str(data), "--out", str(out), "--lora", "100000",
                 "--max-steps", "1", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "--lora 100000 is larger than the adapted layer" in error and error.count("\n") == 1
    assert not out.exists()
    with pytest.raises(SettingError, match=r"LoraConfig.r 100000 is larger .* choose a rank of at most"):
        add_lora(load_checkpoint(base).build_gpt(), LoraConfig(r=100000))


def test_finetune_into_a_training_run_is_refused_without_calling_it_a_fine_tuning_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, data = make_base(tmp_path), write_task(tmp_path / "task.jsonl")
    (tmp_path / "text.txt").write_text("abc=cba\n" * 200, encoding="utf-8")
    run = tmp_path / "trained"
    assert main(["train", "--preset", "tiny", "--data", str(tmp_path / "text.txt"), "--max-steps", "1",
                 "--samples", "0", "--no-progress", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["finetune", str(base), "--data", str(data), "--out", str(run), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert "already holds a fine-tuning run" not in out
    assert "is not a fine-tuning run: continue it with gptlab train --resume" in err
