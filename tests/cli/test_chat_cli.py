"""`gptlab chat`: a run's replies through its chat template, scripted (--message) and interactive, held to
`stream_text` of the rendered conversation (an independent path) and to the server's chat answer."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from conftest import INSPECT_TEXT
from gptlab.adapt.chat import add_chat_tokens
from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, SamplingConfig
from gptlab.generate import stream_text
from gptlab.inference.lm import LM
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.text.chat_template import NativeTemplate
from gptlab.text.tokenizer import BPETokenizer

END = NativeTemplate.END


def build_chat_run(root: Path) -> Path:
    """A random bpe model with the native template's tokens added (no training: equality tests need none).

    The head's row for <|end|> is 1.5 times that of a token the model favours (" mat"), so replies end at the
    end of the turn after a few tokens instead of running to max_tokens."""
    bpe = BPETokenizer.train(INSPECT_TEXT, 300)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=bpe.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=16,
                            tied=False)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    model, tokenizer = add_chat_tokens(model, bpe, NativeTemplate())
    favoured = tokenizer.encode(" mat")[0]
    end = tokenizer.encode(END)[0]
    with torch.no_grad():
        model.lm_head.weight[end] = 1.5 * model.lm_head.weight[favoured]
    save_checkpoint(root / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    return root


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_run(tmp_path_factory.mktemp("chat"))


def reference(run: Path, messages: list[dict], sampling: SamplingConfig) -> tuple[str, str | None]:
    """The reply `stream_text` gives for the rendered conversation, cut at the native end of turn."""
    lm = load(run)
    model, tokenizer = lm.model, lm.tokenizer
    prompt = NativeTemplate().render(messages, add_generation_prompt=True)
    chunks = list(stream_text(model, tokenizer, prompt, sampling.replace(stop=(*sampling.stop, END))))
    return "".join(c.text for c in chunks), chunks[-1].stop_reason


def run_cli(argv: list[str], capsys: pytest.CaptureFixture, stdin: str | None = None,
            monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[int, str, str]:
    if stdin is not None and monkeypatch is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


def test_message_turns_equal_stream_text_of_the_rendered_conversation(chat_run: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    status, out, _ = run_cli(["chat", str(chat_run), "--system", "be brief", "--message", "the cat",
                              "--message", "a dog", "--temperature", "0", "--max-new-tokens", "12", "--json"],
                             capsys)
    assert status == 0
    first, second = (json.loads(line) for line in out.splitlines())
    system = {"role": "system", "content": "be brief"}
    asked = [system, {"role": "user", "content": "the cat"}]
    expected, reason = reference(chat_run, asked, GREEDY)
    assert first["reply"] == expected and first["stop_reason"] == reason == "stop"  # ended at <|end|>
    # The second turn reads the first one's reply: the whole conversation is rendered again.
    asked += [{"role": "assistant", "content": expected}, {"role": "user", "content": "a dog"}]
    assert second["reply"] == reference(chat_run, asked, GREEDY)[0] and second["turn"] == 2


def test_interactive_chat_keeps_the_conversation_resets_and_exits(
        chat_run: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["chat", str(chat_run), "--temperature", "0", "--max-new-tokens", "12"]
    lines = "the cat\n\na dog\n/reset\na dog\n/exit\nnever read\n"
    status, out, _ = run_cli(argv, capsys, lines, monkeypatch)
    assert status == 0 and "never read" not in out
    replies = [line.split("model> ", 1)[1] for line in out.split("you> ") if "model> " in line]
    cat = reference(chat_run, [{"role": "user", "content": "the cat"}], GREEDY)[0]
    follow_up = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": cat},
                 {"role": "user", "content": "a dog"}]
    fresh = reference(chat_run, [{"role": "user", "content": "a dog"}], GREEDY)[0]
    assert [r.rstrip("\n") for r in replies] == [cat, reference(chat_run, follow_up, GREEDY)[0], fresh]
    assert "(a new conversation)" in out
    status, out, _ = run_cli(argv, capsys, "the cat\n", monkeypatch)  # Ctrl-D after a turn: a clean end
    assert status == 0 and out.endswith("you> \n")


def test_a_run_without_chat_tokens_is_one_clear_line(trained_run: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    status, out, err = run_cli(["chat", str(trained_run), "--message", "hi"], capsys)
    assert status == 2 and out == ""
    assert err.startswith("gptlab: error: this run's tokenizer has no single ids for <|system|>")
    assert len(err.splitlines()) == 1
    status, _, err = run_cli(["chat", str(trained_run), "--json"], capsys)
    assert status == 2 and "--json" in err and len(err.splitlines()) == 1


def test_cli_and_server_give_the_same_greedy_answer(chat_run: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from gptlab.serve.app import create_app

    lm = load(chat_run)

    model, tokenizer = lm.model, lm.tokenizer
    app = create_app(LM.from_model(model, tokenizer), "chat", allowed_hosts=None)
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "my bird"}], "temperature": 0, "max_tokens": 12}).json()
    capsys.readouterr()  # what the server logged (httpx's request line), not the command's
    _, out, _ = run_cli(["chat", str(chat_run), "--message", "my bird", "--temperature", "0",
                         "--max-new-tokens", "12", "--json"], capsys)
    answer = reply["choices"][0]["message"]["content"]
    assert json.loads(out)["reply"] == answer == reference(chat_run, [{"role": "user", "content": "my bird"}],
                                                           GREEDY)[0]
    assert reply["choices"][0]["finish_reason"] == "stop"


NOT_UTF8 = "caf\udce9"  # what Python makes of the bytes caf\xe9 in argv or on stdin (surrogateescape)


def test_a_prompt_that_is_not_utf8_is_one_clear_line(chat_run: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in (["sample", str(chat_run), "--prompt", NOT_UTF8, "--max-new-tokens", "2"],
                 ["chat", str(chat_run), "--message", NOT_UTF8, "--max-new-tokens", "2"]):
        status, out, err = run_cli(argv, capsys)
        assert status == 2 and out == ""
        assert err.startswith("gptlab: error: the text is not valid UTF-8: it holds the byte 0xe9 (")
        assert len(err.splitlines()) == 1
    # Interactive chat says so in one line about that input and goes on with the next one.
    argv = ["chat", str(chat_run), "--temperature", "0", "--max-new-tokens", "12"]
    status, out, _ = run_cli(argv, capsys, f"{NOT_UTF8}\nthe cat\n", monkeypatch)
    assert status == 0 and "not valid UTF-8: it holds the byte 0xe9" in out
    cat = reference(chat_run, [{"role": "user", "content": "the cat"}], GREEDY)[0]
    assert out.split("you> ")[2] == f"model> {cat}\n"
