"""`gptlab serve` speaks the harness's language: a completion that echoes its prompt with the prompt tokens'
log-probabilities (OpenAI's legacy `echo` + `logprobs`), prompts as token ids, and vLLM's tokenizer routes.

The reference is the model's own forward pass run on each prefix alone, and the prompt's UTF-8 bytes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.testing import assert_close

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from test_serve import Live, start_server  # noqa: E402

from gptlab.config import ModelConfig  # noqa: E402
from gptlab.inference.lm import LM  # noqa: E402
from gptlab.model import GPT  # noqa: E402
from gptlab.serve.app import create_app  # noqa: E402
from gptlab.text.tokenizer import ByteTokenizer  # noqa: E402

NAME = "bytes"
PROMPT = "héllo, wörld"  # two characters of two bytes each: tokens that are pieces of a character


@pytest.fixture(scope="module")
def byte_live() -> Iterator[Live]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)  # far from uniform, so every position's distribution differs
    app = create_app(LM.from_model(model, ByteTokenizer()), NAME, max_batch=4)
    url, server, thread = start_server(app)
    yield Live(url, app.state.served)
    server.should_exit = True
    thread.join(timeout=10)


def complete(live: Live, **body: object) -> dict:
    reply = httpx.post(f"{live.url}/v1/completions", json={"model": NAME, **body}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def prefix_logprobs(model: GPT, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability after its prefix, and the distribution there, from the prefix alone."""
    rows = []
    with torch.no_grad():
        for i in range(1, len(ids)):
            logits, _ = model(torch.tensor([ids[:i]]))
            rows.append(torch.log_softmax(logits[0, -1].double(), -1))
    dist = torch.stack(rows)  # (T-1, V)
    return dist.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], dist


def test_echo_gives_the_prompt_tokens_logprobs_as_openai_did(byte_live: Live) -> None:
    ids = list(PROMPT.encode("utf-8"))
    reply = complete(byte_live, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    logprobs = choice["logprobs"]
    expected, dist = prefix_logprobs(byte_live.served.model, ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert_close(torch.tensor(logprobs["token_logprobs"][1:], dtype=torch.float64), expected,
                 rtol=0, atol=1e-5)
    # Tokens are each byte's own text; a lone piece of "é" or "ö" is written as OpenAI writes bytes.
    assert logprobs["tokens"][:3] == ["h", "bytes:\\xc3", "bytes:\\xa9"]
    assert len(logprobs["tokens"]) == len(ids)
    # text_offset: the characters complete before each token (a character's second byte starts where it does).
    assert logprobs["text_offset"] == [len(bytes(ids[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    for top, row in zip(logprobs["top_logprobs"][1:], dist, strict=True):
        best = row.topk(3)
        keys = [bytes([t]).decode("utf-8", "ignore") or f"bytes:\\x{t:02x}" for t in best.indices.tolist()]
        assert list(top) == keys
        assert_close(torch.tensor(list(top.values()), dtype=torch.float64), best.values, rtol=0, atol=1e-5)


def test_token_id_prompts_in_a_batch_and_echo_with_generated_tokens(byte_live: Live) -> None:
    texts = ["héllo, wörld", "the cat sat"]
    alone = [complete(byte_live, prompt=t, echo=True, logprobs=2, max_tokens=0)["choices"][0] for t in texts]
    batch = complete(byte_live, prompt=[list(t.encode("utf-8")) for t in texts], echo=True, logprobs=2,
                     max_tokens=0)["choices"]
    assert [c["index"] for c in batch] == [0, 1]
    for one, many, text in zip(alone, batch, texts, strict=True):
        assert many["text"] == text and many["logprobs"] == one["logprobs"]
    # One prompt as a flat list of ids is one prompt, not a batch.
    flat = complete(byte_live, prompt=list(texts[1].encode()), echo=True, logprobs=2, max_tokens=0)
    assert flat["choices"][0]["logprobs"] == alone[1]["logprobs"]
    # With max_tokens > 0 (lm-eval asks for one), the prompt's logprobs come first, then the greedy
    # continuation's, which are those of the same request without echo.
    echoed = complete(byte_live, prompt=texts[1], echo=True, logprobs=2, max_tokens=3, temperature=0)
    plain = complete(byte_live, prompt=texts[1], logprobs=2, max_tokens=3, temperature=0)
    generated, prompt_part = plain["choices"][0]["logprobs"], alone[1]["logprobs"]
    assert echoed["choices"][0]["text"] == texts[1] + plain["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert echoed["choices"][0]["logprobs"][key] == prompt_part[key] + generated[key], key
    for lp, top in zip(generated["token_logprobs"], generated["top_logprobs"], strict=True):
        assert lp == max(top.values())  # greedy, as lm-eval's is_greedy reads it


def test_echo_without_logprobs_repeats_the_text_only(byte_live: Live) -> None:
    choice = complete(byte_live, prompt="abc", echo=True, max_tokens=0)["choices"][0]
    assert choice["text"] == "abc" and choice["logprobs"] is None


def test_tokenizer_routes_as_vllm_and_lm_eval_call_them(byte_live: Live) -> None:
    url = byte_live.url
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] is None and info["model_max_length"] == 32
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert tokens["tokens"] == list(PROMPT.encode("utf-8")) and tokens["count"] == len(PROMPT.encode())
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}


BAD = [
    ("/v1/completions", {"prompt": "abc", "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 256]], "echo": True, "max_tokens": 0}, "prompt[1]"),
    ("/v1/completions", {"prompt": [1, -1], "max_tokens": 0}, "prompt"),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 0}, "prompt[0]"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),  # neither ids nor texts
    ("/detokenize", {"tokens": [1, 300]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"text": "abc"}, "prompt"),  # missing
]


def test_bad_prompts_and_tokens_are_400s_naming_the_field(byte_live: Live) -> None:
    for route, body, param in BAD:
        reply = httpx.post(f"{byte_live.url}{route}", json=body)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["param"] == param, (body, reply.json())
