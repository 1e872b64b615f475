"""Grammars for structured output: a JSON schema, a regular expression or a list of choices, compiled
against a gptlab tokenizer of any kind (`Grammar`), and per generated row a `Matcher` that gives the
tokens allowed next and follows the tokens chosen.

The engine is llguidance (the `structured` extra), picked by measurement against xgrammar and
outlines-core (benchmarks/grammar_engines.py; the table and the reasons are in docs/serve.md): it takes
any vocabulary as token bytes (`Tokenizer.token_bytes`, so char and byte tokenizers too), compiles a
schema in about a millisecond, and is the one of the three that refuses a keyword it cannot enforce
rather than ignore it.

Fail closed, everywhere:
- A JSON schema must first pass the JSON Schema 2020-12 metaschema (the `jsonschema` package), then
  compile with llguidance's lenient mode off: a keyword the engine does not enforce (`uniqueItems`,
  `not`, ...) is a one-line ValueError naming it. Annotations (`title`, `description`, `default`,
  `examples`, `$schema`) are ignored, as JSON Schema says. `x-guidance` (the engine's own options) is
  refused: gptlab sets them.
- The output is compact: no whitespace between JSON tokens, so a schema whose strings, numbers and
  arrays are bounded always finishes.
- Special tokens (the end of text, chat markers: `special_ids`) are never allowed as text,
  the row's end ids only once the grammar accepts, and ids past the tokenizer's (a padded model
  vocabulary) never: the mask covers the tokenizer's ids only.
- A vocabulary that cannot spell every byte (a char tokenizer) is searched for one complete output
  before generation; when the search ends without one, a ValueError names the characters the grammar
  needed and the vocabulary lacks (a char model without `{` cannot write a JSON object).
- A token the engine does not accept is never kept: `Matcher.advance` says so, and the caller ends
  the row without it.
- A grammar the engine gives up on is never taken for a finished output: one that matches no text (the
  regex `[^\\s\\S]`, a schema whose `$ref` points only at itself) is refused when it is compiled, by its
  first mask; one it gives up on later (its parser holds at most 2,000 items in a row: 2,001 alternatives
  open at once) puts the row's matcher in its error state, and `Matcher.gave_up` says why in one line.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from gptlab.common import need
from gptlab.text.tokenizer import ByteTokenizer, CharTokenizer, Tokenizer

# llguidance's JSON options, over anything a schema asks: compact output, no keyword ignored, oneOf
# only where it provably equals anyOf.
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}
SEARCH_STEPS = 2000  # mask computations the completion search may spend (about 20 ms for a char vocabulary)
SEARCH_DEPTH = 256  # tokens deep the search goes before it backtracks
CLOSERS = b'"}]'  # tried first by the search, so strings, arrays and objects close early
# Reasons the engine stops for that it names with one word, spelt out for a reader.
STOP_REASONS = {
    "NoExtensionBias": "no token may come next, not even the end: the grammar matches no text from here",
    "NoExtension": "no token may come next, not even the end: the grammar matches no text from here",
    "LexerTooComplex": "the grammar is too complex for the engine's lexer",
    "ParserTooComplex": "the grammar is too complex for the engine's parser",
}


def engine() -> Any:
    """The llguidance module, or a one-line ValueError naming the extra that installs it."""
    return need("llguidance", "structured", "structured output")


class Vocabulary:
    """A tokenizer as the engine reads it: each id's bytes, which ids are ordinary text, and how to spell
    any bytes with those (`spell`). The engine's end of sequence is one id past the tokenizer's (`end`),
    so that it never names a real token; the row's own end ids stand for it (`Matcher.allowed`)."""

    def __init__(self, pieces: Sequence[bytes], special: Iterable[int] = (),
                 encode: Callable[[str], Sequence[int]] | None = None) -> None:
        """`encode`: the tokenizer's own encoding of text, without special tokens, when it has one."""
        self.pieces, self.special, self.encode = list(pieces), set(special), encode
        self.size = self.end = len(pieces)
        self.ordinary = np.array([i not in self.special for i in range(self.size)], dtype=bool)  # (V,)
        self.spelling: dict[bytes, int] = {}  # bytes -> the first ordinary id that stands for them
        for i, piece in enumerate(pieces):
            if piece and i not in self.special:
                self.spelling.setdefault(piece, i)
        self.longest = max(map(len, self.spelling), default=1)
        self.every_byte = all(bytes([b]) in self.spelling for b in range(256))
        self.first_bytes = {piece[0] for piece in self.spelling}
        llg = engine()
        wrapped = _Wrapped([*pieces, b""], self.end, sorted({*self.special, self.end}), self)
        self.lltokenizer = llg.LLTokenizer(llg.TokenizerWrapper(wrapped))

    def spell(self, data: bytes) -> list[int] | None:
        """Ordinary ids whose bytes are exactly `data`, or None when the vocabulary cannot spell it: the
        tokenizer's own encoding where it gives them (the grammar engine allows only these where the
        grammar forces text, so they had better be the tokens the model was trained on), else the fewest."""
        if self.encode is not None:
            try:
                ids = [int(i) for i in self.encode(data.decode("utf-8"))]
            except ValueError:  # not whole UTF-8 (UnicodeDecodeError is one), or a character unknown to it
                ids = []
            if ids and not self.special.intersection(ids) and b"".join(self.pieces[i] for i in ids) == data:
                return ids
        return self.fewest(data)

    def fewest(self, data: bytes) -> list[int] | None:
        """The fewest ordinary ids whose bytes are exactly `data`, or None when there are none."""
        best: list[list[int] | None] = [[]] + [None] * len(data)  # best[i]: ids spelling data[:i]
        for start in range(len(data)):
            so_far = best[start]
            if so_far is None:
                continue
            for stop in range(start + 1, min(len(data), start + self.longest) + 1):
                token, known = self.spelling.get(data[start:stop]), best[stop]
                if token is not None and (known is None or len(known) > len(so_far) + 1):
                    best[stop] = [*so_far, token]
        return best[-1]


class _Wrapped:
    """What llguidance's TokenizerWrapper reads: token bytes, end and special ids, and a tokenizer call.

    The engine calls it to spell bytes the grammar forces. A spelling that is not exact would make the
    engine compute wrong masks, so bytes the vocabulary cannot spell raise, which puts the matcher in
    its error state (nothing allowed): closed, never open."""

    def __init__(self, tokens: list[bytes], end: int, special: list[int], vocabulary: Vocabulary) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, end, None
        self.special_token_ids, self.vocabulary = special, vocabulary

    def __call__(self, data: bytes | str) -> list[int]:
        data = data.encode("utf-8") if isinstance(data, str) else data
        ids = self.vocabulary.spell(data)
        if ids is None:
            raise ValueError(f"the vocabulary cannot spell {data!r}")
        return ids


@functools.lru_cache(maxsize=4)
def vocabulary(tokenizer: Tokenizer) -> Vocabulary:
    """The engine's view of `tokenizer`, built once (about 1 s for 49,152 tokens) and kept."""
    pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    return Vocabulary(pieces, special_ids(tokenizer), lambda text: tokenizer.encode_array(text).tolist())


def special_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids that stand for a marker rather than for text (the end of text, chat markers): a char or
    byte tokenizer's special tokens, a Hugging Face one's added tokens marked special (read from its
    saved form), and every end-of-sequence id."""
    ids = set(tokenizer.stop_ids)
    if isinstance(tokenizer, (CharTokenizer, ByteTokenizer)):
        ids |= set(tokenizer.specials.ids.values())
    saved = tokenizer.to_dict()
    if "json" in saved:  # bpe and hf: tokenizer.json's added tokens
        ids |= {t["id"] for t in json.loads(saved["json"]).get("added_tokens", []) if t.get("special")}
    return ids


@functools.lru_cache(maxsize=1)
def byte_vocabulary() -> Vocabulary:
    """The 256 bytes, one token each: what a grammar allows next, byte by byte, for the search's messages."""
    return Vocabulary([bytes([b]) for b in range(256)])


class Grammar:
    """A compiled grammar for one tokenizer: the engine's grammar text, checked, and the ids that may end
    the output once it is complete (the tokenizer's end of text; a chat's end of turn)."""

    def __init__(self, tokenizer: Tokenizer, text: str, what: str,
                 end_ids: Iterable[int] | None = None) -> None:
        """`what` names the grammar in errors ("the JSON schema", "the regex", "the choices")."""
        self.vocabulary = vocabulary(tokenizer)
        self.text, self.what = text, what
        self.end_ids = frozenset(tokenizer.stop_ids if end_ids is None else end_ids)
        outside = sorted(i for i in self.end_ids if not 0 <= i < tokenizer.vocab_size)
        if outside:
            raise ValueError(f"end id {outside[0]} is outside the tokenizer's {tokenizer.vocab_size} ids")
        problem = engine().LLMatcher.validate_grammar(text, self.vocabulary.lltokenizer)
        if problem:
            raise ValueError(engine_error(problem, what))
        if not self.vocabulary.every_byte:
            missing = unreachable(self)
            if missing:
                raise ValueError(f"{what} cannot be completed with this model's vocabulary: it has no token "
                                 f"for {listed(missing)}, which the grammar needs (a char model spells only "
                                 "the characters of its training text)")
        first = Matcher(self)
        if first.allowed() is None and first.state.is_error():  # nothing at all may come first
            raise ValueError(f"{what} is not supported: {engine_reason(first.state.get_error())}")

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar, for one row."""
        return Matcher(self)


class Matcher:
    """One row's place in a grammar: the tokens allowed next, and the tokens chosen so far followed.

    `complete` turns true when the grammar has ended the output validly: its end id was chosen, or the
    grammar accepts and allows nothing more. A row cut short (max tokens) is never complete."""

    def __init__(self, grammar: Grammar, state: Any = None) -> None:
        """`state`: the engine's matcher to continue from (`copy`); default a fresh one."""
        self.grammar, self.vocabulary = grammar, grammar.vocabulary
        self.state = state if state is not None else \
            engine().LLMatcher(self.vocabulary.lltokenizer, grammar.text, log_level=0)
        self.complete = False

    def copy(self) -> Matcher:
        """An independent matcher at the same place: to follow drafted tokens without moving this one."""
        twin = Matcher(self.grammar, self.state.deep_copy())
        twin.complete = self.complete
        return twin

    @property
    def end_ids(self) -> frozenset[int]:
        return self.grammar.end_ids

    def allowed(self) -> torch.Tensor | None:
        """The tokens that may come next, (V,) booleans over the tokenizer's ids, or None when none may:
        the row ends there, validly (`complete`) when the grammar accepts, else incomplete."""
        state = self.state
        if state.is_error() or state.is_stopped():
            self.complete = state.is_accepting() and not state.is_error()
            return None
        # numpy, one thread: torch would split a 49k-long operation over threads that wait for each other
        bits = np.unpackbits(np.frombuffer(state.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if state.is_error():  # the engine gave up computing it (its mask then allows the end alone): closed
            self.complete = False
            return None
        allowed = bits[:self.vocabulary.size].astype(bool) & self.vocabulary.ordinary  # (V,)
        if bits[self.vocabulary.end] and self.end_ids:  # the grammar accepts: the row may end here
            allowed[sorted(self.end_ids)] = True
        if not allowed.any():
            self.complete = state.is_accepting()
            return None
        return torch.from_numpy(allowed)

    def advance(self, token: int) -> bool:
        """Follow the chosen token; False when the grammar does not allow it (drop it and end the row)."""
        if token in self.end_ids:
            self.complete = self.state.is_accepting()
            return self.complete
        return bool(self.state.consume_token(token))

    def gave_up(self, tokens: int) -> str | None:
        """Why the engine gave up on the grammar, `tokens` tokens into the output, as one line naming the
        grammar; None while it has not (the row ended, or goes on, as the grammar says)."""
        if not self.state.is_error():
            return None
        return (f"{self.grammar.what}: the grammar engine gave up after {tokens} token"
                f"{'' if tokens == 1 else 's'}: {engine_reason(self.state.get_error())}")


def json_schema_grammar(tokenizer: Tokenizer, schema: Any, end_ids: Iterable[int] | None = None) -> Grammar:
    """A grammar of the compact JSON values `schema` (a JSON Schema, as a dict) allows; a ValueError of
    one line for a malformed schema or a keyword the engine cannot enforce."""
    check_schema(schema)
    text = engine().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    return Grammar(tokenizer, text, "the JSON schema", end_ids)


def regex_grammar(tokenizer: Tokenizer, pattern: str, end_ids: Iterable[int] | None = None) -> Grammar:
    """A grammar of the texts `pattern` matches whole (as `re.fullmatch`; Rust's regex syntax, which has
    no look-arounds nor back-references)."""
    if not pattern:
        raise ValueError("the regex is empty: give a pattern")
    return Grammar(tokenizer, engine().LLMatcher.grammar_from_regex(pattern), "the regex", end_ids)


def choice_grammar(tokenizer: Tokenizer, choices: Sequence[str],
                   end_ids: Iterable[int] | None = None) -> Grammar:
    """A grammar of exactly one of `choices`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"the choices {list(choices)!r} must be one or more non-empty strings")
    # One token rule (upper case) for the engine's lexer, not a rule of alternatives for its parser, which
    # holds at most 2,000 items in a row; Lark's literals read JSON's escapes.
    lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)
    return Grammar(tokenizer, engine().LLMatcher.grammar_from_lark(lark), "the choices", end_ids)


def grammar_for(tokenizer: Tokenizer, *, json_schema: Any = None, regex: str | None = None,
                choice: list[str] | None = None, end_ids: list[int] | None = None) -> Grammar | None:
    """The grammar of the one constraint given (a JSON schema, a regex or choices), None without one; a
    ValueError when more than one is given."""
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
             if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one constraint, not {' and '.join(given)}")
    if json_schema is not None:
        return json_schema_grammar(tokenizer, json_schema, end_ids)
    if regex is not None:
        return regex_grammar(tokenizer, regex, end_ids)
    return None if choice is None else choice_grammar(tokenizer, choice, end_ids)


def check_schema(schema: Any) -> None:
    """A one-line ValueError unless `schema` is a JSON Schema object (2020-12) without engine options."""
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema must be an object, not {type(schema).__name__} ({{}} allows any "
                         "value)")
    if "x-guidance" in schema:
        raise ValueError("the JSON schema's x-guidance holds grammar-engine options, which gptlab sets "
                         "itself: drop it")
    jsonschema = need("jsonschema", "structured", "checking a JSON schema")
    meta = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)
    error = jsonschema.exceptions.best_match(meta.iter_errors(schema))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "the top level"
        message = " ".join(error.message.split())
        raise ValueError(f"the JSON schema is not valid JSON Schema (2020-12) at {where}: {message[:200]}")


def engine_error(message: str, what: str) -> str:
    """The engine's refusal as one line: an unimplemented keyword by name, else its first and last words."""
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if keys:
        names = ", ".join(k.strip().strip('"') for k in keys.group(1).split(","))
        return (f"{what} uses {names}, which structured output cannot enforce; gptlab refuses the schema "
                "rather than ignore it (fail closed)")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    detail = next((line.removeprefix("error:").strip() for line in lines if line.startswith("error:")), None)
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0]).rstrip(":") if lines else "it does not compile"
    return f"{what} is not supported: {first}" + (f": {detail}" if detail else "")


def engine_reason(message: str) -> str:
    """The engine's error as one line: its first line (without advice for grammar writers), a stop reason
    spelt out."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "it gave no reason")
    first = first.split("; consider ")[0]
    return f"{STOP_REASONS[first]} ({first})" if first in STOP_REASONS else first[:300]


def unreachable(grammar: Grammar) -> set[str]:
    """What the grammar needed where the vocabulary could not go on, when a depth-first search (closing
    quotes and brackets first) finds no complete output; empty when it finds one or runs out of steps
    (then nothing is proven, and generation itself stays within the grammar).

    A second matcher over single bytes follows the same path, to say which bytes the grammar wanted."""
    llg, vocab = engine(), grammar.vocabulary
    tokens = llg.LLMatcher(vocab.lltokenizer, grammar.text, log_level=0)
    by_byte = llg.LLMatcher(byte_vocabulary().lltokenizer, grammar.text, log_level=0)
    pieces = {i: p for p, i in vocab.spelling.items()}
    hard: set[str] = set()  # wanted where no token could go on
    soft: set[str] = set()  # wanted where the search gave up going deeper
    path: list[list[int]] = []  # at each depth, the tokens still to try (the first one taken)
    for _ in range(SEARCH_STEPS):
        if tokens.is_accepting():
            return set()
        if len(path) < SEARCH_DEPTH:
            path.append(search_options(tokens, by_byte, vocab, pieces, hard))
        else:
            soft |= {byte_name(b) for b in next_bytes(by_byte) - vocab.first_bytes}
            path.append([])
        while path and not path[-1]:  # back up to the nearest depth with a token left to try
            path.pop()
            if path:
                tokens.rollback(1)
                by_byte.rollback(len(pieces[path[-1].pop(0)]))
        if not path:
            return hard or soft
        if not tokens.consume_token(path[-1][0]):  # the engine's error state: prove nothing
            return set()
        by_byte.consume_tokens(list(pieces[path[-1][0]]))
    return set()


def search_options(tokens: Any, by_byte: Any, vocab: Vocabulary, pieces: dict[int, bytes],
                   hard: set[str]) -> list[int]:
    """The ordinary tokens the grammar allows here, closers first; none (and what was wanted noted in
    `hard`) when the grammar forces text the vocabulary cannot spell, or allows no token."""
    forced = by_byte.compute_ff_bytes()
    if forced and vocab.spell(forced) is None:
        text = forced.decode("utf-8", "replace")
        hard |= {repr(c) for c in text if c != "\ufffd" and vocab.spell(c.encode("utf-8")) is None}
        return []
    bits = np.unpackbits(np.frombuffer(tokens.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = [int(i) for i in np.flatnonzero(bits[:vocab.size]) if int(i) in pieces]
    if not allowed:
        hard |= {byte_name(b) for b in next_bytes(by_byte)}
    return sorted(allowed, key=lambda i: (pieces[i][0] not in CLOSERS, i))


def next_bytes(by_byte: Any) -> set[int]:
    """The bytes a byte-level matcher allows next."""
    bits = np.unpackbits(np.frombuffer(by_byte.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return {int(b) for b in np.flatnonzero(bits[:256])}


def byte_name(byte: int) -> str:
    """A byte as a reader names it: a printable character quoted, else in hexadecimal."""
    return repr(chr(byte)) if 0x20 <= byte < 0x7F else f"byte 0x{byte:02x}"


def listed(names: set[str]) -> str:
    """At most 20 names, sorted, and how many more."""
    ordered = sorted(names)
    return ", ".join(ordered[:20]) + (f" and {len(ordered) - 20} more" if len(ordered) > 20 else "")
