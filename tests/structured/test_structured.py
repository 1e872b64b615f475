"""Structured output (gptlab.structured) on random-weight tiny models: what a JSON schema, a regex or a
choice list lets through validates with jsonschema, matches with re.fullmatch or is one of the choices,
for a BPE vocabulary of a few hundred tokens and for a char vocabulary; the grammar fails closed (a
malformed schema, a keyword the engine cannot enforce, a character the vocabulary lacks: one-line
errors); special and padded ids are never allowed; max tokens first is "length"; and logit_bias moves
and bans tokens, greedy and sampled, in `generate` too. `random_schema` is shared with the server's tests."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from gptlab.adapt.chat import tokenizer_with_tokens  # noqa: E402
from gptlab.cli import main  # noqa: E402
from gptlab.config import ModelConfig, SamplingConfig  # noqa: E402
from gptlab.generate import generate  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.sampling import apply_logit_bias, apply_mask, next_token, token_probabilities  # noqa: E402
from gptlab.structured.generation import stream_structured  # noqa: E402
from gptlab.structured.grammar import (  # noqa: E402
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
    special_ids,
)
from gptlab.text.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer, Tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only adds hand-over time

TEXT = " ".join(f'the cat sat on the {w}. {{"name": "{w}", "age": {n}}}' for n, w in enumerate(
    ["mat", "rug", "chair", "step", "dog", "bird"] * 20))
JSON_CHARS = '{}[]":,-0123456789abcdefghijklmnopqrstuvwxyz '
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "pet": {"anyOf": [{"$ref": "#/$defs/pet"}, {"type": "null"}]}},
    "required": ["name", "age", "role", "tags", "pet"], "additionalProperties": False,
    "$defs": {"pet": {"type": "object", "properties": {
        "kind": {"const": "cat"}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["kind"], "additionalProperties": False}}}


def random_model(vocab_size: int, seed: int = 0) -> GPT:
    """A tiny GPT with weights far from its init, so that its choices are varied."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(TEXT, 300)


def sample(model: GPT, tokenizer: Tokenizer, grammar: Any, seed: int, max_new_tokens: int = 200,
           **options: Any) -> tuple[str, str | None]:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed, **options)
    chunks = list(stream_structured(model, tokenizer, "the cat", sampling, grammar))
    return "".join(c.text for c in chunks), chunks[-1].stop_reason


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema whose values are all bounded (so that every output finishes): nested objects,
    arrays, enums, required fields, string patterns, integers in ranges, anyOf, const, $ref."""
    kinds = ["string", "integer", "boolean", "null", "enum", "pattern", "const", "anyOf"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["a", "bb", "name", "x_y", "id", "ok"], rng.randint(1, 3))
        properties = {n: random_schema(rng, depth + 1) for n in names}
        required = rng.sample(names, rng.randint(0, len(names)))
        return {"type": "object", "properties": properties, "required": required,
                "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "pattern":
        pattern = rng.choice(["^[a-z]{1,4}$", "^[A-Z][0-9]{2}$", "[0-9]{2}", "^(yes|no)$"])
        return {"type": "string", "pattern": pattern, "maxLength": 8}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "é"], rng.randint(1, 3))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, True, None])}
    if kind == "anyOf":
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                          {"type": "string", "maxLength": 3}]}
    return {"type": kind}


def test_json_schema_outputs_validate_with_a_bpe_vocabulary(bpe: BPETokenizer) -> None:
    model = random_model(bpe.vocab_size)
    grammar = json_schema_grammar(bpe, PERSON)
    for seed in range(4):
        text, reason = sample(model, bpe, grammar, seed)
        assert reason in ("stop", "eot"), (text, reason)
        jsonschema.validate(json.loads(text), PERSON)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', "", text)
        assert not re.search(r"\s", outside_strings), text  # compact: no whitespace between JSON tokens


def test_the_tokenizers_own_tokens_are_allowed_where_the_grammar_forces_text(bpe: BPETokenizer) -> None:
    instance = {"name": "cat", "age": 7, "role": "user", "tags": ["mat", "rug"], "pet": {"kind": "cat"}}
    matcher = json_schema_grammar(bpe, PERSON).matcher()
    for token in bpe.encode(json.dumps(instance, separators=(",", ":"))):
        allowed = matcher.allowed()
        assert allowed is not None and allowed[token], bpe.token_bytes(token)
        assert matcher.advance(token)
    assert matcher.allowed() is None and matcher.complete


def test_random_schemas_validate(bpe: BPETokenizer) -> None:
    model, rng = random_model(bpe.vocab_size), random.Random(0)
    for seed in range(8):
        schema = random_schema(rng)
        text, reason = sample(model, bpe, json_schema_grammar(bpe, schema), seed, max_new_tokens=400)
        assert reason in ("stop", "eot"), (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_outputs_match_whole(bpe: BPETokenizer) -> None:
    model = random_model(bpe.vocab_size)
    for pattern in (r"[A-Z][a-z]{2,5} [0-9]{2}", r"(cat|dog)s? sat", r"^[0-9]{3}-[a-z]+$"):
        for seed in range(3):
            text, reason = sample(model, bpe, regex_grammar(bpe, pattern), seed, max_new_tokens=60)
            if reason == "length":  # [a-z]+ may run on: the text is then a prefix, never claimed whole
                continue
            assert re.fullmatch(pattern.strip("^$"), text), (pattern, text)


def test_choice_gives_exactly_one_of_them(bpe: BPETokenizer) -> None:
    model, choices = random_model(bpe.vocab_size), ["yes", "no", "maybe so"]
    seen = {sample(model, bpe, choice_grammar(bpe, choices), seed) for seed in range(8)}
    assert {text for text, _ in seen} <= set(choices) and {reason for _, reason in seen} <= {"stop", "eot"}
    assert len(seen) > 1


def test_a_char_vocabulary_writes_valid_json() -> None:
    chars = CharTokenizer(JSON_CHARS)  # no end-of-text token: the grammar itself ends the output
    model = random_model(chars.vocab_size)
    grammar = json_schema_grammar(chars, PERSON)
    for seed in range(3):
        text, reason = sample(model, chars, grammar, seed)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_max_tokens_first_is_length_and_never_valid(bpe: BPETokenizer) -> None:
    model = random_model(bpe.vocab_size)
    text, reason = sample(model, bpe, json_schema_grammar(bpe, PERSON), 0, max_new_tokens=4)
    assert reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "look-around"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "strng"}, "not valid JSON Schema (2020-12) at type"),
    ({"type": "string", "maxLength": -1}, "at maxLength"),
    ({"properties": []}, "at properties"),
    ({"x-guidance": {"lenient": True}}, "x-guidance"),
    ([{"type": "string"}], "must be an object"),
])
def test_bad_or_unenforceable_schemas_are_one_line_errors(bpe: BPETokenizer, schema: Any, named: str) -> None:
    with pytest.raises(ValueError) as info:
        json_schema_grammar(bpe, schema)
    assert named in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_bad_regexes_and_choices_are_one_line_errors(bpe: BPETokenizer) -> None:
    for pattern, named in (("(a", "unclosed group"), (r"(a)\1", "regex"), ("", "empty")):
        with pytest.raises(ValueError, match=named) as info:
            regex_grammar(bpe, pattern)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="non-empty strings"):
        choice_grammar(bpe, ["yes", ""])


def test_characters_the_vocabulary_lacks_are_named() -> None:
    no_braces = CharTokenizer(JSON_CHARS.replace("{", ""))
    with pytest.raises(ValueError, match=r"no token for '\{', which the grammar needs"):
        json_schema_grammar(no_braces, PERSON)
    lower = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"no token for 'Z'"):
        regex_grammar(lower, "a*Z")  # found only by giving up on the endless a*
    with pytest.raises(ValueError, match=r"no token for 'e'"):
        choice_grammar(CharTokenizer("yns"), ["yes"])
    assert choice_grammar(CharTokenizer("no"), ["yes", "no"]).matcher().allowed() is not None  # "no" will do


def test_special_and_padded_ids_are_never_allowed_and_the_end_only_once_complete() -> None:
    chars = CharTokenizer(JSON_CHARS, specials=["<|user|>", "<|end|>"])
    end = chars.specials.ids["<|end|>"]
    matcher = json_schema_grammar(chars, {"type": "string", "maxLength": 2}, end_ids=[end]).matcher()
    allowed = matcher.allowed()
    assert allowed is not None and allowed.shape == (chars.vocab_size,)
    assert allowed.tolist() == [c == '"' for c in JSON_CHARS] + [False, False]
    for token in chars.encode('"ab"'):
        assert matcher.advance(token) and not matcher.complete
    assert matcher.allowed() is None and matcher.complete  # nothing may follow: ended, complete
    # a padded model vocabulary: ids past the tokenizer's stay at -inf whatever their logits
    logits = torch.zeros(1, chars.vocab_size + 5)
    logits[0, chars.vocab_size:] = 100.0
    masked = apply_mask(logits, torch.ones(chars.vocab_size, dtype=torch.bool))
    assert torch.isinf(masked[0, chars.vocab_size:]).all()
    assert not torch.isinf(masked[0, :chars.vocab_size]).any()


def test_special_ids_of_every_kind() -> None:
    chat = tokenizer_with_tokens(BPETokenizer.train(TEXT, 280), ["<|user|>", "<|end|>"])
    assert special_ids(chat) == {chat.eot_id, *chat.encode("<|user|><|end|>")}
    assert special_ids(ByteTokenizer(["<|end|>"])) == {256}
    assert special_ids(CharTokenizer("ab", ["<|end|>"])) == {2} and special_ids(CharTokenizer("ab")) == set()


def test_the_end_id_ends_a_row_once_the_grammar_accepts(bpe: BPETokenizer) -> None:
    matcher = regex_grammar(bpe, "[a-z]+").matcher()
    allowed = matcher.allowed()
    assert allowed is not None and not allowed[bpe.eot_id]  # nothing written yet: no end
    assert matcher.advance(bpe.encode("c")[0])
    allowed = matcher.allowed()
    assert allowed is not None and allowed[bpe.eot_id] and not matcher.complete
    assert matcher.advance(bpe.eot_id) and matcher.complete


def test_logit_bias_moves_and_bans_tokens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    greedy = SamplingConfig(temperature=0, logit_bias={3: 100})
    assert next_token(logits, greedy).item() == 3
    assert next_token(logits, greedy.replace(logit_bias={0: -100})).item() == 1  # banned, however large
    sampled = SamplingConfig(temperature=1.0, logit_bias={1: 2.5, 0: -100})
    expected = (logits + torch.tensor([[0.0, 2.5, 0.0, 0.0]])).softmax(-1)
    expected[0, 0] = 0
    assert_close(token_probabilities(logits, sampled), expected / expected.sum())
    with pytest.raises(ValueError, match="token id 9, outside"):
        apply_logit_bias(logits, {9: 1.0})
    for bad in ({"x": 1}, {1: 101}, {-1: 0}):
        with pytest.raises(ValueError, match="SamplingConfig.logit_bias"):
            SamplingConfig(logit_bias=bad)
    assert SamplingConfig.from_dict(json.loads(json.dumps(sampled.to_dict()))) == sampled  # JSON's keys


def test_logit_bias_in_generate_and_under_a_grammar(bpe: BPETokenizer) -> None:
    model = random_model(bpe.vocab_size)
    prompt = [bpe.encode("the cat")]
    plain = [int(t) for t in generate(model, prompt, SamplingConfig(temperature=0, max_new_tokens=5))]
    banned = SamplingConfig(temperature=0, max_new_tokens=5, logit_bias={plain[0]: -100})
    assert int(next(generate(model, prompt, banned))) != plain[0]
    yes, no = bpe.encode("yes"), bpe.encode("no")
    favoured = {t: 100.0 for t in no} | {t: -100.0 for t in yes}
    assert {sample(model, bpe, choice_grammar(bpe, ["yes", "no"]), seed, logit_bias=favoured)[0]
            for seed in range(4)} == {"no"}
    every = {t: -100.0 for t in range(bpe.vocab_size)}  # every allowed token banned: ends, incomplete
    assert sample(model, bpe, choice_grammar(bpe, ["yes", "no"]), 0, logit_bias=every) == ("", "length")


@pytest.mark.slow
def test_sample_command_takes_a_grammar(tmp_path: Path, bpe: BPETokenizer, save_model: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = save_model(tmp_path / "run", random_model(bpe.vocab_size), bpe)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON), encoding="utf-8")
    assert main(["sample", str(run), "--prompt", "the", "--json-schema", str(schema), "--json",
                 "--num-samples", "2", "--max-new-tokens", "200"]) == 0
    for line in capsys.readouterr().out.splitlines():
        record = json.loads(line)
        jsonschema.validate(json.loads(record["completion"]), PERSON)
        assert record["stop_reason"] in ("stop", "eot")
    assert main(["sample", str(run), "--choice", "yes,no", "--json", "--logit-bias", '{"0": -100}']) == 0
    assert json.loads(capsys.readouterr().out)["completion"] in ("yes", "no")
    assert main(["sample", str(run), "--regex", "[0-9]{2}", "--stop", "x"]) == 2
    assert "error: --stop=['x'] cannot be combined with a grammar" in capsys.readouterr().err
    assert main(["sample", str(run), "--regex", "(a"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["sample", str(run), "--logit-bias", '{"99999": 1}']) == 2
    assert "logit_bias names token id 99999" in capsys.readouterr().err
