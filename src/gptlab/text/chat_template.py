"""Chat templates: a conversation (a list of {"role", "content"} messages) as the one text a model reads.

Two kinds behind one interface (`ChatTemplate.render`):
- `JinjaTemplate`: a Hugging Face model's own `chat_template`, rendered as transformers'
  `apply_chat_template(..., tokenize=False)` renders it: a sandboxed, immutable Jinja environment with
  trim_blocks and lstrip_blocks, the loop-control extension, `raise_exception`, `strftime_now`, a
  `tojson` that does not escape HTML, and the tokenizer's special tokens (bos_token, eos_token, ...) as
  variables. Templates come from the Hub, so they are untrusted code: the sandbox is not optional.
- `NativeTemplate`: gptlab's own, for models trained here. Every message is
      <|ROLE|>\nCONTENT<|end|>\n        (ROLE is system, user or assistant)
  and the generation prompt is "<|assistant|>\n". Its four markers must each be one token id:
  `tokenizer_with_tokens` adds them to any tokenizer (char and byte ones hold them as specials) and
  `grow_embeddings` gives the model rows for them (the mean of the existing rows, so a new token starts
  as an "average" token).

Where a run keeps its template: `state["chat_template"]` of its checkpoint header, as `to_dict()` gives
it (`template_from_state` reads it back; a run without one uses the native template).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from gptlab.text.tokenizer import Tokenizer

Message = Mapping[str, Any]
ROLES = ("system", "user", "assistant")
# The special-token names transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).


class ChatTemplate(abc.ABC):
    """Renders messages as text; `special_tokens` are the marker strings that must be single ids."""

    special_tokens: tuple[str, ...] = ()
    # Text that ends an assistant's turn besides the tokenizer's stop ids (a generation stops at it).
    end_of_turn: tuple[str, ...] = ()

    @abc.abstractmethod
    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as text, ending with the assistant's turn opener when `add_generation_prompt`."""

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description that `template_from_dict` turns back into this template."""


class NativeTemplate(ChatTemplate):
    """gptlab's own template: `<|role|>\\ncontent<|end|>\\n` per message (see the module docstring)."""

    END = "<|end|>"
    special_tokens = ("<|system|>", "<|user|>", "<|assistant|>", END)
    end_of_turn = (END,)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        turns = [f"<|{m['role']}|>\n{m['content']}{self.END}\n" for m in messages]
        return "".join(turns) + ("<|assistant|>\n" if add_generation_prompt else "")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "native"}


class JinjaTemplate(ChatTemplate):
    """A Hugging Face chat template (Jinja source) with the tokenizer's special tokens as variables."""

    def __init__(self, source: str, tokens: Mapping[str, str]) -> None:
        """`tokens`: special-token name -> text (bos_token, eos_token, ...), as tokenizer_config.json
        has them."""
        import jinja2

        self.source, self.tokens = source, dict(tokens)
        self.special_tokens = tuple(dict.fromkeys(self.tokens.values()))
        try:
            self._template = _sandbox().from_string(source)  # compiled once, rendered many times
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not parse (line {err.lineno}: {err.message})") from None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        import jinja2

        # Plain dicts of the given keys, without None values (transformers drops them too).
        plain = [{key: value for key, value in m.items() if value is not None} for m in messages]
        try:
            return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.tokens)
        except jinja2.TemplateError as err:  # raise_exception(...) in the template, or a sandbox refusal
            raise ValueError(f"the chat template refused the conversation: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "jinja", "source": self.source, "tokens": self.tokens}


def _sandbox() -> Any:
    """The Jinja environment transformers renders chat templates in, rebuilt from its documented behaviour."""
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the model's text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """namespace(...) that refuses underscore names, which could reach Python's internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
            self, values = args[0], dict(*args[1:], **kwargs)
            bad = next((name for name in values if str(name).startswith("_")), None)
            if bad is not None:
                raise jinja2.exceptions.SecurityError(f"namespace attribute {bad!r} starts with _")
            jinja2.utils.Namespace.__init__(self, values)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def template_from_dict(d: Mapping[str, Any]) -> ChatTemplate:
    """Rebuild the template that `ChatTemplate.to_dict()` described (as a run's header stores it)."""
    if d.get("kind") == "native":
        return NativeTemplate()
    if d.get("kind") == "jinja" and isinstance(d.get("source"), str) and isinstance(d.get("tokens"), dict):
        return JinjaTemplate(d["source"], d["tokens"])
    raise ValueError(f"not a saved chat template: {dict(d)!r:.80}")


def template_from_state(state: Mapping[str, Any]) -> ChatTemplate:
    """A run's chat template: the one its header's state keeps (an import's), else gptlab's native one."""
    saved = state.get("chat_template")
    return NativeTemplate() if saved is None else template_from_dict(saved)


def missing_tokens(tokenizer: Tokenizer, template: ChatTemplate) -> list[str]:
    """The template's markers that the tokenizer does not encode as one id each."""
    return [t for t in template.special_tokens if not _single_id(tokenizer, t)]


def _single_id(tokenizer: Tokenizer, token: str) -> bool:
    try:
        return len(tokenizer.encode_array(token)) == 1
    except ValueError:  # a char tokenizer cannot encode a character it never saw
        return False
