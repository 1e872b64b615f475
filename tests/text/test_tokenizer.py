"""Tokenizers: exact round trips, saving and rebuilding, vocabulary limits and the errors users see."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest

from gptlab.text import bpe
from gptlab.text import tokenizer as tokenizer_module
from gptlab.text.bpe import text_pieces
from gptlab.text.tokenizer import (
    DEFAULT_BPE_VOCAB,
    EOT,
    TOKENIZERS,
    Tokenizer,
    tokenizer_from_dict,
    train_tokenizer,
)

# Leading spaces, blank lines, tabs, CRLF, accents, CJK and an emoji: all must come back unchanged.
SAMPLE = "  two leading spaces\n\n\tand a tab\r\nnaïve café — 東京 😀\n   trailing  \n"
CORPUS = (
    "KING.\nI think thee now some common customer.\n\n"
    "DIANA.\nBy Jove, if ever I knew man, 'twas you.\n\n\n"
    "From fairest creatures we desire increase,\nThat thereby beauty's rose might never die;\n"
) * 20 + SAMPLE
TRAINABLE = ("char", "byte", "bpe")


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {kind: train_tokenizer(kind, CORPUS, 300 if kind == "bpe" else None) for kind in TRAINABLE}


@pytest.mark.parametrize("kind", TRAINABLE)
def test_round_trip(tokenizers: dict[str, Tokenizer], kind: str) -> None:
    tok = tokenizers[kind]
    assert tok.kind == kind
    for text in (SAMPLE, CORPUS, "", " I", "\n\n\nDIANA.\n"):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        np.testing.assert_array_equal(tok.encode_array(text), np.asarray(ids, dtype=np.int64))


@pytest.mark.parametrize("kind", TRAINABLE)
def test_to_dict_rebuilds_the_same_tokenizer(tokenizers: dict[str, Tokenizer], kind: str) -> None:
    tok = tokenizers[kind]
    saved = json.loads(json.dumps(tok.to_dict()))  # as it travels inside a checkpoint
    rebuilt = tokenizer_from_dict(saved)
    assert saved["kind"] == kind
    assert (type(rebuilt), rebuilt.vocab_size, rebuilt.eot_id) == (type(tok), tok.vocab_size, tok.eot_id)
    assert rebuilt.encode(CORPUS) == tok.encode(CORPUS)


def test_char_vocabulary_is_the_sorted_characters() -> None:
    tok = train_tokenizer("char", "hello world")
    assert tok.vocab_size == 8 and tok.eot_id is None
    assert tok.encode(" dehlorw") == list(range(8))


def test_char_unknown_character_names_it_and_its_position() -> None:
    tok = train_tokenizer("char", "abc")
    with pytest.raises(ValueError, match=r"character 'Z' at position 2 .*byte or bpe"):
        tok.encode("abZc")


def test_byte_decodes_a_cut_character_with_a_replacement() -> None:
    tok = train_tokenizer("byte", "")
    ids = tok.encode("é!")  # 0xC3 0xA9 0x21
    assert tok.vocab_size == 256 and ids == [0xC3, 0xA9, 0x21]
    assert tok.decode(ids[1:]) == "\ufffd!"


def test_bpe_respects_vocab_size_and_has_an_eot_token() -> None:
    tok = train_tokenizer("bpe", CORPUS * 3, vocab_size=280)
    assert 257 < tok.vocab_size <= 280
    assert tok.encode(EOT) == [tok.eot_id]
    assert tok.decode(tok.encode(f"one{EOT}two")) == f"one{EOT}two"
    larger = train_tokenizer("bpe", CORPUS * 3)
    assert 280 < larger.vocab_size <= DEFAULT_BPE_VOCAB
    # More merges, fewer tokens; both fewer than the text's bytes.
    assert len(larger.encode(CORPUS)) < len(tok.encode(CORPUS)) < 0.9 * len(CORPUS.encode())


def test_text_pieces_keep_every_encoding(tokenizers: dict[str, Tokenizer]) -> None:
    # Runs of line breaks are where a careless cut changes GPT-2-style pre-tokenization.
    text = "KING.\nI think thee now.\n\nDIANA.\nBy Jove,\n\n  if ever\n\n\n" * 30
    pieces = list(text_pieces(text, size=17))
    assert len(pieces) > 10 and "".join(pieces) == text
    # Trained on this text, bpe merges "\n\n"; cutting "now.\n\n|DIANA" would wrongly use that merge,
    # where the whole text splits the breaks as "\n", "\n".
    for tok in [*tokenizers.values(), train_tokenizer("bpe", text, 400)]:
        assert sum((tok.encode(p) for p in pieces), []) == tok.encode(text)


def test_text_pieces_cut_long_lines_between_words() -> None:
    # One long line (like text8, or minified code) used to be one piece: one uninterruptible call.
    words = ["it's", "the", "  two", "\tspaced", "3.14", "naïve", "東京", "😀", EOT, "--", "x\xa0y", "\x1c"]
    text = " ".join(words[i * 7 % len(words)] for i in range(3000))
    pieces = list(text_pieces(text, size=50))
    assert "".join(pieces) == text and len(pieces) > 100
    assert max(len(p) for p in pieces) < 100
    assert all(p[0] == " " for p in pieces[1:])  # each cut is before a space...
    assert all(not p[-1].isspace() for p in pieces[:-1])  # ...that follows a non-space
    for kind in TRAINABLE:
        tok = train_tokenizer(kind, text, 400 if kind == "bpe" else None)
        assert sum((tok.encode(p) for p in pieces), []) == tok.encode(text)


def test_bpe_trains_in_a_worker_process_with_the_same_result() -> None:
    in_process = bpe._train_bpe_json(CORPUS, 300)
    assert train_tokenizer("bpe", CORPUS, 300).to_dict()["json"] == in_process


def test_bpe_worker_is_killed_when_training_is_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    workers: list[subprocess.Popen] = []

    class InterruptedPopen(subprocess.Popen):
        def communicate(self, *args: object, **kwargs: object) -> tuple[bytes, bytes]:
            workers.append(self)
            raise KeyboardInterrupt  # as Ctrl-C does, while the worker trains

    monkeypatch.setattr(subprocess, "Popen", InterruptedPopen)
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer("bpe", CORPUS, 300)
    assert len(workers) == 1 and workers[0].returncode == -signal.SIGKILL


def test_bpe_worker_failure_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"BPE training failed in its worker process \(.*Error") as raised:
        bpe.train_bpe_in_worker(CORPUS, -1)  # the library refuses a negative size
    assert "\n" not in str(raised.value)


def test_decode_refuses_ids_outside_the_vocabulary(tokenizers: dict[str, Tokenizer]) -> None:
    for tok in tokenizers.values():
        with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is outside"):
            tok.decode([0, tok.vocab_size])


def test_train_tokenizer_argument_errors() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer 'words': choose one of char, byte, bpe, gpt2"):
        train_tokenizer("words", CORPUS)
    with pytest.raises(ValueError, match="at least 257"):
        train_tokenizer("bpe", CORPUS, vocab_size=256)
    with pytest.raises(ValueError, match="applies only to the bpe tokenizer"):
        train_tokenizer("char", CORPUS, vocab_size=500)
    with pytest.raises(ValueError, match="non-empty text"):
        train_tokenizer("char", "")
    with pytest.raises(ValueError, match="vocab_size=300.5 must be a whole number"):
        train_tokenizer("bpe", CORPUS, vocab_size=300.5)  # type: ignore[arg-type]


def test_bpe_vocab_size_has_an_upper_bound() -> None:
    # Hugging Face's trainer aborted the whole process on vocab_size=10**9 (a 70 GB allocation).
    for too_large in (10**9, 1_000_001):
        with pytest.raises(ValueError, match=rf"vocab_size={too_large} is too large: the most is 1,000,000"):
            tokenizer_module.check_tokenizer_args("bpe", too_large)
    tokenizer_module.check_tokenizer_args("bpe", tokenizer_module.MAX_BPE_VOCAB)
    with pytest.raises(ValueError, match="too large"):
        train_tokenizer("bpe", CORPUS, vocab_size=10**9)


@pytest.mark.parametrize(
    "saved, message",
    [
        ({"kind": "words"}, "not a saved tokenizer: kind='words'"),
        ([1, 2], "not a saved tokenizer: kind=None"),
        ({"kind": "bpe"}, "lacks its 'json' string"),
        ({"kind": "bpe", "json": "garbage"}, "saved bpe tokenizer's Hugging Face JSON is damaged"),
        ({"kind": "bpe", "json": '{"model": 1}'}, "saved bpe tokenizer's Hugging Face JSON is damaged"),
        ({"kind": "char", "chars": "aab"}, "saved char tokenizer is damaged: .* must be distinct"),
        ({"kind": "char", "chars": ""}, "saved char tokenizer is damaged"),
        ({"kind": "symbols", "chars": "ab"}, "lacks its 'specials' list of strings"),
        ({"kind": "symbols", "specials": [1], "chars": "ab"}, "lacks its 'specials' list of strings"),
    ],
)
def test_tokenizer_from_dict_refuses_damaged_input(saved: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        tokenizer_from_dict(saved)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    assert type(raised.value).__name__ == "DamagedTokenizerError"  # what data folders turn into a file name
    assert set(TOKENIZERS) == {"char", "byte", "bpe", "gpt2"}


# ---------------------------------------------------------------------------------------------
# gpt2: needs tiktoken and GPT-2's files in tiktoken's cache (there is no download in the tests)


def _gpt2_files_cached() -> str | None:
    """None when tiktoken can load "gpt2" offline, else the reason it cannot."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return "tiktoken is not installed"
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    cache = cache or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    # tiktoken names each cached file after the SHA-1 of its URL.
    for name in ("vocab.bpe", "encoder.json"):
        if not (Path(cache) / hashlib.sha1((base + name).encode()).hexdigest()).is_file():
            return f"GPT-2's {name} is not in tiktoken's cache {cache}"
    return None


@pytest.mark.skipif(_gpt2_files_cached() is not None, reason=str(_gpt2_files_cached()))
def test_gpt2_round_trip() -> None:
    tok = train_tokenizer("gpt2", "")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.encode("Hello world" + EOT) == [15496, 995, 50256]
    assert tokenizer_from_dict(json.loads(json.dumps(tok.to_dict()))).encode(SAMPLE) == tok.encode(SAMPLE)


def test_gpt2_without_tiktoken_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    with pytest.raises(ValueError, match=r"pip install tiktoken.*use tokenizer bpe"):
        train_tokenizer("gpt2", "")


def test_gpt2_without_its_files_says_how_to_get_them(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(name: str) -> None:
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=offline))
    with pytest.raises(ValueError, match=r"ConnectionError.*TIKTOKEN_CACHE_DIR.*use tokenizer bpe"):
        tokenizer_from_dict({"kind": "gpt2"})
