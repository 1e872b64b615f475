"""export-hf of char and byte runs (the demo model's kinds): `AutoTokenizer` encodes and decodes exactly as
gptlab does, and the exported model's greedy text from "ROMEO:" is gptlab's; a kind that cannot be written
exactly is refused by name, with nothing written. Their special tokens (chat markers) are added special tokens
that `AutoTokenizer` matches as gptlab does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_huggingface import needs_transformers, save_run

from gptlab.config import ModelConfig, SamplingConfig
from gptlab.generate import stream_text
from gptlab.inference.loading import load
from gptlab.interop.huggingface import export_hf
from gptlab.text.chat_template import NativeTemplate
from gptlab.text.tokenizer import SymbolTokenizer, Tokenizer, tokenizer_from_dict, train_tokenizer

CORPUS = ("ROMEO:\nBut soft, what light through yonder window breaks?\n"
          "It is the east, and Juliet is the sun.\n\n"
          "JULIET:\tO Romeo, Romeo! wherefore art thou Romeo? 'Tis but thy name is my enemy; don't ...\n")
# Letters, punctuation, runs of spaces, newlines and a tab; " ," and " ." and "n't" are what transformers'
# clean_up_tokenization_spaces would rewrite, were it on.
TEXT = "ROMEO:  soft , what light ?\n\n\tJULIET: O Romeo; 'tis thy name . don't!\n"
PROMPT, NEW_TOKENS = "ROMEO:", 24


def exported(kind: str, root: Path, specials: Sequence[str] = ()) -> tuple[Tokenizer, Path]:
    """A run of `kind` trained on CORPUS (random weights spread far from their init), with `specials` as
    special tokens, exported to root/hf."""
    tokenizer = train_tokenizer(kind, CORPUS)
    if specials:
        tokenizer = tokenizer_from_dict({**tokenizer.to_dict(), "specials": list(specials)})
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)
    save_run(root / "run", config, tokenizer)
    export_hf(root / "run", root / "hf")
    return tokenizer, root / "hf"


def auto_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@needs_transformers
@pytest.mark.parametrize("kind", ["char", "byte"])
def test_auto_tokenizer_encodes_and_decodes_as_gptlab(kind: str, tmp_path: Path) -> None:
    tokenizer, folder = exported(kind, tmp_path)
    hf = auto_tokenizer(folder)
    assert hf.vocab_size == len(hf) == tokenizer.vocab_size  # was 0: the characters were not exported
    ids = tokenizer.encode(TEXT)
    assert hf.encode(TEXT) == ids and hf(TEXT).input_ids == ids  # no BOS or EOS added
    assert hf.decode(ids) == tokenizer.decode(ids) == TEXT


@needs_transformers
def test_a_character_outside_the_char_vocabulary_is_an_error_in_both(tmp_path: Path) -> None:
    tokenizer, folder = exported("char", tmp_path)
    hf = auto_tokenizer(folder)
    with pytest.raises(ValueError, match="not in the char tokenizer's vocabulary"):
        tokenizer.encode("ROMEO~")
    with pytest.raises(Exception, match=r"Missing \[UNK\] token"):  # tokenizers' own error, not a wrong id
        hf.encode("ROMEO~")


@needs_transformers
def test_the_byte_kind_encodes_any_text_and_decodes_a_cut_character_alike(tmp_path: Path) -> None:
    tokenizer, folder = exported("byte", tmp_path)
    hf = auto_tokenizer(folder)
    text = "naïve — 日本語 🙂\r\n"
    ids = tokenizer.encode(text)
    assert hf.encode(text) == ids and hf.decode(ids) == text
    for cut in (ids[:-3], ids[:3] + ids[4:], [0xE6, 0x97], [0xC0, 0xAF, 0xF0, 0x80]):
        assert hf.decode(cut) == tokenizer.decode(cut)  # U+FFFD for the same bytes


@needs_transformers
@pytest.mark.parametrize("kind", ["char", "byte"])
def test_greedy_text_from_the_exported_folder_is_gptlabs(kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _, folder = exported(kind, tmp_path)
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    sampling = SamplingConfig(temperature=0, max_new_tokens=NEW_TOKENS)
    ours = PROMPT + "".join(chunk.text for chunk in stream_text(model, tokenizer, PROMPT, sampling))
    hf, hf_model = auto_tokenizer(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = hf(PROMPT, return_tensors="pt").input_ids
    out = hf_model.generate(prompt, attention_mask=prompt.new_ones(prompt.shape), do_sample=False,
                            max_new_tokens=NEW_TOKENS, pad_token_id=0)
    assert hf.decode(out[0]) == ours
    assert len(set(ours[len(PROMPT):])) > 3, "a degenerate model would make this comparison weak"


@needs_transformers
@pytest.mark.parametrize("kind", ["char", "byte"])
def test_special_tokens_are_added_tokens_that_auto_tokenizer_matches_first_and_longest(kind: str,
                                                                                      tmp_path: Path) -> None:
    specials = [*NativeTemplate.special_tokens, "<|e"]
    tokenizer, folder = exported(kind, tmp_path, specials)
    hf = auto_tokenizer(folder)
    first = tokenizer.vocab_size - 5  # the markers follow the kind's own ids, in order
    added = {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
    assert len(hf) == tokenizer.vocab_size and added == {first + i: (t, True) for i, t in enumerate(specials)}
    user = first + 1
    assert hf.encode("<|user|>hi") == tokenizer.encode("<|user|>hi") == [user, *tokenizer.encode("hi")]
    conversation = NativeTemplate().render([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": TEXT}], add_generation_prompt=True)
    for text in (conversation, "<|end|><|eRomeo<|end|>", "JULIET:<|assistant|><|user|>\n"):
        ids = tokenizer.encode(text)
        assert hf.encode(text) == ids and hf.decode(ids) == tokenizer.decode(ids) == text
    assert tokenizer.encode("<|end|>") == [first + 3]  # "<|end|>" whole, not "<|e" then "nd|>"


def test_a_tokenizer_kind_that_cannot_be_written_exactly_is_refused_by_name(tmp_path: Path) -> None:
    tokenizer = SymbolTokenizer(["<pad>", "<eos>"], "abc")
    save_run(tmp_path / "run", ModelConfig(vocab_size=tokenizer.vocab_size, block_size=8, n_layer=1,
                                           n_head=2, n_embd=8), tokenizer)
    with pytest.raises(ValueError, match="the symbols tokenizer cannot be written as a Hugging Face") as err:
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()
