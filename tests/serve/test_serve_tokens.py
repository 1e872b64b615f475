"""Per-token bytes (`Tokenizer.token_bytes`) for every tokenizer kind, and the server's per-token text for
tokens that are pieces of a character: OpenAI's `bytes:\\xNN` form, with consistent text offsets."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from gptlab.config import ModelConfig
from gptlab.inference.lm import LM
from gptlab.model import GPT
from gptlab.text.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    ImportedTokenizer,
    SymbolTokenizer,
    Tokenizer,
    train_tokenizer,
)

TEXT = "thé café naïve, 1€ 🎈 — the end\n"


def whole_and_split(tokenizer: Tokenizer, text: str) -> None:
    """Each token's bytes join into the text's bytes; a token whose bytes are whole UTF-8 decodes to them."""
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    for token, piece in zip(ids, pieces, strict=True):
        try:
            whole = piece.decode("utf-8")
        except UnicodeDecodeError:
            assert "\ufffd" in tokenizer.decode([token])  # a piece of a character, as decode shows it
            continue
        assert tokenizer.decode([token]) == whole


def test_token_bytes_of_the_trained_kinds() -> None:
    byte = ByteTokenizer()
    assert [byte.token_bytes(i) for i in byte.encode("thé")] == [b"t", b"h", b"\xc3", b"\xa9"]
    whole_and_split(byte, TEXT)
    whole_and_split(CharTokenizer.train(TEXT), TEXT)
    bpe = train_tokenizer("bpe", TEXT * 20, 300)
    whole_and_split(bpe, TEXT)
    assert bpe.token_bytes(bpe.eot_id) == b"<|endoftext|>"
    symbols = SymbolTokenizer(["<pad>", "<eos>"], "abé")
    assert [symbols.token_bytes(i) for i in range(symbols.vocab_size)] == [b"<pad>", b"<eos>", b"a", b"b",
                                                                         "é".encode()]
    with pytest.raises(ValueError, match="outside"):
        byte.token_bytes(256)


def test_token_bytes_of_gpt2() -> None:
    pytest.importorskip("tiktoken")
    try:
        gpt2 = train_tokenizer("gpt2", "")
    except ValueError as err:  # GPT-2's files are not cached here
        pytest.skip(str(err))
    whole_and_split(gpt2, TEXT)


def test_token_bytes_of_imported_byte_level_and_sentencepiece_tokenizers() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    byte_level = train_tokenizer("bpe", TEXT * 20, 300).to_dict()["json"]
    whole_and_split(ImportedTokenizer(byte_level, None), TEXT)
    # Llama's style: "▁" for a space, "<0xNN>" for each byte of a character outside the vocabulary.
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ("▁", "t", "h", "e", "é", "▁t", "▁th", "▁the"):
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    hf.add_special_tokens(["</s>"])
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = ImportedTokenizer(hf.to_str(), 1)
    ids = tokenizer.encode(" the thé€")
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert pieces == [b" the", b" th", "é".encode(), b"\xe2", b"\x82", b"\xac"]
    assert tokenizer.decode(ids) == " the thé€"  # the reference the pieces above must add up to
    assert tokenizer.token_bytes(1) == b"</s>"


def successor_model(after: dict[str, str]) -> tuple[GPT, ByteTokenizer]:
    """A byte model whose greedy next token depends only on the last byte: `after[c]` follows c (the
    first byte of the string), anything else is followed by "."; one-hot embeddings, no attention."""
    config = ModelConfig(vocab_size=256, block_size=32, n_layer=1, n_head=4, n_embd=256, norm="none",
                         ffn="none", tied=False, bias=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.wte.weight.copy_(torch.eye(256))  # the residual stream is the one-hot byte
        head = model.lm_head.weight  # (V, D): logits of every next byte for each last byte
        head[ord(".")] = 5.0
        for last, following in after.items():
            head[following.encode("latin-1")[0], last.encode("latin-1")[0]] = 10.0
    return model, ByteTokenizer()


# ">" then "thé" (the é as its two bytes, written as latin-1 characters), then "." for ever.
THE = {">": "t", "t": "h", "h": "\xc3", "\xc3": "\xa9", "\xa9": "."}


@pytest.fixture(scope="module")
def served_bytes() -> Iterator[str]:
    pytest.importorskip("fastapi")
    from test_serve import start_server

    from gptlab.serve.app import create_app

    model, tokenizer = successor_model(THE)
    url, server, thread = start_server(create_app(LM.from_model(model, tokenizer), "bytes"))
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def test_split_characters_are_bytes_tokens_with_consistent_offsets(served_bytes: str) -> None:
    httpx = pytest.importorskip("httpx")
    body = {"prompt": "é>", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    reply = httpx.post(f"{served_bytes}/v1/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["text"] == "thé."
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["t", "h", "bytes:\\xc3", "bytes:\\xa9", "."]
    # Offsets count characters of prompt + completion: both pieces of é start at its character.
    assert logprobs["text_offset"] == [2, 3, 4, 4, 5]
    assert "bytes:\\xc3" in logprobs["top_logprobs"][2] and "." in logprobs["top_logprobs"][2]
    streamed = []
    with httpx.stream("POST", f"{served_bytes}/v1/completions", json={**body, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                streamed += [c["logprobs"]["tokens"][0] for c in choices if c["logprobs"]]
    assert streamed == logprobs["tokens"]
    attention = httpx.post(f"{served_bytes}/v1/attention", json={"text": "thé"}).json()
    assert attention["bytes"] == [[116], [104], [0xC3], [0xA9]]
