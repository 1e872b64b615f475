"""`gptlab.load(run) -> LM`, the one way in (issue 53): from Python it gives what the commands print,
token for token, and every command that runs a model reads the run's checkpoint once (an adapter run:
twice, adapters then base)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import gptlab
import gptlab.checkpoint
from conftest import tiny_chat_runs
from gptlab.cli import main
from gptlab.inference.conversation import Conversation
from gptlab.inference.lm import LM
from gptlab.lora import LoraLinear

TEXT = "ROMEO: say cat, sun, hat. JULIET: say dog, sea, cup, true or false. " * 60 + "\n"
CHATS = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
         for w in ("cat", "dog", "sun", "sea", "hat", "cup")]
PROMPT, TOKENS = "ROMEO:", 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny char run (3 steps of `gptlab train`) and a `finetune --lora 8` chat run of it (about 2 s)."""
    root = tmp_path_factory.mktemp("load")
    tiny_chat_runs(root, TEXT, CHATS, ["--lora", "8", "--max-steps", "12", "--lr", "3e-2", "--batch-size",
                                       "4", "--eval-interval", "12", "--eval-batches", "1", "--no-progress"])
    return root


def sampled(run: Path, capsys: pytest.CaptureFixture[str], *options: str) -> str:
    """What `gptlab sample RUN --prompt ROMEO: --max-new-tokens 20 --temperature 0` prints after the
    prompt."""
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--temperature",
                 "0", *options]) == 0
    out = capsys.readouterr().out
    head = f"--- sample 1 ---\n{PROMPT}"
    assert out.startswith(head) and out.endswith("\n")
    return out[len(head):-1]


@pytest.mark.parametrize(("run", "quantize"), [("base", "none"), ("lora", "none"), ("lora", "int8"),
                                               ("base", "int8")])
def test_generate_equals_gptlab_sample_token_for_token(runs: Path, run: str, quantize: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    lm = gptlab.load(runs / run, quantize=quantize)
    text = lm.generate(PROMPT, max_new_tokens=TOKENS, temperature=0)
    assert text == sampled(runs / run, capsys, "--quantize", quantize)
    assert len(lm.encode(text)) == TOKENS  # a char model never ends early here: all 20 tokens compared


def test_an_int8_lora_run_keeps_its_adapters_merged(runs: Path) -> None:
    """int8 replaces every linear layer, so the adapters are merged first: the output is the merged
    model's, not the base's."""
    lora, base = gptlab.load(runs / "lora", quantize="int8"), gptlab.load(runs / "base", quantize="int8")
    unmerged = gptlab.load(runs / "lora")
    assert any(isinstance(m, LoraLinear) for m in unmerged.model.modules())
    assert not any(isinstance(m, LoraLinear) for m in lora.model.modules())
    ids = torch.tensor([lora.encode("say cat")])
    with torch.no_grad():
        adapted = unmerged.model(ids)[0]
        assert (lora.model(ids)[0] - adapted).abs().max() < 0.1  # int8 weights and bfloat16 activations
        grown_base = base.model(ids)[0]
    old = base.tokenizer.vocab_size  # the chat markers' rows are new in the fine-tuned run
    assert (grown_base[..., :old] - adapted[..., :old]).abs().max() > 0.1


def test_stream_joins_to_generate_for_the_same_seed(runs: Path) -> None:
    lm = gptlab.load(runs / "base")
    pieces = list(lm.stream(PROMPT, max_new_tokens=TOKENS, temperature=0.8, seed=7))
    assert len(pieces) > 1 and "".join(pieces) == lm.generate(PROMPT, max_new_tokens=TOKENS, temperature=0.8,
                                                               seed=7)
    assert lm.generate(PROMPT, max_new_tokens=TOKENS, seed=8) != lm.generate(PROMPT, max_new_tokens=TOKENS,
                                                                              seed=7)


def test_chat_equals_gptlab_chat(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lm = gptlab.load(runs / "lora")
    reply = lm.chat([{"role": "user", "content": "say cat"}], temperature=0, max_new_tokens=30)
    capsys.readouterr()
    assert main(["chat", str(runs / "lora"), "--message", "say cat", "--temperature", "0",
                 "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out == reply + "\n"
    conversation = Conversation(lm, lm.sampling(temperature=0, max_new_tokens=30))
    assert "".join(chunk.text for chunk in conversation.reply("say cat")) == reply
    assert [m["role"] for m in conversation.messages] == ["user", "assistant"]


def test_chat_on_a_run_without_a_template_is_gptlab_chats_refusal(runs: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="not fine-tuned for chat") as refused:
        gptlab.load(runs / "base").chat([{"role": "user", "content": "say cat"}])
    capsys.readouterr()
    assert main(["chat", str(runs / "base"), "--message", "say cat"]) == 2
    assert capsys.readouterr().err == f"gptlab: error: {refused.value}\n"


def test_structured_output_from_python(runs: Path) -> None:
    pytest.importorskip("llguidance")
    lm = gptlab.load(runs / "base")
    assert lm.generate("say ", choice=["cat", "dog"], temperature=0) in ("cat", "dog")
    assert re.fullmatch("c[a-z]t", lm.generate("say ", regex="c[a-z]t", temperature=0.8))
    value = json.loads(lm.generate("say ", json_schema={"type": "boolean"}, temperature=0, max_new_tokens=8))
    assert isinstance(value, bool)


def test_from_model_repr_and_a_seq2seq_run(runs: Path, tmp_path: Path) -> None:
    lm = gptlab.load(runs / "base")
    alike = LM.from_model(lm.model, lm.tokenizer)
    assert alike.generate(PROMPT, max_new_tokens=5, temperature=0) == lm.generate(PROMPT, max_new_tokens=5,
                                                                                    temperature=0)
    assert alike.defaults == {} and alike.header is None
    shown = repr(lm)
    assert shown.startswith("LM(") and "char tokenizer" in shown and f"from {runs / 'base'}" in shown
    assert main(["seq2seq", "train", "--task", "reverse", "--max-steps", "1", "--no-progress",
                 "--out", str(tmp_path / "s2s")]) == 0
    with pytest.raises(ValueError, match="gptlab seq2seq"):
        gptlab.load(tmp_path / "s2s")


def test_attention_renders_inline_offline_and_saves(runs: Path, tmp_path: Path) -> None:
    view = gptlab.load(runs / "base").attention("ROMEO: say")
    shown = view._repr_html_()
    assert shown.startswith("<iframe srcdoc=") and "http://" not in shown and "https://" not in shown
    assert view.save(tmp_path / "a.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert view.save(tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match=r"\.html"):
        view.save(tmp_path / "a.txt")


# Checkpoint reads: every call of checkpoint._read (a header or a whole file) is one.
@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = gptlab.checkpoint._read

    def counted(path: str | Path, prefer: str, read: str) -> gptlab.checkpoint.Checkpoint:
        seen.append(f"{path}:{read}")
        return real(path, prefer, read)

    monkeypatch.setattr(gptlab.checkpoint, "_read", counted)
    return seen


@pytest.mark.parametrize(("run", "expected"), [("base", 1), ("lora", 2)])
def test_each_command_reads_the_checkpoint_once(runs: Path, run: str, expected: int, reads: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    gptlab.load(runs / run)
    assert len(reads) == expected, reads
    reads.clear()
    sampled(runs / run, capsys)
    assert len(reads) == expected, reads
    reads.clear()
    assert main(["chat", str(runs / run), "--message", "say cat", "--max-new-tokens", "3"]) == (
        0 if run == "lora" else 2)
    assert len(reads) == expected, reads
    reads.clear()
    pytest.importorskip("fastapi")
    from gptlab.serve.server import app_for_run

    app_for_run(runs / run, max_batch=2)
    assert len(reads) == expected, reads


def test_a_hugging_face_folder_loads_in_memory_as_transformers_runs_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_head=2, n_layer=2)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    from gptlab.interop.hf_tokenizer import hf_tokenizer_json
    from gptlab.text.tokenizer import ByteTokenizer

    tokenizer = hf_tokenizer_json(ByteTokenizer().to_dict())
    (tmp_path / "gpt2" / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    before = sorted(p.name for p in (tmp_path / "gpt2").iterdir())
    lm = gptlab.load(tmp_path / "gpt2")
    assert sorted(p.name for p in (tmp_path / "gpt2").iterdir()) == before  # nothing written
    ids = torch.tensor([lm.encode("ROMEO: and")])
    with torch.no_grad():
        assert (lm.model(ids)[0] - hf(ids).logits).abs().max() < 1e-5
    greedy = hf.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)[0, ids.size(1):]
    assert lm.generate("ROMEO: and", max_new_tokens=TOKENS, temperature=0) == lm.decode(greedy.tolist())
    assert lm.generate(PROMPT, max_new_tokens=TOKENS, temperature=0) == sampled(tmp_path / "gpt2", capsys)
