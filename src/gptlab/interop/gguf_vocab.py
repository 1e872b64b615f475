"""The vocabulary of a GGUF file: a gptlab tokenizer as one of llama.cpp's tokenizer models, and back.

- Byte-level BPE (`bpe`, `gpt2`, an imported GPT-2-style `hf`) is llama.cpp's `gpt2` model: the same
  pieces and merges, and GPT-2's split pattern.
- `char` and `byte` are llama.cpp's `rwkv` model, which cuts text into the longest pieces of its vocabulary,
  byte by byte. With pieces of one character (or one byte) each, that is exactly gptlab's encoding, and
  llama.cpp writes each piece back byte for byte. Special tokens (`gptlab.text.specials`) are CONTROL
  pieces, matched as gptlab matches them: at the leftmost place, the longest first. No BOS is added.
Why not SentencePiece (`llama`) or the `gpt2` model with one piece per character: llama.cpp gives those
models a BOS and an EOS by default (ids 1 and 2; 11 and 11) that no metadata can switch off (an id outside
the vocabulary keeps the default), so generation would stop at whatever character has id 2. `rwkv` has no
default special tokens. (llama-vocab.cpp of llama.cpp as llama-cpp-python 0.3.36 vendors it.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gptlab.common import need
from gptlab.interop.hf_tokenizer import byte_level_bpe, hf_tokenizer_json
from gptlab.text.tokenizer import EOT, Tokenizer, tokenizer_from_dict

PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's split pattern, the one gptlab's byte-level kinds use
SAVED_KEY = "gptlab.tokenizer"  # the char or byte tokenizer itself, as to_dict gives it, for load_gguf
WHOLE_PIECES = ("char", "byte")  # the kinds written as llama.cpp's rwkv model


@dataclass(frozen=True)
class GGUFVocab:
    """A tokenizer as llama.cpp's tokenizer `model` ("gpt2" or "rwkv") holds it, with notes for the user."""

    model: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    eos_id: int | None
    saved: dict[str, Any] | None = None  # a char or byte tokenizer's to_dict
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Pieces of llama.cpp's rwkv model


def rwkv_piece(data: bytes) -> str:
    """A piece as llama.cpp's rwkv model spells it: `\\` doubled, other unprintable characters and bytes
    that are no character alone as `\\xhh` (llama.cpp reads only lower-case hex digits)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{b:02x}" for b in data)
    return "".join("\\\\" if c == "\\" else c if c.isprintable() else
                   "".join(f"\\x{b:02x}" for b in c.encode("utf-8")) for c in text)


def rwkv_bytes(piece: str) -> bytes:
    """The bytes a piece of llama.cpp's rwkv model stands for (the inverse of rwkv_piece; llama.cpp also
    reads \\n, \\t and \\r)."""
    out, chars = bytearray(), iter(piece.encode("utf-8"))
    for byte in chars:
        if byte != ord("\\"):
            out.append(byte)
            continue
        escaped = next(chars)
        if escaped == ord("x"):
            out.append(int(bytes([next(chars), next(chars)]), 16))
        else:
            out.append({ord("n"): 10, ord("t"): 9, ord("r"): 13}.get(escaped, escaped))
    return bytes(out)


def _whole_pieces(tokenizer: Tokenizer, specials: Sequence[str]) -> list[bytes]:
    """Each id's bytes, for a char or byte tokenizer: its characters or bytes, then its special tokens."""
    pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    first = tokenizer.vocab_size - len(specials)
    assert [p.decode("utf-8") for p in pieces[first:]] == list(specials), "special tokens come last"
    assert len(set(pieces)) == len(pieces), "two ids of the tokenizer stand for the same text"
    return pieces


def _looping_note(pieces: list[bytes]) -> list[str]:
    """A warning where llama.cpp's rwkv tokenizer would loop: given a byte that starts a piece but is no
    piece itself, followed by bytes no piece continues with, it starts again from the beginning of the text,
    forever (llama-vocab.cpp, llm_tokenizer_rwkv_session). A vocabulary of single bytes never does; one
    with a character of several bytes, or a special token starting with no character of its own, does for
    some text gptlab refuses anyway (a character outside the vocabulary)."""
    known = set(pieces)
    starts = [p.decode("utf-8", "replace") for p in pieces if p[:1] not in known]
    if not starts:
        return []
    return [f"give llama.cpp only characters of the vocabulary: it loops until memory runs out on one "
            f"outside it that starts with the same byte as {', '.join(starts[:3])}"
            f"{' or another' if len(starts) > 3 else ''} (a bug of its rwkv tokenizer)"]


def _rwkv_vocab(saved: dict[str, Any], vocab_size: int) -> GGUFVocab:
    """A char or byte tokenizer as llama.cpp's rwkv model (see the module docstring)."""
    gguf = need("gguf", "gguf", "export-gguf")

    tokenizer = tokenizer_from_dict(saved)
    specials = saved.get("specials", [])
    pieces = _whole_pieces(tokenizer, specials)
    first_special = len(pieces) - len(specials)
    types = [gguf.TokenType.NORMAL] * first_special + [gguf.TokenType.CONTROL] * len(specials)
    # Rows the tokenizer never produces: a 0xff byte, which UTF-8 text never holds, keeps them unmatched.
    pads = [f"\\xff[PAD{i}]" for i in range(len(pieces), vocab_size)]
    return GGUFVocab("rwkv", [rwkv_piece(p) for p in pieces] + pads,
                     [int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * len(pads), [],
                     tokenizer.eot_id, saved, _looping_note(pieces))


def _bpe_vocab(saved: Mapping[str, Any]) -> tuple[list[str], set[str], list[str], int | None]:
    """A byte-level BPE's pieces in id order, its special ones, its merges and its end-of-text id."""
    kind = saved["kind"]
    hf = json.loads(hf_tokenizer_json(saved))
    pre = hf.get("pre_tokenizer") or {}
    if hf["model"]["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError(f"the {kind} tokenizer is not GPT-2's byte-level BPE, the one scheme gptlab "
                         "vouches llama.cpp splits alike: export it with gptlab export-hf and convert "
                         "that folder with llama.cpp's convert_hf_to_gguf.py, which knows many more")
    vocab = hf["model"]["vocab"]
    specials = {t["content"] for t in hf.get("added_tokens", []) if t.get("special")}
    vocab |= {t["content"]: t["id"] for t in hf.get("added_tokens", [])}
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"the {kind} tokenizer's ids are not 0..{len(tokens) - 1} without gaps")
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]]
    return tokens, specials, merges, saved.get("eos_id") if kind == "hf" else vocab.get(EOT)


def gguf_vocab(saved: dict[str, Any], vocab_size: int) -> GGUFVocab:
    """A saved gptlab tokenizer (to_dict) as llama.cpp's tokenizer, padded to the model's vocabulary; one
    llama.cpp may split otherwise is a ValueError."""
    gguf = need("gguf", "gguf", "export-gguf")

    size = tokenizer_from_dict(saved).vocab_size
    if size > vocab_size:
        raise ValueError(f"the tokenizer has {size} ids but the model only {vocab_size}")
    if saved["kind"] in WHOLE_PIECES:
        return _rwkv_vocab(saved, vocab_size)
    tokens, specials, merges, eos = _bpe_vocab(saved)
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    pads = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]  # rows the tokenizer never produces
    unused = [int(gguf.TokenType.UNUSED)] * len(pads)
    return GGUFVocab("gpt2", tokens + pads, [int(t) for t in types] + unused, merges, eos)


def write_vocab(writer: Any, vocab: GGUFVocab, arch: str) -> None:
    """The tokenizer's metadata, in llama.cpp's keys."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_add_bos_token(False)  # gptlab adds nothing to a prompt
    if vocab.model == "rwkv":
        writer.add_string(SAVED_KEY, json.dumps(vocab.saved))
    else:
        writer.add_tokenizer_pre(PRE_TOKENIZER)
        writer.add_token_merges(vocab.merges)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
        if arch == "gpt2" and vocab.model == "gpt2":  # GPT-2's one special token is both
            writer.add_bos_token_id(vocab.eos_id)


def read_vocab(field: Any) -> GGUFVocab:
    """The vocabulary of a GGUF file whose metadata `field(key, default)` reads."""
    model = field("tokenizer.ggml.model")
    if model not in ("gpt2", "rwkv"):
        raise ValueError(f"the file's tokenizer is llama.cpp's {model!r} model: gptlab reads the gpt2 and "
                         "rwkv models export-gguf writes")
    saved = field(SAVED_KEY)
    return GGUFVocab(model, list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.token_type")),
                     list(field("tokenizer.ggml.merges", [])), field("tokenizer.ggml.eos_token_id"),
                     None if saved is None else json.loads(saved))


def tokenizer_from_vocab(vocab: GGUFVocab) -> Tokenizer:
    """The gptlab tokenizer that encodes as the GGUF vocabulary does: a char or byte one as it was saved, a
    byte-level BPE as a bpe tokenizer (unused padding rows left out)."""
    gguf = need("gguf", "gguf", "reading a GGUF file")

    if vocab.model == "rwkv":
        if vocab.saved is None:
            raise ValueError(f"the file's rwkv vocabulary has no {SAVED_KEY}: gptlab reads only the char and "
                             "byte vocabularies export-gguf writes")
        return tokenizer_from_dict(vocab.saved)
    used = {t: i for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
            if kind != gguf.TokenType.UNUSED}
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    return tokenizer_from_dict({"kind": "bpe", "json": byte_level_bpe(used, merges)})  # type: ignore[arg-type]
