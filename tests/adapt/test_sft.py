"""Fine-tuning data: JSONL shapes, loss masks checked independently, bad data, `gptlab masks`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gptlab.adapt.chat import chat_template_for, tokenizer_with_tokens
from gptlab.adapt.sft import collate, load_examples, mask_problems, next_token_pairs
from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.text.chat_template import NativeTemplate
from gptlab.text.tokenizer import BPETokenizer, CharTokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "chat-templates"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "on the mat."}]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    """A small bpe tokenizer with the native template's markers (and an end-of-text token)."""
    trained = BPETokenizer.train("the cat sat on the mat.\nHello there, how are you?\n" * 30, 300)
    return tokenizer_with_tokens(trained, NativeTemplate.special_tokens)


def write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                    encoding="utf-8")
    return path


def test_prompt_completion_mask_matches_separate_tokenisation(bpe: BPETokenizer, tmp_path: Path) -> None:
    pairs = [("Q: the cat?\n", "A: sat on the mat."), ("Hello", " there")]
    data = load_examples(write(tmp_path / "d.jsonl", [{"prompt": p, "completion": c} for p, c in pairs]),
                         bpe, None, block_size=64)
    for example, (prompt, completion) in zip(data.examples, pairs, strict=True):
        p, c = bpe.encode(prompt), bpe.encode(completion) + [bpe.eot_id]  # each part on its own
        assert example.ids == p + c
        assert example.trained == [False] * len(p) + [True] * len(c)  # the end-of-text token trained too
        assert mask_problems(example, bpe) == []
    assert data.counts["trained"] == sum(len(bpe.encode(c)) + 1 for _, c in pairs)


def test_messages_mask_marks_assistant_turns_and_their_end(bpe: BPETokenizer, tmp_path: Path) -> None:
    data = load_examples(write(tmp_path / "d.jsonl", [{"messages": CHAT}]), bpe, NativeTemplate(), 64)
    (example,) = data.examples
    # Independent construction: each turn tokenised on its own (markers are single ids, so none merge).
    ids, trained = [], []
    for m in CHAT:
        if m["role"] == "assistant":
            opener = bpe.encode("<|assistant|>\n")
            ids += opener + bpe.encode(m["content"] + "<|end|>\n")
            trained += [False] * len(opener) + [True] * (len(ids) - len(trained) - len(opener))
        else:
            turn = bpe.encode(f"<|{m['role']}|>\n{m['content']}<|end|>\n")
            ids, trained = ids + turn, trained + [False] * len(turn)
    assert example.ids == ids and example.trained == trained
    end = bpe.encode("<|end|>")[0]
    ends = [t for t, i in zip(example.trained, example.ids, strict=True) if i == end]
    assert ends == [False, False, True, False, True]  # system, user, assistant, user, assistant
    assert mask_problems(example, bpe) == []


@pytest.mark.parametrize("shift", [1, -1])
def test_an_off_by_one_mask_is_caught(bpe: BPETokenizer, tmp_path: Path, shift: int) -> None:
    records = [{"messages": CHAT}]
    (example,) = load_examples(write(tmp_path / "d.jsonl", records), bpe, NativeTemplate(), 64).examples
    t = example.trained
    example.trained = [False] + t[:-1] if shift == 1 else t[1:] + [False]
    problems = mask_problems(example, bpe)
    assert problems and all(p.startswith("line 1: token") for p in problems)


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared chat templates are not in this checkout")
def test_chatml_template_masks(bpe: BPETokenizer, tmp_path: Path) -> None:
    """SmolLM2's ChatML (with its default system turn): trained spans check out by bytes."""
    template = chat_template_for(json.loads((SHARED / "smollm2-instruct.json").read_text(encoding="utf-8")))
    tokenizer = tokenizer_with_tokens(bpe, ["<|im_start|>", "<|im_end|>"])
    data = load_examples(write(tmp_path / "d.jsonl", [{"messages": CHAT[1:]}]), tokenizer, template, 256)
    (example,) = data.examples
    assert mask_problems(example, tokenizer) == []
    spans = [example.text.encode()[a:b].decode() for a, b in example.spans]
    assert spans == ["the cat sat<|im_end|>\n", "on the mat.<|im_end|>\n"]


def test_loss_on_all_and_text(bpe: BPETokenizer, tmp_path: Path) -> None:
    data = load_examples(write(tmp_path / "d.jsonl", [{"messages": CHAT}]), bpe, NativeTemplate(), 64,
                         loss_on="all")
    assert data.examples[0].trained == [False] + [True] * (len(data.examples[0].ids) - 1)
    text = load_examples(write(tmp_path / "t.jsonl", [{"text": "the mat."}]), bpe, None, 64).examples[0]
    assert text.ids == bpe.encode("the mat.") + [bpe.eot_id] and mask_problems(text, bpe) == []


def test_too_long_examples_are_skipped_or_truncated(bpe: BPETokenizer, tmp_path: Path) -> None:
    short = {"prompt": "Hello", "completion": " there"}
    long = {"prompt": "the cat sat on the mat.\n", "completion": "Hello there, how are you?\n" * 3}
    path = write(tmp_path / "d.jsonl", [short, long, short])
    skipped = load_examples(path, bpe, None, block_size=12)
    assert len(skipped.examples) == 2 and skipped.skipped_too_long == 1 and "1 skipped" in skipped.summary()
    cut = load_examples(path, bpe, None, block_size=12, too_long="truncate")
    assert cut.truncated == 1 and [len(e.ids) for e in cut.examples] == [3, 13, 3]
    assert cut.examples[1].ids == bpe.encode(long["prompt"] + long["completion"])[:13]


def test_a_prefix_that_merges_with_its_continuation_is_an_error(bpe: BPETokenizer, tmp_path: Path) -> None:
    assert len(bpe.encode(" cat")) == 1  # so "the ca" + "t sat" cannot split where the prompt ends
    path = write(tmp_path / "d.jsonl", [{"prompt": "the ca", "completion": "t sat"}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: .* not a prefix"):
        load_examples(path, bpe, None, 64)


BAD = {
    "not JSON": ('{"text": "a"', "not JSON"),
    "not an object": ('["a"]', "not an object"),
    "missing key": ({"prompt": "a"}, "missing key 'completion'"),
    "extra key": ({"prompt": "a", "completion": "b", "id": 3}, "unexpected key 'id'"),
    "no known key": ({"input": "a"}, "none of the shapes"),
    "role order": ({"messages": [{"role": "assistant", "content": "a"}]},
                   "message 1 is assistant where user"),
    "two users": ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                  "message 2 is user where assistant"),
    "empty assistant": ({"messages": [{"role": "user", "content": "a"},
                                      {"role": "assistant", "content": ""}]},
                        "message 2 \\(assistant\\) is empty"),
    "ends with user": ({"messages": [{"role": "user", "content": "a"}]},
                       "last message must be the assistant"),
    "empty completion": ({"prompt": "a", "completion": ""}, "completion is empty"),
    "mixed shapes": ({"text": "a"}, "a text example, but line 1 is prompt-completion"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_data_is_one_line_naming_file_and_line(bpe: BPETokenizer, tmp_path: Path, case: str) -> None:
    record, reason = BAD[case]
    good = {"prompt": "Hello", "completion": " there"}
    path = write(tmp_path / "bad.jsonl", [good, "", record, good])  # the bad one is on line 3
    pattern = f"^{re.escape(str(path))}:3: (the |a JSON list, |keys .* are )?{reason}"
    with pytest.raises(ValueError, match=pattern) as err:
        load_examples(path, bpe, NativeTemplate(), 64)
    assert "\n" not in str(err.value)


def test_pairs_and_batches_follow_the_trainers_convention(bpe: BPETokenizer, tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", [{"prompt": "Hello", "completion": " there"},
                                        {"prompt": "the cat sat\n", "completion": "on the mat."}])
    examples = load_examples(path, bpe, None, 64).examples
    inputs, targets = collate(examples)  # (B, T)
    for row, e in enumerate(examples):
        expected = [e.ids[i + 1] if e.trained[i + 1] else -1 for i in range(len(e.ids) - 1)]  # naive
        x, y = next_token_pairs(e)
        assert x.tolist() == e.ids[:-1] and y.tolist() == expected
        assert targets[row].tolist() == expected + [-1] * (targets.size(1) - len(expected))
        assert inputs[row, :len(x)].tolist() == x.tolist()
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=bpe.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():  # padding changes nothing: the batch loss is the mean over every trained target
        losses = [torch.nn.functional.cross_entropy(model(x[None])[0][0], y, ignore_index=-1, reduction="sum")
                  for x, y in map(next_token_pairs, examples)]
        torch.testing.assert_close(model(inputs, targets)[1], sum(losses) / (targets >= 0).sum())


def test_masks_command_off_a_terminal(bpe: BPETokenizer, tmp_path: Path, capsys) -> None:
    config = ModelConfig(vocab_size=bpe.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)
    save_checkpoint(tmp_path / BEST, Checkpoint(config, bpe.to_dict(), model_tensors(GPT(config)),
                                                state={"step": 0}))
    data = write(tmp_path / "d.jsonl", [{"messages": CHAT[1:3]}, {"messages": CHAT}])
    assert main(["masks", str(tmp_path), "--data", str(data), "--n", "1"]) == 0
    out = capsys.readouterr().out
    assert "<|user|>\nHello there<|end|>\n<|assistant|>\n[[the cat sat<|end|>\n]]" in out
    assert "\x1b[" not in out and "how are you" not in out  # plain text, only the first example
    assert "--- 2 of 2 examples (messages)" in out
    bad = write(tmp_path / "bad.jsonl", [{"messages": CHAT[1:3]}, {"prompt": "a"}])
    assert main(["masks", str(tmp_path), "--data", str(bad)]) == 2
    error = f"gptlab: error: {bad}:2: missing key 'completion' of a prompt-completion example\n"
    assert capsys.readouterr().err == error


def test_masks_of_prompt_completion_data_on_a_char_run(tmp_path: Path, capsys) -> None:
    """A char tokenizer cannot take chat markers, and prompt/completion data needs none: masks works."""
    chars = CharTokenizer("\nabc=")
    config = ModelConfig(vocab_size=chars.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)
    save_checkpoint(tmp_path / BEST, Checkpoint(config, chars.to_dict(), model_tensors(GPT(config)),
                                                state={"step": 0}))
    data = write(tmp_path / "d.jsonl", [{"prompt": "ab=", "completion": "ba\n"}])
    assert main(["masks", str(tmp_path), "--data", str(data)]) == 0
    assert "ab=[[ba\n]]" in capsys.readouterr().out


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(bpe: BPETokenizer, tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "Hello", "completion": " there"}\n'
                     b'{"prompt": "caf\xe9", "completion": "b"}\n')
    reason = re.escape("not UTF-8 (byte 0xe9 at column 16)")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:2: {reason}: convert it to UTF-8"):
        load_examples(path, bpe, NativeTemplate(), 64)
