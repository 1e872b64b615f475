"""gptlab's tokenizers as Hugging Face tokenizer files, and back: tokenizer.json (the `tokenizers`
library's format), GPT-2's vocab.json and merges.txt, and GPT-2's own vocabulary rebuilt from tiktoken's.

`bpe` exports its own tokenizers JSON; `gpt2` rebuilds GPT-2's vocabulary and merges from tiktoken's
ranks; `char` becomes a word-level vocabulary read one character at a time, and `byte` a byte-level BPE
without merges (byte b is id b); their special tokens (chat markers) become added special tokens, with
the same ids, matched before the rest as gptlab matches them. An imported Llama or Qwen2 keeps its
tokenizer.json as an `hf` tokenizer. Only the `tokenizers` library is needed; the GGUF export
(`gptlab.interop.gguf`) writes its vocabulary from the same functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gptlab.config import SettingError
from gptlab.interop.gpt2 import GPT2_VOCAB
from gptlab.interop.hf_folder import eos_ids, generation_config, token_ids
from gptlab.text.tokenizer import EOT, ImportedTokenizer, tokenizer_from_dict


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (vocab.json's alphabet).

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 take the
    characters from U+0100 upwards, in byte order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def byte_level_bpe(vocab: Mapping[str, int], merges: list[tuple[str, str]]) -> str:
    """Tokenizers JSON of a byte-level BPE set up like gptlab's bpe kind (GPT-2's split, no prefix space)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    hf = HFTokenizer(models.BPE(dict(vocab), merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    if EOT in vocab:
        hf.add_special_tokens([EOT])
    return hf.to_str()


def bpe_json_from_ranks(ranks: Mapping[bytes, int], special: Mapping[str, int]) -> str:
    """A byte-level BPE (tokenizers JSON) from tiktoken's form: token bytes -> id, merged in id order.

    tiktoken keeps no merge list: the merge that made a token is found by running BPE on the
    token's own bytes with only lower-ranked tokens, which leaves exactly two parts.
    """
    spell = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    merges = [tuple(map(text, _last_merge(token, ranks))) for token in by_rank if len(token) > 1]
    vocab = {**{text(token): rank for token, rank in ranks.items()}, **special}
    return byte_level_bpe(vocab, merges)  # type: ignore[arg-type]


def _last_merge(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins last when it encodes `token` with only lower-ranked tokens."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        # the lowest-ranked adjacent pair, leftmost first, as tiktoken's encoder chooses
        pairs = enumerate(zip(parts, parts[1:], strict=False))
        rank, i = min((ranks.get(a + b, limit), i) for i, (a, b) in pairs)
        if rank >= limit:
            raise ValueError(f"token {token!r} is not made of lower-ranked tokens: not a BPE vocabulary")
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def char_level_json(chars: str) -> str:
    """Tokenizers JSON of gptlab's char kind: each character is one token, id i is `chars[i]`, and a
    character outside them is an error (tokenizers: "Missing [UNK] token"), as in gptlab."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")  # every character, newlines too
    hf.decoder = decoders.Fuse()  # the characters joined as they are, no spaces added
    return hf.to_str()


def with_specials(hf_json: str, specials: Sequence[str]) -> str:
    """Tokenizers JSON with `specials` added as special tokens, numbered in order after its vocabulary, as a
    char or byte tokenizer numbers them (`gptlab.text.specials`); both match the longest first."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    if not specials:
        return hf_json
    hf = HFTokenizer.from_str(hf_json)
    first = hf.get_vocab_size(with_added_tokens=True)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert [hf.token_to_id(t) for t in specials] == list(range(first, first + len(specials))), \
        "special tokens are numbered after the vocabulary, in order"
    return hf.to_str()


def hf_tokenizer_json(tokenizer: Mapping[str, Any]) -> str:
    """Tokenizers JSON that encodes and decodes exactly like a saved gptlab tokenizer; a kind that cannot be
    written exactly is refused (a SettingError naming it)."""
    kind = tokenizer["kind"]
    if kind in ("bpe", ImportedTokenizer.kind):
        return tokenizer["json"]
    if kind == "char":
        return with_specials(char_level_json(tokenizer["chars"]), tokenizer.get("specials", []))
    if kind == "byte":  # no merges: each byte's GPT-2 spelling is one token, byte b is id b
        plain = byte_level_bpe({spelled: b for b, spelled in byte_to_unicode().items()}, [])
        return with_specials(plain, tokenizer.get("specials", []))
    if kind == "gpt2":
        # tokenizer.py's loader, for its error message that says how to get tiktoken's files
        from gptlab.text.tokenizer import load_gpt2_encoding

        encoding = load_gpt2_encoding()
        eot = encoding.eot_token
        ranks = {encoding.decode_single_token_bytes(i): i for i in range(encoding.n_vocab) if i != eot}
        return bpe_json_from_ranks(ranks, {EOT: eot})
    raise SettingError(f"the {kind} tokenizer cannot be written as a Hugging Face tokenizer that encodes as "
                       "gptlab does: train with {t} char, byte or bpe", t="tokenizer")


def damaged_file(path: Path, exc: BaseException) -> ValueError:
    """One line naming a tokenizer file that cannot be read, and the first line of the reason."""
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return ValueError(f"{path} is not a readable tokenizer file ({reason}): copy it again from the model's "
                      "repository")


def read_hf_tokenizer(hf_dir: Path, vocab_size: int) -> tuple[dict[str, Any], str]:
    """A gptlab tokenizer dict from a GPT-2 folder's tokenizer files, and a note on what was used."""
    from tokenizers import Tokenizer as HFTokenizer

    if (hf_dir / "tokenizer.json").is_file():
        source = "tokenizer.json"
        try:
            tokenizer_json = HFTokenizer.from_file(str(hf_dir / source)).to_str()
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
            raise damaged_file(hf_dir / source, exc) from exc
    elif (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        try:
            vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
        except ValueError as exc:  # not UTF-8, or not JSON
            raise damaged_file(hf_dir / "vocab.json", exc) from exc
        lines = (hf_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
        if any(len(merge) != 2 for merge in merges):
            raise ValueError(f"{hf_dir / 'merges.txt'} is not a merges file: every line must be two tokens")
        tokenizer_json, source = byte_level_bpe(vocab, merges), "vocab.json and merges.txt"  # type: ignore[arg-type]
    elif vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}, "no tokenizer files: using GPT-2's own encoding through tiktoken (gpt2 kind)"
    else:
        raise ValueError(
            f"{hf_dir} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt) and its "
            f"vocabulary of {vocab_size} is not GPT-2's {GPT2_VOCAB}: add the tokenizer files to the folder"
        )
    tokenizer = tokenizer_from_dict({"kind": "bpe", "json": tokenizer_json})
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer in {hf_dir} has {tokenizer.vocab_size} ids but the model only "
                         f"{vocab_size}: the tokenizer files belong to another model")
    return tokenizer.to_dict(), f"tokenizer from {source}: {tokenizer.vocab_size} ids (bpe kind)"


def read_llama_tokenizer(hf_dir: Path, hf_config: Mapping[str, Any],
                         vocab_size: int) -> tuple[dict[str, Any], str]:
    """An imported model's tokenizer.json as an `hf` tokenizer, with the ids its config.json gives; every
    end-of-sequence id it or generation_config.json lists ends a generation (Llama 3 lists three)."""
    if not (hf_dir / "tokenizer.json").is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json: save the tokenizer beside the model "
                         "(tokenizer.save_pretrained) and import again")
    ends = eos_ids(hf_dir, dict(hf_config))
    bos = token_ids(hf_config.get("bos_token_id")) or token_ids(generation_config(hf_dir).get("bos_token_id"))
    try:
        tokenizer = ImportedTokenizer((hf_dir / "tokenizer.json").read_text(encoding="utf-8"),
                                      ends[0] if ends else None, bos[0] if bos else None, ends[1:])
    except (ValueError, AttributeError) as exc:  # not UTF-8, not a tokenizer, or JSON but not an object
        raise damaged_file(hf_dir / "tokenizer.json", exc) from exc
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer in {hf_dir} has {tokenizer.vocab_size} ids but the model only "
                         f"{vocab_size}: the tokenizer files belong to another model")
    said = "no end-of-sequence id" if not ends else f"end of sequence {', '.join(map(str, ends))}"
    return tokenizer.to_dict(), f"tokenizer from tokenizer.json: {tokenizer.vocab_size} ids, {said} (hf kind)"
