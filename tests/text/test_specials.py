"""Special tokens of the char and byte tokenizers (gptlab.text.specials): one id each after the kind's own,
matched before characters or bytes (leftmost, then longest), decoded to their text, saved in `to_dict`;
tokenizers saved before they existed load with the same ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gptlab.adapt.chat import tokenizer_with_tokens
from gptlab.text.specials import SpecialTokens
from gptlab.text.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    DamagedTokenizerError,
    Tokenizer,
    tokenizer_from_dict,
)

MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHARS = "\n !,<>abcdefhilnorstuy|"


def both(specials: list[str]) -> list[Tokenizer]:
    return [CharTokenizer(CHARS, specials), ByteTokenizer(specials)]


@pytest.mark.parametrize("tokenizer", both(MARKERS), ids=["char", "byte"])
def test_markers_are_one_id_each_after_the_kinds_own_and_round_trip(tokenizer: Tokenizer) -> None:
    first = tokenizer.vocab_size - len(MARKERS)
    assert first == (len(CHARS) if tokenizer.kind == "char" else 256)
    text = "<|user|>\nhi there<|end|>\n<|assistant|>\nhello!<|end|>\n"
    ids = tokenizer.encode(text)
    plain = tokenizer.encode  # the same tokenizer on text without markers
    assert ids == [first + 1, *plain("\nhi there"), first + 3, *plain("\n"), first + 2, *plain("\nhello!"),
                   first + 3, *plain("\n")]
    assert tokenizer.decode(ids) == text
    np.testing.assert_array_equal(tokenizer.encode_array(text), np.asarray(ids, dtype=np.int64))
    assert tokenizer.token_bytes(first + 2) == b"<|assistant|>"
    assert tokenizer.encode("") == [] and tokenizer.encode_array("").dtype == np.int64


@pytest.mark.parametrize("tokenizer", both(["<|", "<|end|>", "|>"]), ids=["char", "byte"])
def test_the_leftmost_then_the_longest_special_token_wins(tokenizer: Tokenizer) -> None:
    first = tokenizer.vocab_size - 3
    lt, bar = tokenizer.encode("<"), tokenizer.encode("|")
    assert tokenizer.encode("<|end|>") == [first + 1]  # not "<|" then "end" then "|>"
    assert tokenizer.encode("<|en|>") == [first, *tokenizer.encode("en"), first + 2]
    assert tokenizer.encode("<<|end|>|") == [*lt, first + 1, *bar]
    assert tokenizer.encode("|<|>") == [*bar, first, *tokenizer.encode(">")]  # "<|" starts first


def test_plain_text_encodes_as_without_special_tokens() -> None:
    text = "hello there, <tiny> | it is \n" * 50
    for plain, marked in zip(both([]), both(MARKERS), strict=True):
        assert marked.encode(text) == plain.encode(text)
        assert plain.to_dict() == {k: v for k, v in marked.to_dict().items() if k != "specials"}


def test_a_char_error_names_its_place_in_the_whole_text() -> None:
    tokenizer = CharTokenizer(CHARS, MARKERS)
    with pytest.raises(ValueError, match=rf"character 'x' at position 12 is not in the char tokenizer's "
                                         rf"vocabulary \({len(CHARS)} characters"):
        tokenizer.encode("<|user|>\nhi\nx")


def test_byte_decoding_keeps_special_tokens_whole_and_replaces_cut_characters() -> None:
    tokenizer = ByteTokenizer(MARKERS)
    assert tokenizer.decode([*"é".encode(), 257, 0xE6, 0x97]) == "é<|user|>\ufffd"
    assert tokenizer.decode([0xC3, 259, 0xA9]) == "\ufffd<|end|>\ufffd"  # no character across a marker


@pytest.mark.parametrize("tokenizer", both(MARKERS), ids=["char", "byte"])
def test_to_dict_keeps_the_special_tokens(tokenizer: Tokenizer) -> None:
    saved = json.loads(json.dumps(tokenizer.to_dict()))  # as a checkpoint's header carries it
    assert saved["specials"] == MARKERS
    rebuilt = tokenizer_from_dict(saved)
    text = "<|system|>\nbe brief<|end|>\n"
    assert rebuilt.vocab_size == tokenizer.vocab_size and rebuilt.encode(text) == tokenizer.encode(text)


def test_tokenizers_saved_before_special_tokens_load_with_the_same_ids() -> None:
    old_char, old_byte = {"kind": "char", "chars": CHARS}, {"kind": "byte"}
    char, byte = tokenizer_from_dict(old_char), tokenizer_from_dict(old_byte)
    assert (char.vocab_size, byte.vocab_size) == (len(CHARS), 256)
    assert char.encode("hi <|end|>") == [CHARS.index(c) for c in "hi <|end|>"]
    assert char.to_dict() == old_char and byte.to_dict() == old_byte  # and they save as before


@pytest.mark.parametrize("specials", ["<|end|>", ["<|end|>", 3], ["x"], ["<|a|>", "<|a|>"]])
def test_damaged_special_tokens_are_a_damaged_tokenizer(specials: object) -> None:
    for saved in ({"kind": "char", "chars": CHARS}, {"kind": "byte"}):
        with pytest.raises(DamagedTokenizerError):
            tokenizer_from_dict({**saved, "specials": specials})


def test_tokenizer_with_tokens_grows_the_special_list() -> None:
    grown = tokenizer_with_tokens(CharTokenizer(CHARS, ["<|a|>"]), MARKERS[:2])
    assert grown.to_dict()["specials"] == ["<|a|>", *MARKERS[:2]]
    assert grown.encode("<|user|><|a|>") == [len(CHARS) + 2, len(CHARS)]
    byte = tokenizer_with_tokens(ByteTokenizer(), MARKERS)
    assert byte.vocab_size == 260 and byte.encode("<|end|>") == [259]


def test_split_gives_plain_pieces_with_their_offsets() -> None:
    specials = SpecialTokens(["<|u|>", "<|e|>"], first_id=10)
    assert specials.split("a<|u|>bc<|e|><|u|>") == [(0, "a"), (1, 10), (6, "bc"), (8, 11), (13, 10)]
    assert SpecialTokens([], 0).split("abc") == [(0, "abc")] and specials.split("") == []
