"""`LM`: a model ready to use, with what its run says about using it (tokenizer, sampling defaults, chat
template), as short from Python as from the command line:

    lm = gptlab.load("runs/demo")
    lm.generate("ROMEO:", max_new_tokens=20, temperature=0)   # the continuation, as `gptlab sample` prints it
    for piece in lm.stream("ROMEO:"): ...                      # the same text, piece by piece
    lm.chat([{"role": "user", "content": "Who art thou?"}])   # the reply, as `gptlab chat` gives it
    lm.attention("ROMEO: and")                                 # the attention page, inline in Jupyter

Sampling options are `SamplingConfig`'s fields as keywords; the ones not given take the run's own defaults
(an imported model's generation_config.json), then `gptlab sample`'s (`config.SAMPLE_DEFAULTS`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gptlab.checkpoint import Checkpoint
from gptlab.config import SAMPLE_DEFAULTS, SamplingConfig, parameter_count
from gptlab.generate import Chunk, generate, stream_text, text_chunks
from gptlab.inspection.attention_view import AttentionView, attention_maps
from gptlab.model import GPT
from gptlab.sampling import check_logit_bias, sampler
from gptlab.speculative import SpeculationConfig, SpeculationStats
from gptlab.text.chat_template import ChatTemplate, missing_tokens, template_from_state
from gptlab.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the structured extra is imported only when a constraint is given
    from gptlab.structured.grammar import Grammar

Message = Mapping[str, Any]


class LM:
    """A decoder-only model with its tokenizer, its run's sampling defaults and chat template.

    Made by `gptlab.load` (a run or a Hugging Face folder) or `LM.from_model` (a model in memory).
    """

    def __init__(self, model: GPT, tokenizer: Tokenizer, header: Checkpoint | None = None,
                 source: str = "memory") -> None:
        """`header`: the run's checkpoint without tensors (configs, tokenizer, state), None for a model
        that has no run; `source`: where it came from, as the user named it."""
        self.model, self.tokenizer, self.header, self.source = model, tokenizer, header, source
        state = header.state if header is not None else {}
        self.defaults: dict[str, Any] = dict(state.get("generation", {}))  # the run's sampling defaults
        self.template: ChatTemplate = template_from_state(state)

    @classmethod
    def from_model(cls, model: GPT, tokenizer: Tokenizer) -> LM:
        """An LM for a model already in memory: no run defaults, gptlab's native chat template."""
        return cls(model, tokenizer)

    def __repr__(self) -> str:
        c, weight = self.model.config, next(self.model.parameters())
        millions = parameter_count(c)["total"] / 1e6
        return (f"LM({c.n_layer} layers x {c.n_head} heads x {c.n_embd} wide, context {c.block_size}, "
                f"{self.tokenizer.kind} tokenizer of {self.tokenizer.vocab_size:,} ids, {millions:.2f}M "
                f"parameters, {weight.dtype} on {weight.device}, from {self.source})")

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return next(self.model.parameters()).device

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(list(ids))

    def sampling(self, **options: Any) -> SamplingConfig:
        """The SamplingConfig of `options` over the run's defaults over gptlab sample's (a bad one names
        its field)."""
        sampling = SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **self.defaults, **options})
        check_logit_bias(sampling.logit_bias, self.tokenizer.vocab_size)
        return sampling

    def grammar(self, *, json_schema: Any = None, regex: str | None = None,
                choice: list[str] | None = None) -> Grammar | None:
        """The structured output one of a JSON schema, a regex or a choice list asks for, compiled for this
        tokenizer (gptlab.structured); None without one."""
        if json_schema is None and regex is None and choice is None:
            return None
        from gptlab.structured.grammar import grammar_for  # the structured extra, only when asked for

        return grammar_for(self.tokenizer, json_schema=json_schema, regex=regex, choice=choice)

    def chunks(self, prompt: str, sampling: SamplingConfig, *, generator: torch.Generator | None = None,
               use_cache: bool = True, grammar: Grammar | None = None,
               speculation: SpeculationConfig | None = None,
               stats: SpeculationStats | None = None) -> Iterator[Chunk]:
        """The continuation of `prompt` as `generate.Chunk`s, within `grammar` when one is given (`grammar`);
        `speculation` drafts tokens by prompt lookup, counted in `stats`. The prompt and the settings are
        checked before the first chunk is asked for."""
        if grammar is None:
            return stream_text(self.model, self.tokenizer, prompt, sampling, generator=generator,
                               use_cache=use_cache, speculation=speculation, stats=stats)
        if speculation is not None:
            raise ValueError("speculative decoding and structured output do not combine: drop one")
        from gptlab.structured.generation import stream_structured

        return stream_structured(self.model, self.tokenizer, prompt, sampling, grammar, generator=generator,
                                 use_cache=use_cache)

    def stream(self, prompt: str, *, json_schema: Any = None, regex: str | None = None,
               choice: list[str] | None = None, speculation: SpeculationConfig | None = None,
               use_cache: bool = True, **sampling: Any) -> Iterator[str]:
        """The continuation of `prompt`, piece by piece as it is chosen; joined, `generate`'s text."""
        grammar = self.grammar(json_schema=json_schema, regex=regex, choice=choice)
        chunks = self.chunks(prompt, self.sampling(**sampling), use_cache=use_cache, grammar=grammar,
                             speculation=speculation)
        return (chunk.text for chunk in chunks if chunk.text)

    def generate(self, prompt: str, *, json_schema: Any = None, regex: str | None = None,
                 choice: list[str] | None = None, speculation: SpeculationConfig | None = None,
                 use_cache: bool = True, **sampling: Any) -> str:
        """The continuation of `prompt` (not the prompt), as `gptlab sample` prints it."""
        return "".join(self.stream(prompt, json_schema=json_schema, regex=regex, choice=choice,
                                   speculation=speculation, use_cache=use_cache, **sampling))

    def check_chat(self) -> None:
        """A ValueError when the tokenizer lacks the chat template's markers: the run was not fine-tuned
        for chat."""
        missing = missing_tokens(self.tokenizer, self.template)
        if missing:
            raise ValueError(f"this run's tokenizer has no single ids for {', '.join(missing)}, the markers "
                             "of its chat template: it was not fine-tuned for chat (gptlab finetune with "
                             '{"messages"} examples adds them); gptlab sample continues plain text')

    def reply_chunks(self, messages: Sequence[Message], sampling: SamplingConfig,
                     generator: torch.Generator | None = None) -> Iterator[Chunk]:
        """The assistant's next turn after `messages`, as chunks; it ends at the end of the turn.

        The conversation is rendered with the run's template, the assistant's turn opened, and encoded as
        the server's /v1/chat/completions does (no BOS added: the template writes its markers)."""
        self.check_chat()
        sampling = sampling.replace(stop=(*sampling.stop, *self.template.end_of_turn))
        text = self.template.render(list(messages), add_generation_prompt=True)
        ids = self.tokenizer.encode_array(text).tolist()
        window = self.model.config.block_size
        if len(ids) > window:
            raise ValueError(f"the conversation is {len(ids)} tokens, more than the model's context of "
                             f"{window}: start a new one, or send a shorter message")
        tokens = generate(self.model, [ids], sampling, generator=generator, eot_id=self.tokenizer.stop_ids,
                          vocab_size=self.tokenizer.vocab_size)
        return text_chunks(tokens, self.tokenizer, sampling.stop)

    def chat(self, messages: Sequence[Message], **sampling: Any) -> str:
        """The assistant's reply to a conversation (a list of {"role", "content"} messages), as `gptlab
        chat` gives it."""
        config = self.sampling(**sampling)
        chunks = self.reply_chunks(messages, config, sampler(config, self.device))
        return "".join(chunk.text for chunk in chunks)

    def attention(self, prompt: str, layer: int | None = None, head: int | None = None) -> AttentionView:
        """The attention weights of every head (or one layer or head) on `prompt`: shown inline in Jupyter,
        saved with `.save("page.html")` or `.save("grid.png")`."""
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt encodes to no tokens: give a non-empty prompt")
        ids = ids[-self.model.config.block_size:]
        maps = attention_maps(self.model, self.tokenizer, prompt, ids, layer, head)
        return AttentionView(maps, self.tokenizer)
