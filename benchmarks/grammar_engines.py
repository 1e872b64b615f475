"""Grammar engines for structured output, measured on this CPU: llguidance, xgrammar and outlines-core.

Each engine compiles one JSON schema (an object with a bounded string, a pattern, an integer range, an
enum, a nested object and an array: the shape `client.chat.completions.parse` sends for a small Pydantic
model) against two vocabularies given only as token bytes, as gptlab's tokenizers give them
(`Tokenizer.token_bytes`), since gptlab has char, byte, BPE and imported kinds:
- a byte-level BPE of 49,152 tokens (SmolLM2's size), trained here with gptlab's BPE trainer on the
  Python standard library's own sources (always on the machine; SmolLM2's tokenizer cannot be fetched);
- a char vocabulary of 65 characters (the size of Shakespeare's), chosen so that it can spell JSON.
Then one instance of the schema, tokenized by each vocabulary, is fed token by token: before each token
the engine computes the mask of allowed tokens (timed), then consumes the token (timed apart). The
table gives the vocabulary set-up (once per tokenizer), the schema's compile time (once per schema),
and the median and 95th percentile of the per-step mask time over `--repeats` passes. Every engine
runs on the caller's threads as its default allows; the machine's load is printed with the table.
A second table says, for JSON Schema keywords that constrain values, whether each engine refuses a
schema it cannot enforce or compiles it anyway, ignoring the keyword (a grammar that "fails open").

    python benchmarks/grammar_engines.py                  # about a minute on a 2-core CPU
    python benchmarks/grammar_engines.py --vocab-size 8192 --repeats 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.common import cpu_name
from gptlab.text.tokenizer import BPETokenizer, CharTokenizer, Tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    },
    "required": ["name", "code", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "ada lovelace", "code": "ABC-42", "age": 36, "role": "editor",
            "address": {"city": "london", "zip": "10115"}, "tags": ["math", "poetry"]}
CHARS = '{}[]":,.- 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRS'  # 65, JSON-capable


def stdlib_text(limit: int = 16_000_000) -> str:
    """About `limit` characters of the Python standard library's sources (no tests), in a fixed order."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)


class Vocabulary:
    """A tokenizer's token bytes, an end-of-sequence id (an extra id after the tokenizer's when it has
    none) and the ids of one instance of SCHEMA."""

    def __init__(self, name: str, tokenizer: Tokenizer) -> None:
        self.name, self.size = name, tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos = tokenizer.eot_id if tokenizer.eot_id is not None else tokenizer.vocab_size
        if self.eos == tokenizer.vocab_size:
            self.tokens.append(b"")
        self.n = len(self.tokens)
        self.ids = tokenizer.encode(json.dumps(INSTANCE, separators=(",", ":")))
        self.lookup = {t: i for i, t in enumerate(self.tokens) if t and i != self.eos}

    def greedy(self, data: bytes) -> list[int]:
        """Longest-match ids of `data` (what llguidance asks its tokenizer for, to force bytes)."""
        ids, at = [], 0
        while at < len(data):
            end = next((e for e in range(min(len(data), at + 32), at, -1) if data[at:e] in self.lookup), None)
            if end is None:
                break
            ids.append(self.lookup[data[at:end]])
            at = end
        return ids


Engine = Callable[[Vocabulary], tuple[float, float, list[float], list[float]]]


def timed(func: Callable[[], Any]) -> tuple[Any, float]:
    begin = time.perf_counter()
    result = func()
    return result, time.perf_counter() - begin


def run_llguidance(vocab: Vocabulary) -> tuple[float, float, list[float], list[float]]:
    import llguidance
    import llguidance.numpy as llnp

    class Wrapped:  # what llguidance.TokenizerWrapper reads
        tokens, eos_token_id, bos_token_id, special_token_ids = vocab.tokens, vocab.eos, None, [vocab.eos]

        def __call__(self, data: bytes) -> list[int]:
            return vocab.greedy(data)

    tokenizer, setup = timed(lambda: llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped())))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(tokenizer, grammar))
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llnp.allocate_token_bitmask(1, vocab.n)
    masks, consumes = [], []
    for token in vocab.ids:
        masks.append(timed(lambda: llnp.fill_next_token_bitmask(matcher, bitmask))[1])
        ok, seconds = timed(lambda t=token: matcher.consume_token(t))
        assert ok, matcher.get_error()
        consumes.append(seconds)
    return setup, compile_s, masks, consumes


def run_xgrammar(vocab: Vocabulary) -> tuple[float, float, list[float], list[float]]:
    import xgrammar

    def prepare() -> Any:
        info = xgrammar.TokenizerInfo(vocab.tokens, xgrammar.VocabType.RAW, vocab_size=vocab.n,
                                      stop_token_ids=[vocab.eos])
        return xgrammar.GrammarCompiler(info, cache_enabled=False)

    compiler, setup = timed(prepare)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")))  # compact, as the others
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab.n)
    masks, consumes = [], []
    for token in vocab.ids:
        masks.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask))[1])
        ok, seconds = timed(lambda t=token: matcher.accept_token(t))
        assert ok, f"xgrammar refused token {token}"
        consumes.append(seconds)
    return setup, compile_s, masks, consumes


def run_outlines(vocab: Vocabulary) -> tuple[float, float, list[float], list[float]]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    def prepare() -> Any:
        table: dict[bytes, list[int]] = {}
        for i, token in enumerate(vocab.tokens):
            if i != vocab.eos:
                table.setdefault(token, []).append(i)
        return outlines_core.Vocabulary(vocab.eos, table)

    table, setup = timed(prepare)
    regex = build_regex_from_schema(json.dumps(SCHEMA), "")  # "": no whitespace, compact as the others
    index, compile_s = timed(lambda: outlines_core.Index(regex, table))
    guide = outlines_core.Guide(index)
    bitmask = np.zeros((vocab.n + 31) // 32, dtype=np.int32)
    masks, consumes = [], []
    for token in vocab.ids:
        masks.append(timed(lambda: guide.write_mask_into(bitmask.ctypes.data, bitmask.size, 4))[1])
        consumes.append(timed(lambda t=token: guide.advance(t, return_tokens=False))[1])
    return setup, compile_s, masks, consumes


ENGINES: dict[str, Engine] = {"llguidance": run_llguidance, "xgrammar": run_xgrammar,
                              "outlines-core": run_outlines}

# JSON Schema keywords that constrain values, which an engine must either enforce or refuse.
UNENFORCED = {
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "not": {"not": {"type": "string"}},
    "if/then": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 3}},
    "pattern with a look-ahead": {"type": "string", "pattern": "^(?=a)[a-z]+$"},
    "unknown format": {"type": "string", "format": "no-such-format"},
}


def refusals(vocab: Vocabulary) -> dict[str, list[str]]:
    """For each keyword of UNENFORCED, whether each engine refuses the schema or compiles it anyway."""
    import llguidance
    import outlines_core  # noqa: F401 (json_schema below needs the package loaded)
    import xgrammar
    from outlines_core.json_schema import build_regex_from_schema

    info = xgrammar.TokenizerInfo(vocab.tokens, xgrammar.VocabType.RAW, vocab_size=vocab.n,
                                  stop_token_ids=[vocab.eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compile_with = {  # each gives an error, or None when the schema compiled (or raises)
        "llguidance": lambda s: llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(s, overrides={"lenient": False})) or None,
        "xgrammar": lambda s: compiler.compile_json_schema(json.dumps(s)) and None,
        "outlines-core": lambda s: build_regex_from_schema(json.dumps(s), "") and None,
    }
    table = {}
    for keyword, schema in UNENFORCED.items():
        row = []
        for compile_schema in compile_with.values():
            try:
                refused = compile_schema(schema) is not None
            except (ValueError, RuntimeError):  # each engine's refusal
                refused = True
            row.append("refused" if refused else "**ignored**")
        table[keyword] = row
    return table


def measure(engine: Engine, vocab: Vocabulary, repeats: int) -> list[str]:
    """One table row: set-up and compile of the first pass, per-step times over every pass."""
    setups, compiles, masks, consumes = [], [], [], []
    for _ in range(repeats):
        setup, compile_s, mask, consume = engine(vocab)
        setups.append(setup)
        compiles.append(compile_s)
        masks += mask
        consumes += consume
    p95 = sorted(masks)[int(0.95 * (len(masks) - 1))]
    return [f"{statistics.median(setups) * 1e3:,.1f}", f"{statistics.median(compiles) * 1e3:,.1f}",
            f"{statistics.median(masks) * 1e6:,.0f}", f"{p95 * 1e6:,.0f}",
            f"{statistics.median(consumes) * 1e6:,.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=49152, help="the BPE vocabulary (default 49152)")
    parser.add_argument("--repeats", type=int, default=5, help="passes over the instance (default 5)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated, of: " + ", ".join(ENGINES))
    args = parser.parse_args()
    bpe, train_s = timed(lambda: BPETokenizer.train(stdlib_text(), args.vocab_size))
    vocabularies = [Vocabulary(f"BPE {bpe.vocab_size:,}", bpe),
                    Vocabulary(f"char {len(CHARS)}", CharTokenizer(CHARS))]
    print(f"{cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; BPE trained in "
          f"{train_s:.0f} s; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| engine | vocabulary | tokens fed | vocabulary set-up (ms) | schema compile (ms) | "
          "mask per step p50 (µs) | mask p95 (µs) | consume p50 (µs) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.engines.split(","):
        for vocab in vocabularies:
            try:
                cells = measure(ENGINES[name], vocab, args.repeats)
            except Exception as err:  # an engine that cannot take this vocabulary is a row that says so
                cells = [f"failed: {str(err).splitlines()[0][:80]}"] + [""] * 4
            print(f"| {name} | {vocab.name} | {len(vocab.ids)} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}\n")
    print("| keyword the engine cannot enforce | " + " | ".join(ENGINES) + " |")
    print("|---|" + "---|" * len(ENGINES))
    for keyword, row in refusals(vocabularies[1]).items():
        print(f"| {keyword} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
