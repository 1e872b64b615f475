"""POST /v1/chat/completions: a conversation rendered with the run's chat template, decoded by the same
rows, limits and stream as /v1/completions (`completion`), and answered as OpenAI's chat JSON.

- The prompt is the template's rendering of the messages with the assistant's turn opened
  (`add_generation_prompt`), encoded without the tokenizer's post-processing (`encode_array`: no BOS is
  added, the template writes every marker itself), as transformers' `apply_chat_template(tokenize=True)`
  encodes it and as fine-tuning (`adapt.sft`) tokenised the examples.
- The reply ends at the end of the turn: the native template's `<|end|>` (a stop string, so the batcher
  and `generate.stream_text` cut there alike) or one of the tokenizer's stop ids (an import's end of
  sequence, such as ChatML's `<|im_end|>`). That last token counts in usage; logprobs list only the
  reply's own tokens, as OpenAI's do.
- A template whose markers are not single ids of the tokenizer (the native template of a run never
  fine-tuned for chat) is refused at request time with a 400: rendered, its markers would be plain text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gptlab.serve.completion import (
    FINISH_REASONS,
    Completion,
    Served,
    check_choices,
    check_prompt,
    finite,
    queue_rows,
    speculating,
    token_text,
)
from gptlab.serve.constraints import check_bias, request_grammar
from gptlab.serve.rows import Event
from gptlab.serve.schemas import APIError, ChatMessage, ChatRequest, sampling_config
from gptlab.text.chat_template import ChatTemplate, missing_tokens
from gptlab.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatServing:
    """What the chat route needs beyond `Served`: the template, where a turn ends, what it lacks."""

    template: ChatTemplate
    stops: tuple[str, ...]  # stop strings every reply gets
    hidden: frozenset[int]  # ids that end a turn and are not part of the reply (not in logprobs)
    missing: tuple[str, ...]  # markers of the template the tokenizer does not hold as single ids

    @classmethod
    def of(cls, template: ChatTemplate, tokenizer: Tokenizer) -> ChatServing:
        missing = tuple(missing_tokens(tokenizer, template))
        stops = template.end_of_turn
        hidden = {int(tokenizer.encode_array(s)[0]) for s in stops if not missing}
        return cls(template, stops, frozenset(hidden), missing)

    def refusal(self) -> str | None:
        """Why this model cannot chat, or None."""
        if not self.missing:
            return None
        return (f"this model's tokenizer has no single ids for {', '.join(self.missing)}, the markers of its "
                "chat template: it was not fine-tuned for chat (gptlab finetune with {\"messages\"} "
                "examples adds them); use /v1/completions")


def chat_text_ids(chat: ChatServing, served: Served, messages: Sequence[ChatMessage], reply: str
                  ) -> tuple[str, list[int]]:
    """The conversation as the chat route renders it, followed by `reply` (a reply so far): text, ids."""
    refusal = chat.refusal()
    if refusal is not None:
        raise APIError(400, refusal, "messages", "no_chat_template")
    plain = [{"role": m.role, "content": m.text} for m in messages]
    try:
        text = chat.template.render(plain, add_generation_prompt=True) + reply
    except ValueError as err:  # a Jinja template's raise_exception
        raise APIError(400, f"messages: {err}", "messages", "invalid_messages") from None
    return text, served.tokenizer.encode_array(text).tolist()


def start_chat(body: ChatRequest, served: Served, chat: ChatServing) -> ChatCompletion:
    """Validate the request, render and encode the conversation, then queue its n rows (none on a 400).

    With structured output the turn ends where the grammar does: its end-of-turn ids may follow a
    complete output only, and the template's stop strings are not added."""
    check_choices(body.n, served)
    sampling = sampling_config(body, body.seed, served.limits)
    check_bias(sampling, served.tokenizer)
    speculative = speculating(body, served)
    try:
        text, ids = chat_text_ids(chat, served, body.messages, "")
    except ValueError as err:  # a character the tokenizer cannot encode
        raise APIError(400, f"messages: {err}", "messages", "unencodable_prompt") from None
    grammar = request_grammar(body, served.tokenizer, {*served.tokenizer.stop_ids, *chat.hidden})
    context, window = served.max_context, served.model.config.block_size
    if body.token_limit[0] is None and context < window and context > len(ids):
        sampling = sampling.replace(max_new_tokens=min(sampling.max_new_tokens, context - len(ids)))
    check_prompt(ids, served, "messages", sampling.max_new_tokens)
    job = ChatCompletion(body, served, [text], len(ids), chat.hidden)
    stops = chat.stops if grammar is None else ()
    queue_rows(job, [ids], sampling.replace(stop=(*sampling.stop, *stops)), grammar, speculative)
    return job


class ChatCompletion(Completion):
    """A chat request's choices: `chat.completion` objects, `chat.completion.chunk` stream chunks (a
    first one per choice naming the role, then content deltas, then the finish reason)."""

    ID_PREFIX = "chatcmpl"

    def __init__(self, body: ChatRequest, served: Served, prompts: list[str], prompt_tokens: int,
                 hidden: frozenset[int]) -> None:
        super().__init__(body, served, prompts, prompt_tokens)
        self.hidden = hidden

    def choice(self, event: Event) -> dict[str, Any] | None:
        if event.finish_reason is None and event.token in self.hidden:
            return None  # the end of the turn: counted in usage, not part of the reply
        logprobs = None
        if event.logprob is not None:
            assert event.token is not None
            top = [self.logprob_entry(t, lp) for t, lp in event.top or []]
            logprobs = {"content": [{**self.logprob_entry(event.token, event.logprob), "top_logprobs": top}]}
        delta = {"content": event.text} if event.text or event.finish_reason is None else {}
        return {"index": event.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS.get(event.finish_reason or "")}

    def logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self.served.tokenizer.token_bytes(token)
        return {"token": token_text(piece), "logprob": finite(logprob), "bytes": list(piece)}

    def whole_choice(self, index: int, text: str, logprobs: dict[str, list], reason: str | None) -> dict:
        wanted = self.body.logprobs_count() is not None
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs if wanted else None, "finish_reason": reason}

    def empty_logprobs(self) -> dict[str, list]:
        return {"content": []}

    def opening(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [self.envelope([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}],
                              streamed=True) for i in range(self.choices)]

    def envelope(self, choices: list[dict[str, Any]], completion_tokens: int | None = None,
                 streamed: bool = False) -> dict[str, Any]:
        reply = super().envelope(choices, completion_tokens, streamed)
        return {**reply, "object": "chat.completion.chunk" if streamed else "chat.completion"}

