"""Structured output and logit_bias in a request: the grammar its `response_format` (OpenAI's) or
`structured_outputs` (vLLM's) asks for, compiled for the served tokenizer (`gptlab.structured`), and its
logit_bias checked against the vocabulary.

Every problem is a 400 naming the field (a malformed schema, a keyword the engine cannot enforce, a
character the vocabulary lacks, the structured extra missing), before any row is queued: a request that
asks for a constraint is never answered without it. A grammar the engine gives up on only once a row runs
(past its parser's limits) is a 400 naming the same field too, or an error event ending a stream under way
(`completion.failure`). Stop strings are refused beside a constraint (the grammar decides where the output
ends, and a stop string could cut it short while saying "stop").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gptlab.config import SamplingConfig
from gptlab.sampling import check_logit_bias
from gptlab.serve.schemas import APIError, SamplingRequest
from gptlab.structured.grammar import Grammar, grammar_for
from gptlab.text.tokenizer import Tokenizer

ANY_OBJECT = {"type": "object"}  # json_object: any JSON object


def requested(body: SamplingRequest) -> tuple[dict[str, Any], str] | None:
    """The constraint a request asks for, as `grammar_for`'s keyword arguments, and the field that asks
    (to name in errors); None without one."""
    form, outputs = body.response_format, body.structured_outputs
    if form is not None and form.type != "text" and outputs is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs",
                       "conflicting_fields")
    if form is not None and form.json_schema is not None and form.type != "json_schema":
        raise APIError(400, f"response_format.json_schema goes with type json_schema, not {form.type}",
                       "response_format.type", "invalid_value")
    if form is not None and form.type == "json_object":
        return {"json_schema": ANY_OBJECT}, "response_format"
    if form is not None and form.type == "json_schema":
        if form.json_schema is None:
            raise APIError(400, "response_format.json_schema is required with type json_schema",
                           "response_format.json_schema", "missing_field")
        return {"json_schema": form.json_schema.schema_}, "response_format.json_schema.schema"
    if outputs is None:
        return None
    given = {name: value for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                             ("choice", outputs.choice), ("json_object", outputs.json_object))
             if value not in (None, False)}
    if len(given) != 1:
        raise APIError(400, "structured_outputs must hold one of json, regex, choice or json_object, not "
                       f"{' and '.join(given) or 'none'}", "structured_outputs", "invalid_value")
    name, value = next(iter(given.items()))
    keyword = {"json": "json_schema", "json_object": "json_schema"}.get(name, name)
    return {keyword: ANY_OBJECT if name == "json_object" else value}, f"structured_outputs.{name}"


def request_grammar(body: SamplingRequest, tokenizer: Tokenizer, end_ids: Iterable[int]) -> Grammar | None:
    """The compiled grammar a request asks for (its rows may end with `end_ids` once it is complete), or
    None; a 400 naming the field for anything wrong with it."""
    asked = requested(body)
    if asked is None:
        return None
    constraint, param = asked
    if body.stop:
        raise APIError(400, "stop cannot be combined with structured output: the grammar decides where the "
                       "output ends", "stop", "unsupported_value")
    try:
        return grammar_for(tokenizer, end_ids=sorted(set(end_ids)), **constraint)
    except ValueError as err:  # a bad grammar, or the structured extra missing: never unconstrained
        raise APIError(400, f"{param}: {err}", param, "invalid_grammar") from None


def check_bias(sampling: SamplingConfig, tokenizer: Tokenizer) -> None:
    """A 400 naming logit_bias when it names an id outside the tokenizer's vocabulary."""
    try:
        check_logit_bias(sampling.logit_bias, tokenizer.vocab_size)
    except ValueError as err:
        raise APIError(400, str(err), "logit_bias", "invalid_value") from None
