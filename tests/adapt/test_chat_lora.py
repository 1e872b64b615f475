"""LoRA chat fine-tuning of a model whose tokenizer lacks the chat markers (issue 42, point 1): the markers
become new ids, and only their embedding (and untied head) rows train beside the adapters
(gptlab.lora.add_trainable_tokens); the rows are saved with the adapters and restored wherever the run is
loaded, merged or exported."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_peft import SHAPES
from torch.testing import assert_close

from conftest import assert_identical_runs, tiny_chat_runs
from gptlab.adapt.chat import add_chat_tokens, token_ids
from gptlab.checkpoint import (
    BEST,
    LAST,
    Checkpoint,
    load_checkpoint,
    model_tensors,
    save_checkpoint,
)
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.handout.verify_finetune import lora_checks
from gptlab.inference.loading import load
from gptlab.lora import (
    LoraConfig,
    TokenRowsEmbedding,
    TokenRowsHead,
    adapters_disabled,
    add_lora,
    add_trainable_tokens,
    grow_embeddings,
    load_lora_state,
    lora_state,
    merge_lora,
    trainable_parameters,
)
from gptlab.model import GPT
from gptlab.text.chat_template import NativeTemplate
from gptlab.text.tokenizer import CharTokenizer
from gptlab.training.presets import PRESETS

WORDS = ["cat", "dog", "sun", "sea", "hat", "cup", "red", "toe", "bee", "ant"]
CHATS = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}] for w in WORDS]


def short_run(steps: int, every: int) -> list[str]:
    """`gptlab finetune` options of a short CPU run of `steps` steps, evaluated `every` steps."""
    return ["--max-steps", str(steps), "--lr", "3e-2", "--batch-size", "4", "--eval-interval", str(every),
            "--eval-batches", "1", "--device", "cpu", "--no-progress"]


def grown_model(tied: bool) -> tuple[GPT, list[int]]:
    """A tiny random model of 12 ids grown by 3 new ones (rows the mean of the old), and their ids."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, n_embd=8, tied=tied))
    return grow_embeddings(model, [12, 13, 14], mean_of=12).eval(), [12, 13, 14]


@pytest.mark.parametrize("tied", [True, False])
def test_only_the_new_rows_train_and_merging_folds_them_in(tied: bool) -> None:
    base, ids = grown_model(tied)
    model = add_trainable_tokens(add_lora(copy.deepcopy(base), LoraConfig(r=2)), ids)
    x = torch.tensor([[1, 12, 5, 13, 14, 0]])  # (1, T), old and new ids
    with torch.no_grad():
        assert_close(model(x)[0], base(x)[0], rtol=0, atol=1e-6)  # a fresh adapter changes nothing
    lora = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    assert trainable_parameters(model) == lora + (1 if tied else 2) * 3 * 8  # N new rows of D, once if tied

    frozen = {name: t.clone() for name, t in model.state_dict().items() if not name.endswith("token_rows")}
    trained = [p for p in model.parameters() if p.requires_grad]
    for _ in range(3):  # plain gradient descent (torch.optim's first use costs seconds of imports)
        model(x, torch.tensor([[12, 5, 13, 14, 0, 3]]))[1].backward()
        assert model.transformer.wte.weight.grad is None and model.lm_head.weight.grad is None
        with torch.no_grad():
            for p in trained:
                p -= 0.5 * p.grad
                p.grad = None
    after = model.state_dict()
    assert all(torch.equal(after[name], t) for name, t in frozen.items() if ".lora_" not in name)
    assert not torch.equal(model.transformer.wte.token_rows, frozen["transformer.wte.weight"][ids])

    restored = add_trainable_tokens(add_lora(copy.deepcopy(base), LoraConfig(r=2)), ids)
    saved = lora_state(model)
    assert {"transformer.wte.token_rows", *([] if tied else ["lm_head.token_rows"])} <= set(saved)
    load_lora_state(restored, saved)
    with torch.no_grad():
        tuned = model(x)[0]
        assert torch.equal(restored(x)[0], tuned)
        with adapters_disabled(model):
            assert torch.equal(model(x)[0], base(x)[0])  # disabled: the grown base, bit for bit
        merged = merge_lora(copy.deepcopy(model))
        assert not any(isinstance(m, TokenRowsEmbedding | TokenRowsHead) for m in merged.modules())
        assert (merged.lm_head.weight is merged.transformer.wte.weight) == tied
        assert_close(merged(x)[0], tuned, rtol=1e-5, atol=1e-5)
        assert torch.equal(merged.transformer.wte.weight[:12], base.transformer.wte.weight[:12])


def test_new_rows_beside_an_adapter_on_the_head_are_refused() -> None:
    model, ids = grown_model(tied=False)
    add_lora(model, LoraConfig(r=2, targets=("lm_head",)))
    with pytest.raises(ValueError, match="leave lm_head out of the LoRA targets"):
        add_trainable_tokens(model, ids)


def test_on_the_demo_shape_lora_8_trains_the_adapters_and_the_four_markers_rows() -> None:
    tokenizer = CharTokenizer("".join(chr(c) for c in range(32, 97)))  # 65 characters, as shakespeare's
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, **PRESETS["demo"]["model"]))
    model, chat = add_chat_tokens(model, tokenizer, NativeTemplate())
    add_trainable_tokens(add_lora(model, LoraConfig(r=8)), token_ids(chat, NativeTemplate.special_tokens))
    assert trainable_parameters(model) == 65_536 + 4 * 128 == 66_048  # as docs/finetune.md says
    assert sum(p.numel() for p in model.parameters()) == 876_416


# ---------------------------------------------------------------------------------------------
# A char run, chat-tuned with --lora 8 through the command line


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny char run (3 steps of `gptlab train`) and a `finetune --lora 8` run of it on conversations
    (both about 2 s on one thread, shared by the tests below)."""
    root = tmp_path_factory.mktemp("chat_lora")
    tiny_chat_runs(root, " ".join(f"say {w}, {w}." for w in WORDS) * 40 + "\n", CHATS,
                   ["--lora", "8", *short_run(12, 12)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs were made: the tests below compare against them
    try:
        yield root
    finally:
        torch.set_num_threads(threads)


def test_the_run_saves_the_new_rows_and_loads_with_them(runs: Path) -> None:
    saved = load_checkpoint(runs / "lora")
    lm = load(runs / "base")
    base, base_tokenizer = lm.model, lm.tokenizer
    old = base_tokenizer.vocab_size
    assert saved.tokenizer["specials"] == list(NativeTemplate.special_tokens)  # the grown tokenizer
    assert saved.state["lora"]["new_rows"] == {"ids": [old, old + 1, old + 2, old + 3], "mean_of": old}
    assert set(saved.model_state) == {*(n for n in saved.model_state if ".lora_" in n),
                                      "transformer.wte.token_rows"}  # tied: no head rows of its own
    lm = load(runs / "lora")
    model, tokenizer = lm.model, lm.tokenizer
    assert isinstance(model.transformer.wte, TokenRowsEmbedding) and tokenizer.vocab_size == old + 4
    wte = model.transformer.wte
    assert torch.equal(wte.weight[:old], base.transformer.wte.weight)  # old rows bit-identical
    mean = base.transformer.wte.weight.mean(0)
    assert all((wte.token_rows[i] - mean).abs().max() > 1e-3 for i in range(4))  # every new row trained
    x = torch.tensor([tokenizer.encode("say cat")])  # (1, T): old ids only
    with torch.no_grad():
        assert torch.equal(wte(x), base.transformer.wte(x))


def test_chat_sample_merge_and_verify_use_the_trained_rows(runs: Path, capsys: pytest.CaptureFixture[str],
                                                           ) -> None:
    capsys.readouterr()
    assert main(["chat", str(runs / "lora"), "--message", "say cat", "--temperature", "0",
                 "--max-new-tokens", "6", "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["turn"] == 1 and isinstance(reply["reply"], str)
    prompt = NativeTemplate().render(CHATS[0][:1], add_generation_prompt=True)
    answers = []
    assert main(["merge", str(runs / "lora"), "--out", str(runs / "merged")]) == 0
    for run in ("lora", "merged"):
        capsys.readouterr()
        assert main(["sample", str(runs / run), "--prompt", prompt, "--temperature", "0",
                     "--max-new-tokens", "8", "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out)["tokens"])
    assert answers[0] == answers[1] and answers[0]

    lm = load(runs / "lora")

    adapted, tokenizer = lm.model, lm.tokenizer
    lm = load(runs / "merged")
    merged, merged_tokenizer = lm.model, lm.tokenizer
    assert merged_tokenizer.to_dict() == tokenizer.to_dict()
    x = torch.tensor([tokenizer.encode(NativeTemplate().render(CHATS[1]))[:32]])  # (1, T) with markers
    with torch.no_grad():
        assert_close(merged(x)[0], adapted(x)[0], rtol=1e-5, atol=1e-5)
    base_weight = load(runs / "base").model.transformer.wte.weight
    assert torch.equal(merged.transformer.wte.weight[:base_weight.size(0)], base_weight)
    with torch.no_grad():
        found = lora_checks(adapted, load_checkpoint(runs / "lora").state, x, torch.finfo(torch.float32).eps)
    assert [check.passed for check in found] == [True, True], found


def test_an_int8_lora_run_keeps_its_adapters(runs: Path) -> None:
    """int8 replaces every linear layer: a LoRA run is merged first, so its adapters and rows still act."""
    from gptlab.inference.quantize import Int8Linear

    lm = load(runs / "lora")

    adapted, tokenizer = lm.model, lm.tokenizer
    quantised = load(runs / "lora", quantize="int8").model
    assert not any(".lora_" in name for name, _ in quantised.named_parameters())
    assert any(isinstance(m, Int8Linear) for m in quantised.modules())
    x = torch.tensor([tokenizer.encode(NativeTemplate().render(CHATS[1]))[:32]])  # (1, T) with markers
    with torch.no_grad():
        want, got = adapted(x)[0], quantised(x)[0]
        assert (got - want).abs().max() < 0.1 * (want - want.mean()).abs().max()  # int8's error only


@pytest.mark.slow
def test_export_hf_writes_the_markers_and_refuses_the_adapter_alone(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    assert main(["export-hf", str(runs / "lora"), str(runs / "hf")]) == 0
    tokenizer = load(runs / "lora").tokenizer
    hf = AutoTokenizer.from_pretrained(runs / "hf")
    text = NativeTemplate().render(CHATS[2], add_generation_prompt=True)
    assert hf.encode(text) == tokenizer.encode(text) and hf.decode(tokenizer.encode(text)) == text
    capsys.readouterr()
    assert main(["export-hf", str(runs / "lora"), str(runs / "alone"), "--adapter-only"]) == 2
    error = capsys.readouterr().err
    assert "trains the rows of 4 tokens the run added" in error and "without --adapter-only" in error
    assert not (runs / "alone").exists()


@pytest.mark.slow  # a short run, then transformers and peft
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_on_the_exported_run_gives_the_adapted_logits(family: str, tmp_path: Path,
                                                           one_thread: None) -> None:
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel

    tokenizer = CharTokenizer.train(" ".join(f"say {w}" for w in WORDS) + "\n")
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=32, **SHAPES[family]))  # llama untied
    weights = model_tensors(model)
    save_checkpoint(tmp_path / "base" / BEST, Checkpoint(model.config, tokenizer.to_dict(), weights))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS), "utf-8")
    assert main(["finetune", str(tmp_path / "base"), "--data", str(chats), "--out", str(tmp_path / "lora"),
                 "--lora", "4", *short_run(12, 12)]) == 0
    assert main(["export-hf", str(tmp_path / "lora"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    new_ids = list(range(tokenizer.vocab_size, tokenizer.vocab_size + 4))
    heads = {"gpt2": ["transformer.wte"], "llama": ["lm_head", "model.embed_tokens"]}[family]
    assert config["trainable_token_indices"] == {name: new_ids for name in heads}

    lm = load(tmp_path / "lora")

    adapted, grown = lm.model, lm.tokenizer
    wte = adapted.transformer.wte
    assert isinstance(wte, TokenRowsEmbedding)
    assert (wte.token_rows - wte.weight[new_ids]).abs().max() > 1e-3  # the rows PEFT must apply trained
    x = torch.tensor([grown.encode(NativeTemplate().render(CHATS[3]))[:32]])  # (1, T), markers included
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = PeftModel.from_pretrained(hf_base, tmp_path / "hf" / "adapter").eval()
    with torch.no_grad():
        assert_close(theirs(input_ids=x).logits, adapted(x)[0], rtol=0, atol=1e-5)


@pytest.mark.slow  # three short runs
def test_a_resumed_run_equals_one_go(runs: Path, tmp_path: Path, one_thread: None) -> None:
    def command(out: str, *extra: str) -> int:
        return main(["finetune", str(runs / "base"), "--data", str(runs / "chats.jsonl"), "--out",
                     str(tmp_path / out), "--lora", "2", *short_run(4, 2), *extra])

    assert command("one") == 0
    assert command("two", "--stop-at", "3") == 0
    assert command("two", "--resume") == 0
    assert_identical_runs(tmp_path / "one", tmp_path / "two")  # token_rows and their AdamW slots included
    assert "transformer.wte.token_rows" in load_checkpoint(tmp_path / "one", prefer=LAST).optimizer_state
