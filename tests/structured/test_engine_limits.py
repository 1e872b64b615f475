"""Grammars the engine (llguidance) gives up on fail closed, naming the grammar and the engine's reason: one
that matches no text (the regex [^\\s\\S], a schema whose $ref points only at itself) is refused when it
is compiled; one past the engine's limits while it runs (2,001 alternatives open at once, over its parser's
2,000) is a ValueError from `LM.generate` and one line from `gptlab sample`, never an empty output; and
choices past that limit are one token rule for the engine's lexer, so 2,500 of them work as 1,000 do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

from test_structured import TEXT, random_model  # noqa: E402

from gptlab.cli import main  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.structured.grammar import choice_grammar, json_schema_grammar, regex_grammar  # noqa: E402
from gptlab.text.tokenizer import BPETokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NOTHING = r"[^\s\S]"  # no character is both not a space and not a non-space
SELF_REF = {"$ref": "#"}  # a value that is itself, forever: no JSON text is one
# 2,001 alternatives after an integer: the engine's parser holds at most 2,000 items in a row, and finds out
# only once the integer is written
TOO_MANY = {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                             {"anyOf": [{"const": [i]} for i in range(2001)]}],
            "items": False, "minItems": 2}


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(TEXT, 300)


@pytest.fixture(scope="module")
def lm(bpe: BPETokenizer) -> LM:
    return LM.from_model(random_model(bpe.vocab_size), bpe)


def test_grammars_that_match_no_text_are_refused_when_compiled(bpe: BPETokenizer) -> None:
    for compile_it, named in ((lambda: regex_grammar(bpe, NOTHING), "the regex"),
                              (lambda: json_schema_grammar(bpe, SELF_REF), "the JSON schema")):
        with pytest.raises(ValueError) as info:
            compile_it()
        message = str(info.value)
        assert message.startswith(named) and "matches no text" in message and "\n" not in message, message


def test_generate_raises_naming_the_grammar_and_the_engines_reason(lm: LM) -> None:
    with pytest.raises(ValueError) as info:
        lm.generate("the cat", json_schema=TOO_MANY, max_new_tokens=40, seed=0)
    message = str(info.value)
    assert message.startswith("the JSON schema: the grammar engine gave up after 2 tokens")
    assert "Current row has 2001 items; max is 2000" in message and "\n" not in message, message
    with pytest.raises(ValueError, match="the regex .*matches no text"):
        lm.generate("the cat", regex=NOTHING, max_new_tokens=5)


@pytest.mark.parametrize("count", [1000, 2500])
def test_choices_past_the_engines_row_limit_give_one_of_them(lm: LM, bpe: BPETokenizer, count: int) -> None:
    choices = [f"option {i}" for i in range(count)]
    for seed in range(2):
        assert lm.generate("the cat", choice=choices, max_new_tokens=20, seed=seed) in choices
    matcher = choice_grammar(bpe, ["a", "ab"]).matcher()  # one token rule still ends at any choice
    assert matcher.advance(bpe.encode("a")[0]) and matcher.allowed() is not None


def test_sample_refuses_in_one_line(tmp_path: Path, bpe: BPETokenizer, save_model: Any,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = save_model(tmp_path / "run", random_model(bpe.vocab_size), bpe)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(TOO_MANY), encoding="utf-8")
    gave_up = "the JSON schema: the grammar engine gave up"
    for option, value, named in (("--regex", NOTHING, "the regex"), ("--json-schema", str(schema), gave_up)):
        assert main(["sample", str(run), "--prompt", "the", option, value, "--max-new-tokens", "40"]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"gptlab: error: {named}") and err.count("\n") == 1, err
