"""Tokenizers: text <-> token ids, behind one small interface that is saved inside every checkpoint.

Four kinds, from the simplest to GPT-2's own:
- `char`: one id per distinct character of the training text (nanoGPT's shakespeare_char);
- `byte`: the 256 UTF-8 byte values, so any text can be encoded;
- `bpe`: byte-level BPE trained on the corpus with Hugging Face `tokenizers` (GPT-2's scheme, our merges);
- `gpt2`: GPT-2's own 50257-token encoding through `tiktoken`, when its files are cached locally.
A fifth, `hf`, is never trained: it is an imported model's own `tokenizer.json` (Llama family), kept as
it is, with that model's end-of-sequence id. char and byte may also hold special tokens (chat markers such
as "<|user|>", `gptlab.text.specials`), each one id after their own.

`to_dict()` gives a JSON-serialisable dict that `tokenizer_from_dict` turns back into the same
tokenizer, so a checkpoint decodes its samples without the corpus it was trained on.

Deliberate choices:
- Decoding never fails on a cut multi-byte character (a sample may end mid-character): the byte-level
  kinds replace incomplete bytes with U+FFFD.
- The end-of-text token "<|endoftext|>" written literally in a text is encoded as the eot id, as
  tiktoken does when the special token is allowed, so documents can be separated in a corpus file.
- BPE training runs in a child process (`gptlab.text.bpe`), so that Ctrl-C stops it at once;
  everything else runs here, in calls short enough (one piece of text each) to stop between.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from gptlab.config import TOKENIZERS, SettingError
from gptlab.text.bpe import EOT, train_bpe_in_worker
from gptlab.text.specials import SpecialTokens

DEFAULT_BPE_VOCAB = 4096
MIN_BPE_VOCAB = 256 + 1  # every byte, plus the end-of-text token
# Hugging Face's trainer reserves about 70 bytes per requested token before it looks at the text, and a
# failed allocation aborts the whole process (vocab_size=10**9 asks for 70 GB). The largest vocabularies
# in use are about 256k (Gemma; GPT-2 has 50k), so a million leaves room and costs at most ~70 MB.
MAX_BPE_VOCAB = 1_000_000


class DamagedTokenizerError(ValueError):
    """A saved tokenizer (a dict from to_dict, as JSON in a file) that cannot be one: damaged or foreign."""


def utf8_text(text: str) -> bytes:
    """The UTF-8 bytes of `text`, or a ValueError saying where it is not valid UTF-8.

    Python decodes command-line arguments and stdin with surrogateescape: a byte that is not UTF-8
    (`$'caf\\xe9'`, Latin-1 text) becomes a lone surrogate, which no tokenizer can encode.
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = (f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF  # surrogateescape's
                else f"the lone surrogate U+{code:04X}")
        # no position: the text may be a rendered chat, not what the user typed
        raise ValueError(f"the text is not valid UTF-8: it holds {what} (Latin-1 or another encoding?); "
                         "write it in UTF-8") from None


class Tokenizer(abc.ABC):
    """Maps text to token ids and back; `to_dict()` holds everything needed to rebuild it."""

    kind: str
    vocab_size: int
    eot_id: int | None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (ids from a sample may end in the middle of a character)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description, including "kind", that rebuilds this tokenizer exactly."""
        return {"kind": self.kind}

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as an int64 array (vectorised where the kind allows it)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: the end-of-text id (an import may have several)."""
        return () if self.eot_id is None else (self.eot_id,)

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token stands for, which may be part of a character (byte-level kinds)."""
        return self.decode([token]).encode("utf-8", "surrogatepass")  # kinds whose tokens are whole text

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        """Plain ints (ids may come as numpy or torch scalars), refusing any outside the vocabulary."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside the {self.kind} vocabulary of size {self.vocab_size}"
            )
        return ids


class CharTokenizer(Tokenizer):
    """One id per character; the vocabulary is the sorted set of the training text's characters, then any
    special tokens (`gptlab.text.specials`), each one id, matched in the text before characters."""

    kind = "char"

    def __init__(self, chars: str, specials: Sequence[str] = ()) -> None:
        if not chars:
            raise ValueError("the char tokenizer needs at least one character: train it on non-empty text")
        if len(set(chars)) != len(chars):
            raise ValueError("the char tokenizer's characters must be distinct")
        self.chars = chars
        self.specials = SpecialTokens(specials, len(chars))
        self.vocab_size = len(chars) + len(self.specials)
        self.eot_id = None
        self._symbols = [*chars, *self.specials.tokens]  # id -> its text
        # Sorted code points let encode_array look every character up at once with searchsorted.
        codes = self._code_points(chars)
        self._sorter = np.argsort(codes)
        self._codes = codes[self._sorter]

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @staticmethod
    def _code_points(text: str) -> np.ndarray:
        # UTF-32 is one 4-byte unit per character; surrogatepass keeps lone surrogates encodable.
        return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)

    def _char_ids(self, text: str, offset: int) -> np.ndarray:
        """The ids of plain text (no special token) that starts at `offset` of the whole text."""
        codes = self._code_points(text)
        slots = np.minimum(np.searchsorted(self._codes, codes), len(self._codes) - 1)
        unknown = np.flatnonzero(self._codes[slots] != codes)
        if unknown.size:
            pos = int(unknown[0])
            raise ValueError(
                f"character {text[pos]!r} at position {offset + pos} is not in the char tokenizer's "
                f"vocabulary ({len(self.chars)} characters of its training text): use the byte or bpe "
                "tokenizer, which encode any text"
            )
        return self._sorter[slots].astype(np.int64)

    def encode_array(self, text: str) -> np.ndarray:
        utf8_text(text)
        parts = [np.array([piece], dtype=np.int64) if isinstance(piece, int) else self._char_ids(piece, start)
                 for start, piece in self.specials.split(text)]
        if len(parts) == 1:  # plain text, the corpus case: one vectorised lookup, no copy
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._symbols[i] for i in self._checked_ids(ids))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars, **_specials_entry(self.specials)}


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text: 256 ids, nothing unknown, nothing to train; then any special tokens
    (`gptlab.text.specials`), each one id, matched in the text before its bytes."""

    kind = "byte"

    def __init__(self, specials: Sequence[str] = ()) -> None:
        self.specials = SpecialTokens(specials, 256)
        self.vocab_size = 256 + len(self.specials)
        self.eot_id = None

    def encode_array(self, text: str) -> np.ndarray:
        data = utf8_text(text)
        if not len(self.specials):  # the corpus case: the bytes as they are
            return np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        parts = [np.array([piece], dtype=np.int64) if isinstance(piece, int)
                 else np.frombuffer(piece.encode("utf-8"), dtype=np.uint8).astype(np.int64)
                 for _, piece in self.specials.split(text)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        # Runs of byte ids are decoded together (a character may span several), special tokens as text.
        parts, run = [], bytearray()
        for i in self._checked_ids(ids):
            if i < 256:
                run.append(i)
                continue
            parts += [run.decode("utf-8", errors="replace"), self.specials.tokens[i - 256]]
            run.clear()
        return "".join(parts) + run.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        token = self._checked_ids([token])[0]
        return bytes([token]) if token < 256 else self.specials.tokens[token - 256].encode("utf-8")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **_specials_entry(self.specials)}


def _specials_entry(specials: SpecialTokens) -> dict[str, list[str]]:
    """The "specials" entry of a char or byte tokenizer's dict; none without them, as before they existed."""
    return {"specials": list(specials.tokens)} if len(specials) else {}


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2's scheme) with merges learnt from the corpus by Hugging Face `tokenizers`."""

    kind = "bpe"

    def __init__(self, hf_json: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._hf = HFTokenizer.from_str(hf_json)
        except Exception as exc:  # tokenizers raises a bare Exception for JSON it cannot read
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise DamagedTokenizerError(
                f"saved bpe tokenizer's Hugging Face JSON is damaged ({reason})"
            ) from exc
        self.vocab_size = self._hf.get_vocab_size()
        self.eot_id = self._hf.token_to_id(EOT)

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        return cls(train_bpe_in_worker(text, vocab_size))

    def encode(self, text: str) -> list[int]:
        utf8_text(text)  # tokenizers' own error is a TypeError ("TextInputSequence must be str")
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(self._checked_ids(ids), skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        return _hf_token_bytes(self._hf, self._checked_ids([token])[0], byte_level=True)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "json": self._hf.to_str()}


class ImportedTokenizer(Tokenizer):
    """An imported model's own Hugging Face tokenizer (`tokenizer.json`), encoding as AutoTokenizer does.

    A prompt gets what the tokenizer's post-processor adds (a BOS for TinyLlama, nothing for SmolLM2
    or Qwen2); corpus text (`encode_array`) is one stream and gets none. `eot_id` is the model's
    end-of-sequence id, read from its config when it was imported.
    """

    kind = "hf"

    def __init__(self, hf_json: str, eos_id: int | None, bos_id: int | None = None,
                 more_eos_ids: Sequence[int] = ()) -> None:
        """`eos_id` is the model's first end-of-sequence id; `more_eos_ids` the others its config lists."""
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._hf = HFTokenizer.from_str(hf_json)
        except Exception as exc:  # tokenizers raises a bare Exception for JSON it cannot read
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise DamagedTokenizerError(f"saved hf tokenizer's JSON is damaged ({reason})") from exc
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self.eot_id, self.bos_id = eos_id, bos_id  # the model's own ids, as its config gave them
        self.more_eos_ids = tuple(i for i in more_eos_ids if i != eos_id)
        # Byte-level BPE (GPT-2, SmolLM2, Qwen2) spells bytes as characters; sentencepiece-style models
        # (Llama, TinyLlama) spell a space as "▁" and a byte they cannot spell as "<0xNN>".
        self._byte_level = _mentions_byte_level(json.loads(hf_json).get("decoder"))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (*super().stop_ids, *self.more_eos_ids)

    def encode(self, text: str) -> list[int]:
        utf8_text(text)
        return self._hf.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        utf8_text(text)
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(self._checked_ids(ids), skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        return _hf_token_bytes(self._hf, self._checked_ids([token])[0], self._byte_level)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "json": self._hf.to_str(), "eos_id": self.eot_id, "bos_id": self.bos_id,
                "more_eos_ids": list(self.more_eos_ids)}


class GPT2Tokenizer(Tokenizer):
    """GPT-2's own encoding (50257 tokens, eot 50256) through tiktoken, for GPT-2 weights."""

    kind = "gpt2"

    def __init__(self) -> None:
        self._encoding = load_gpt2_encoding()
        self.vocab_size = self._encoding.n_vocab
        self.eot_id = self._encoding.eot_token

    def encode(self, text: str) -> list[int]:
        utf8_text(text)
        return self._encoding.encode(text, allowed_special={EOT})

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(self._checked_ids(ids), errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self._encoding.decode_single_token_bytes(self._checked_ids([token])[0])


class SymbolTokenizer(Tokenizer):
    """A fixed list of symbols, special tokens first (the built-in seq2seq tasks' vocabulary).

    Text is read one character per symbol; special tokens such as "<eos>" are only ever produced by
    code, never parsed from text, so a user's input cannot smuggle one in.
    """

    kind = "symbols"

    def __init__(self, specials: Sequence[str], chars: str) -> None:
        if len(set(chars)) != len(chars) or any(len(c) == 1 for c in specials):
            raise ValueError("symbols must be distinct characters after multi-character special tokens")
        self.specials, self.chars = list(specials), chars
        self.symbols = self.specials + list(chars)
        self.vocab_size = len(self.symbols)
        self.eot_id = self.symbols.index("<eos>") if "<eos>" in self.specials else None
        self._ids = {c: len(self.specials) + i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        bad = next((c for c in text if c not in self._ids), None)
        if bad is not None:
            raise ValueError(f"character {bad!r} is not in this vocabulary: use only {self.chars!r}")
        return [self._ids[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.symbols[i] for i in self._checked_ids(ids))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "specials": self.specials, "chars": self.chars}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level spelling, reversed: the character that stands for each byte -> the byte.

    Bytes that print as themselves (! to ~, and Latin-1's printable range but the soft hyphen) keep their
    character; the other 68 bytes, in order, take the characters from U+0100 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    spelled = {chr(b): b for b in printable}
    spelled.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return spelled


BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


def _mentions_byte_level(decoder: Any) -> bool:
    """Whether a Hugging Face decoder description (a dict, perhaps a Sequence of them) is byte-level."""
    if not isinstance(decoder, dict):
        return False
    return decoder.get("type") == "ByteLevel" or any(map(_mentions_byte_level, decoder.get("decoders") or []))


def _hf_token_bytes(hf: Any, token: int, byte_level: bool) -> bytes:
    """The bytes of one token of a Hugging Face tokenizer: a special token's text, or its piece unspelled."""
    added = hf.get_added_tokens_decoder().get(token)
    piece = hf.id_to_token(token)
    if added is not None or piece is None:
        return hf.decode([token], skip_special_tokens=False).encode("utf-8")
    if byte_level and all(c in BYTE_LEVEL for c in piece):
        return bytes(BYTE_LEVEL[c] for c in piece)
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")


def load_gpt2_encoding() -> Any:
    """tiktoken's "gpt2" encoding, or a ValueError that says what is missing and how to get it."""
    try:
        import tiktoken
    except ImportError:
        raise SettingError(
            "the gpt2 tokenizer needs the tiktoken package (the gpt2 extra): `pip install 'gptlab[gpt2]'` "
            "or `pip install tiktoken` and run once with internet to cache GPT-2's files, or use {t} bpe",
            t="tokenizer",
        ) from None
    try:
        return tiktoken.get_encoding("gpt2")
    # tiktoken downloads the files on first use and fails with whatever the network layer raises
    # (requests or urllib errors, OSError, a hash-mismatch ValueError), so every failure is caught.
    except Exception as exc:
        raise SettingError(
            f"tiktoken could not load GPT-2's encoding files ({type(exc).__name__}): run once with internet "
            "to cache them, or set TIKTOKEN_CACHE_DIR to a folder that holds them (tiktoken's default "
            "cache is data-gym-cache in the temp folder); or use {t} bpe", t="tokenizer",
        ) from exc


def check_tokenizer_args(kind: str, vocab_size: int | None) -> None:
    """Raise a ValueError for an unknown kind or a vocab_size the kind cannot honour (before any work)."""
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {kind!r}: choose one of {', '.join(TOKENIZERS)}")
    if vocab_size is None:
        return
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(f"vocab_size={vocab_size!r} must be a whole number: for example {DEFAULT_BPE_VOCAB}")
    if kind != "bpe":
        raise SettingError(
            f"vocab_size={vocab_size} applies only to the bpe tokenizer; the {kind} tokenizer's "
            "vocabulary is fixed by its kind or the text: drop vocab_size or use {t} bpe", t="tokenizer",
        )
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"bpe vocab_size={vocab_size} is too small: it needs at least {MIN_BPE_VOCAB} "
            "(256 bytes and the end-of-text token)"
        )
    if vocab_size > MAX_BPE_VOCAB:
        raise ValueError(
            f"bpe vocab_size={vocab_size} is too large: the most is {MAX_BPE_VOCAB:,} (GPT-2 uses 50,257); "
            f"for example {DEFAULT_BPE_VOCAB}"
        )


def train_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> Tokenizer:
    """A tokenizer of `kind` for `text`: char and bpe learn their vocabulary from it; byte, gpt2 are fixed."""
    check_tokenizer_args(kind, vocab_size)
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        return BPETokenizer.train(text, vocab_size or DEFAULT_BPE_VOCAB)
    return ByteTokenizer() if kind == "byte" else GPT2Tokenizer()


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer that `Tokenizer.to_dict()` described (for example from a checkpoint).

    Anything else (a damaged file, another program's JSON) is a DamagedTokenizerError, which callers
    that know the file name should turn into a message naming it. A gpt2 tokenizer needs tiktoken and
    GPT-2's files; without them it is a plain ValueError that says how to get them.
    """
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind not in (*TOKENIZERS, SymbolTokenizer.kind, ImportedTokenizer.kind):
        known = ", ".join((*TOKENIZERS, SymbolTokenizer.kind, ImportedTokenizer.kind))
        raise DamagedTokenizerError(f"not a saved tokenizer: kind={kind!r} is not one of {known}")
    if kind in ("char", "byte"):  # saved before these kinds took special tokens: none
        d = {"specials": [], **d}
    fields: dict[str, dict[str, type[str] | type[list]]] = {
        "char": {"chars": str, "specials": list}, "byte": {"specials": list}, "bpe": {"json": str},
        "hf": {"json": str}, "symbols": {"specials": list, "chars": str}}
    for field, field_type in fields.get(kind, {}).items():
        value = d.get(field)
        if not isinstance(value, field_type) or not all(isinstance(s, str) for s in value):
            what = "list of strings" if field_type is list else "string"
            raise DamagedTokenizerError(
                f"saved {kind} tokenizer lacks its {field!r} {what}: the tokenizer file is damaged"
            )
    try:
        if kind == SymbolTokenizer.kind:
            return SymbolTokenizer(d["specials"], d["chars"])
        if kind == "char":
            return CharTokenizer(d["chars"], d["specials"])
        if kind == "byte":
            return ByteTokenizer(d["specials"])
    except ValueError as exc:  # characters or special tokens repeated, none at all, ...
        raise DamagedTokenizerError(f"saved {kind} tokenizer is damaged: {exc}") from exc
    if kind == "bpe":
        return BPETokenizer(d["json"])
    if kind == ImportedTokenizer.kind:
        ids = {name: d.get(name) for name in ("eos_id", "bos_id")}
        for name, value in ids.items():
            if value is not None and not isinstance(value, int):
                raise DamagedTokenizerError(f"saved hf tokenizer's {name}={value!r} is not an integer")
        more = d.get("more_eos_ids", [])  # absent in runs imported before it was kept
        if not isinstance(more, list) or not all(isinstance(i, int) for i in more):
            raise DamagedTokenizerError(f"saved hf tokenizer's more_eos_ids={more!r} is not a list of ints")
        return ImportedTokenizer(d["json"], ids["eos_id"], ids["bos_id"], more)
    return GPT2Tokenizer()
