"""Structured output and logit_bias through the server, with the official `openai` client as its
documentation uses it: `client.chat.completions.parse(response_format=PydanticModel)` returns a parsed
object from a random-weight model (BPE vocabulary of a few hundred tokens); completions take
`response_format` and vLLM's `structured_outputs` (json, regex, choice, json_object); a bad or
unenforceable schema is a 400 naming it and nothing is queued; a constrained row and a free row share
one batched step, the free one getting exactly its tokens alone; logit_bias moves and bans tokens. The
slow test sends 200 generated schemas and a set of regexes, eight at a time. Every test of the live server
runs twice: without speculative decoding and with `--speculative ngram` (constrained rows then verify drafts
checked against their grammar); greedy constrained output is the same with drafts and without."""

from __future__ import annotations

import enum
import itertools
import json
import random
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from pydantic import BaseModel, Field  # noqa: E402
from test_batching import Recorder, run_until  # noqa: E402
from test_chat_cli import build_chat_run  # noqa: E402
from test_serve import Live, start_server  # noqa: E402
from test_structured import PERSON, random_schema  # noqa: E402

from gptlab.config import ModelConfig, SamplingConfig  # noqa: E402
from gptlab.generate import generate  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.inference.loading import load  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.sampling import sampler  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.serve.batching import Row, Scheduler, Ticket  # noqa: E402
from gptlab.serve.completion import token_text  # noqa: E402
from gptlab.serve.schemas import Limits  # noqa: E402
from gptlab.speculative import SpeculationConfig  # noqa: E402
from gptlab.structured.grammar import json_schema_grammar, regex_grammar  # noqa: E402
from gptlab.text.tokenizer import CharTokenizer, Tokenizer  # noqa: E402

ASKED = [{"role": "user", "content": "the cat"}]


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Pet(BaseModel):
    kind: Annotated[str, Field(max_length=6)]
    legs: Annotated[int, Field(ge=0, le=4)]


class Owner(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    colour: Colour
    pets: Annotated[list[Pet], Field(max_length=2)]
    tags: Annotated[list[Annotated[str, Field(max_length=4)]], Field(max_length=3)]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Tokenizer]:
    lm = load(build_chat_run(tmp_path_factory.mktemp("structured")))
    return lm.model, lm.tokenizer


@pytest.fixture(scope="module", params=[None, SpeculationConfig()], ids=["plain", "speculative"])
def live(chat_model: tuple[GPT, Tokenizer], request: pytest.FixtureRequest) -> Iterator[Live]:
    model, tokenizer = chat_model
    app = create_app(LM.from_model(model, tokenizer), "chat", max_batch=8, limits=Limits(max_tokens=512),
                     speculation=request.param)
    url, server, thread = start_server(app)
    yield Live(url, app.state.served)
    server.should_exit = True
    thread.join(timeout=10)


def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def complete(live: Live, **body: Any) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/completions", json={"prompt": "the cat", "max_tokens": 300, **body},
                      timeout=60)


def test_parse_with_a_pydantic_model_gives_a_parsed_object(live: Live) -> None:
    for seed in range(2):
        reply = client(live).chat.completions.parse(model="chat", messages=ASKED, response_format=Owner,
                                                    max_tokens=400, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Owner)
        assert Owner.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_completions_take_response_format_and_structured_outputs(live: Live) -> None:
    for seed in range(2):
        shaped = complete(live, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": False}}).json()
        jsonschema.validate(json.loads(shaped["choices"][0]["text"]), PERSON)
        any_object = complete(live, seed=seed, response_format={"type": "json_object"}, max_tokens=60).json()
        if any_object["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(any_object["choices"][0]["text"]), dict)
        regex = complete(live, seed=seed, structured_outputs={"regex": "[A-Z][a-z]{1,4} [0-9]{2}"}).json()
        assert re.fullmatch("[A-Z][a-z]{1,4} [0-9]{2}", regex["choices"][0]["text"])
        choice = complete(live, seed=seed, n=3, structured_outputs={"choice": ["yes", "no", "a cat"]}).json()
        assert {c["text"] for c in choice["choices"]} <= {"yes", "no", "a cat"}
        assert {c["finish_reason"] for c in choice["choices"]} == {"stop"}


def test_a_streamed_constrained_completion(live: Live) -> None:
    stream = client(live).completions.create(model="chat", prompt="the cat", max_tokens=300, stream=True,
                                             seed=3, extra_body={"structured_outputs": {"json": PERSON}})
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_first_is_length(live: Live) -> None:
    reply = complete(live, max_tokens=3, structured_outputs={"json": PERSON}).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    reply = client(live).chat.completions.create(model="chat", messages=ASKED, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):  # .parse refuses what is not complete
        client(live).chat.completions.parse(model="chat", messages=ASKED, response_format=Owner, max_tokens=3)


@pytest.mark.parametrize(("body", "param", "named"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema", "not valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "look-around"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex and choice"),
    ({"structured_outputs": {"grammar": "start: a"}}, "structured_outputs.grammar", "unknown field"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ({"structured_outputs": {"choice": ["a"]}, "stop": ["x"]}, "stop", "cannot be combined"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "token id 99999"),
    ({"logit_bias": {"1": 150}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"one": 1}}, "logit_bias", "token ids"),
])
def test_bad_constraints_are_400s_naming_the_field(live: Live, body: dict, param: str, named: str) -> None:
    admitted = live.served.scheduler.admitted
    reply = complete(live, **body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and named in error["message"], error
    assert live.served.scheduler.admitted == admitted  # nothing was queued


def test_a_char_model_names_the_characters_it_lacks_and_writes_what_it_can(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    chars = CharTokenizer("abcdefgh ys")
    model = GPT(ModelConfig(vocab_size=chars.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=8)).eval()
    url, server, thread = start_server(create_app(LM.from_model(model, chars), "chars", max_batch=2))
    try:
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "response_format": {
            "type": "json_object"}}).json()["error"]
        assert refused["param"] == "response_format" and "no token for '{'" in refused["message"], refused
        chosen = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "structured_outputs": {
            "choice": ["yes", "no"]}}).json()["choices"][0]  # "no" cannot be spelled; "yes" can
        assert chosen["text"] == "yes" and chosen["finish_reason"] == "stop"
        monkeypatch.setitem(sys.modules, "llguidance", None)  # the structured extra missing: a 400
        missing = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "structured_outputs": {
            "regex": "a+"}})
        assert missing.status_code == 400, missing.text
        assert "pip install 'gptlab[structured]'" in missing.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_logit_bias_moves_and_bans_tokens(live: Live) -> None:
    tokenizer = live.served.tokenizer
    with torch.no_grad():  # the greedy first token, from one plain forward pass
        logits = live.served.model(torch.tensor([tokenizer.encode("the cat")]))[0][0, -1]
    first = int(logits[:tokenizer.vocab_size].argmax())
    greedy = complete(live, temperature=0, max_tokens=1, logprobs=1).json()["choices"][0]
    assert greedy["logprobs"]["tokens"][0] == token_text(tokenizer.token_bytes(first))
    banned = complete(live, temperature=0, max_tokens=1, logprobs=1, logit_bias={str(first): -100}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != greedy["logprobs"]["tokens"][0]
    forced = tokenizer.encode(" mat")[0]
    chosen = complete(live, temperature=1.0, seed=1, max_tokens=4, logit_bias={str(forced): 100}).json()
    assert chosen["choices"][0]["text"] == " mat" * 4


def test_a_constrained_row_and_a_free_row_share_a_batch(live: Live) -> None:
    """With speculation, the constrained row drafts and the free (sampled) one does not."""
    model, tokenizer = live.served.model, live.served.tokenizer
    speculation = live.served.scheduler.speculation
    scheduler = Scheduler(model, tokenizer, max_batch=4, speculation=speculation)
    prompt = tokenizer.encode("the cat sat")
    free_sampling = SamplingConfig(temperature=0.9, max_new_tokens=40, seed=5)
    free, shaped = Recorder(), Recorder()
    grammar = json_schema_grammar(tokenizer, PERSON)
    scheduler.submit([
        Row(0, list(prompt), free_sampling, sampler(free_sampling), None, free, Ticket()),
        Row(0, list(prompt), SamplingConfig(max_new_tokens=300, seed=5), sampler(free_sampling), None, shaped,
            Ticket(), matcher=grammar.matcher(), speculative=speculation is not None)])
    run_until(scheduler, lambda: free.ended and shaped.ended)
    assert scheduler.largest_batch == 2
    alone = [int(t) for t in generate(model, [prompt], free_sampling, eot_id=tokenizer.stop_ids)]
    assert free.tokens == alone[:len(free.tokens)] and len(free.tokens) > 0
    jsonschema.validate(json.loads("".join(e.text for e in shaped.events)), PERSON)
    assert shaped.events[-1].finish_reason == "stop"


def test_greedy_constrained_output_is_the_same_with_drafts_and_without(
        chat_model: tuple[GPT, Tokenizer]) -> None:
    """Rows of one batch, each with a grammar, greedy, with and without drafting (and logit_bias, which
    applies to verified tokens alike): token for token the same, and drafts were verified."""
    model, tokenizer = chat_model
    scheduler = Scheduler(model, tokenizer, max_batch=8, speculation=SpeculationConfig())
    prompt = tokenizer.encode("the cat sat on the mat")
    quote = tokenizer.encode('"')[0]
    settings = [SamplingConfig(temperature=0, max_new_tokens=300),
                SamplingConfig(temperature=0, max_new_tokens=300, logit_bias={quote: -5.0})]
    grammars = [json_schema_grammar(tokenizer, PERSON), regex_grammar(tokenizer, "(the (cat|mat) ){2,6}sat")]
    recorders = {}
    for (i, grammar), (j, sampling), speculative in itertools.product(
            enumerate(grammars), enumerate(settings), (False, True)):
        recorders[i, j, speculative] = Recorder()
        scheduler.submit([Row(0, list(prompt), sampling, None, None, recorders[i, j, speculative], Ticket(),
                              matcher=grammar.matcher(), speculative=speculative)])
    run_until(scheduler, lambda: all(r.ended for r in recorders.values()))
    for (i, j, speculative), recorder in recorders.items():
        if speculative:
            assert recorder.tokens == recorders[i, j, False].tokens and recorder.tokens
            assert recorder.events[-1].finish_reason == recorders[i, j, False].events[-1].finish_reason
    stats = scheduler.speculation_stats
    assert stats.drafted > 0 and stats.accepted > 0, stats


@pytest.mark.slow
def test_two_hundred_generated_schemas_and_regexes_hold(live: Live) -> None:
    rng = random.Random(40)
    schemas = [random_schema(rng) for _ in range(200)]

    def ask(index: int) -> tuple[dict, dict]:
        body = {"seed": index, "max_tokens": 500, "response_format": {
            "type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schemas[index]}}}
        return schemas[index], complete(live, **body).json()["choices"][0]

    with ThreadPoolExecutor(8) as pool:
        for schema, choice in pool.map(ask, range(len(schemas))):
            assert choice["finish_reason"] == "stop", (schema, choice)
            jsonschema.validate(json.loads(choice["text"]), schema)
    for pattern in ("[a-z]{3}", "(cat|dog)s?", "[0-9]{1,3}(\\.[0-9]{2})?", "[A-Z][a-z]* sat", "x+y"):
        for seed in range(5):
            choice = complete(live, seed=seed, max_tokens=50, structured_outputs={"regex": pattern}).json()
            if choice["choices"][0]["finish_reason"] == "stop":
                assert re.fullmatch(pattern, choice["choices"][0]["text"]), pattern
