"""Teaching a model to chat: a Hugging Face folder's chat template, the native template's markers added
to a tokenizer (`tokenizer_with_tokens`; special tokens of a char or byte one) and to the model's
embeddings (`gptlab.lora.grow_embeddings`), and where a conversation's tokenizer and template come from
(`chat_source`). The templates are `gptlab.text.chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.config import SettingError
from gptlab.interop import hf_folder
from gptlab.lora import grow_embeddings
from gptlab.model import GPT
from gptlab.text.chat_template import (
    ChatTemplate,
    JinjaTemplate,
    NativeTemplate,
    missing_tokens,
    template_from_state,
)
from gptlab.text.tokenizer import ImportedTokenizer, Tokenizer, tokenizer_from_dict


def chat_template_for(tokenizer_config: Mapping[str, Any]) -> JinjaTemplate | None:
    """The chat template a Hugging Face `tokenizer_config.json` holds (its default one), or None."""
    saved = hf_folder.chat_template_from_config(tokenizer_config)
    return None if saved is None else JinjaTemplate(saved["source"], saved["tokens"])


def load_hf_chat_template(hf_dir: str | Path) -> JinjaTemplate | None:
    """The chat template of a Hugging Face folder (`hf_folder.chat_template`), or None."""
    saved = hf_folder.chat_template(Path(hf_dir))
    return None if saved is None else JinjaTemplate(saved["source"], saved["tokens"])


def tokenizer_with_tokens(tokenizer: Tokenizer, tokens: Sequence[str]) -> Tokenizer:
    """A copy of the tokenizer that encodes each of `tokens` as one new id, appended after its ids: a special
    token of a char or byte tokenizer, an added token of a bpe, gpt2 or hf one."""
    saved = tokenizer.to_dict()
    if saved["kind"] in ("char", "byte"):
        return tokenizer_from_dict({**saved, "specials": [*saved.get("specials", []), *tokens]})
    if saved["kind"] == "gpt2":  # tiktoken's ranks as the same BPE in Hugging Face's format, which can grow
        from gptlab.interop.hf_tokenizer import hf_tokenizer_json

        saved = {"kind": "bpe", "json": hf_tokenizer_json(saved)}
    if saved["kind"] not in ("bpe", ImportedTokenizer.kind):
        raise SettingError(f"the {saved['kind']} tokenizer cannot take new tokens such as {tokens[0]!r}: "
                           "fine-tune a run trained with {t} char, byte or bpe, or use {\"text\"} or "
                           '{"prompt", "completion"} examples, which need no chat template', t="tokenizer")
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(saved["json"])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    return tokenizer_from_dict({**saved, "json": hf.to_str()})


def add_chat_tokens(model: GPT, tokenizer: Tokenizer, template: ChatTemplate) -> tuple[GPT, Tokenizer]:
    """The model and tokenizer with the template's missing markers added as single ids (unchanged if none)."""
    missing = missing_tokens(tokenizer, template)
    if not missing:
        return model, tokenizer
    grown = tokenizer_with_tokens(tokenizer, missing)
    return grow_embeddings(model, token_ids(grown, missing), mean_of=tokenizer.vocab_size), grown


def token_ids(tokenizer: Tokenizer, tokens: Sequence[str]) -> list[int]:
    """The one id each of `tokens` encodes as (each must be a single id of the tokenizer)."""
    return [int(tokenizer.encode_array(t)[0]) for t in tokens]


@dataclass
class ChatSource:
    """What rendering and tokenising fine-tuning data needs from a run or a Hugging Face folder."""

    tokenizer: Tokenizer
    template: ChatTemplate
    block_size: int
    notes: list[str]


def chat_source(path: str | Path, conversations: bool = True) -> ChatSource:
    """The tokenizer, chat template and context length of a gptlab run, or of a Hugging Face folder
    (tokenizer.json, tokenizer_config.json, config.json). For `conversations`, markers a native template
    needs and the tokenizer lacks are added to it, as fine-tuning would add them (the notes say so)."""
    from gptlab.checkpoint import has_checkpoint, load_header

    path = Path(path)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and not has_checkpoint(path):
        source = _hf_source(path)
    else:
        header = load_header(path)
        source = ChatSource(header.load_tokenizer(), template_from_state(header.state),
                            header.model_config.block_size, [])
    missing = missing_tokens(source.tokenizer, source.template) if conversations else []
    if missing:
        source.tokenizer = tokenizer_with_tokens(source.tokenizer, missing)
        source.notes.append(f"added {', '.join(missing)} to the tokenizer as new ids, as fine-tuning will")
    return source


def _hf_source(hf_dir: Path) -> ChatSource:
    """A Hugging Face folder's tokenizer (its end-of-sequence token from tokenizer_config.json), template
    (native when it has none) and context length (config.json)."""
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    block_size = config.get("max_position_embeddings") or config.get("n_positions") or config.get("n_ctx")
    if not isinstance(block_size, int):
        raise ValueError(f"{hf_dir / 'config.json'} gives no context length (max_position_embeddings)")
    template = load_hf_chat_template(hf_dir)
    tokens = template.tokens if template else {}
    from tokenizers import Tokenizer as HFTokenizer

    hf_json = (hf_dir / "tokenizer.json").read_text(encoding="utf-8")
    vocabulary = HFTokenizer.from_str(hf_json)
    ids = {name: vocabulary.token_to_id(tokens[name]) if name in tokens else None
           for name in ("eos_token", "bos_token")}
    tokenizer = ImportedTokenizer(hf_json, ids["eos_token"], ids["bos_token"])
    notes = [] if template else [f"{hf_dir} has no chat template: using gptlab's native one"]
    return ChatSource(tokenizer, template or NativeTemplate(), block_size, notes)
