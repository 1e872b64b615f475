"""Speculative decoding in the server (gptlab.serve.speculation, through the scheduler): greedy rows that
draft get plain greedy's tokens and the naive loop's log-probabilities for every position scheme, sharing
batched steps with rows that do not draft and with sampled rows (which keep `generate`'s seeded tokens);
requests turn it off or are refused it with a 400 on both endpoints; the command's flags reach the
scheduler; /metrics counts drafted and accepted tokens. Constrained rows are tested in
tests/serve/test_structured_serve.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import CHARS, Recorder, run_until
from test_batching import model as model  # noqa: F401  (the tiny random model's fixture)
from torch.testing import assert_close

from conftest import TwoStops
from gptlab.config import POSITIONS, SamplingConfig
from gptlab.generate import Decoder, generate
from gptlab.model import GPT
from gptlab.sampling import sampler
from gptlab.serve.batching import Row, Scheduler, Ticket
from gptlab.speculative import SpeculationConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SPECULATION = SpeculationConfig(draft_tokens=4, ngram=3)


def queued(scheduler: Scheduler, prompt: list[int], sampling: SamplingConfig, speculative: bool) -> Recorder:
    recorder = Recorder()
    scheduler.submit([Row(0, list(prompt), sampling, sampler(sampling), CHARS.vocab_size, recorder, Ticket(),
                          speculative=speculative)])
    return recorder


@pytest.mark.parametrize(("positions", "changes"), [*((p, {}) for p in POSITIONS),
                                                    ("rope", {"ngram_embeddings": (2, 3)})])
def test_drafting_rows_get_plain_greedys_tokens_beside_rows_that_do_not(
        positions: str, changes: dict[str, Any], model: Callable[..., GPT]) -> None:
    """Grouped-query heads (and n-gram embeddings), 30 tokens past a 16-token window (learned positions
    restart it; the others slide on a ring with draft_tokens spare slots, drafting on): every row's tokens
    equal generate's alone, and each drafting row's log-probabilities the naive loop's logits."""
    gpt = model(positions=positions, n_head=4, n_kv_head=2, **changes)
    scheduler = Scheduler(gpt, CHARS, max_batch=4, prefill_chunk=4, speculation=SPECULATION)
    greedy = SamplingConfig(temperature=0, max_new_tokens=30)
    sampled = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=25)
    cases = [([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], greedy, True), ([7, 8, 7, 8, 7], greedy, True),
             ([3, 9, 3], greedy, False), ([4, 5, 6, 4, 5], sampled, False)]
    recorders = [queued(scheduler, prompt, sampling, speculative) for prompt, sampling, speculative in cases]
    run_until(scheduler, lambda: all(r.ended for r in recorders))
    assert scheduler.largest_batch == 4
    stats = scheduler.speculation_stats
    assert stats.drafted > 0 and stats.accepted > 0, stats
    for (prompt, sampling, speculative), recorder in zip(cases, recorders, strict=True):
        alone = [int(t) for t in generate(gpt, [prompt], sampling, generator=sampler(sampling))]
        assert recorder.tokens == alone
        if speculative:
            naive = Decoder(gpt, [prompt], use_cache=False)
            for event in recorder.events[:-1]:
                got = torch.tensor([logprob for _, logprob in sorted(event.top or [])])  # every id's, by id
                assert_close(got, naive.logits()[0].log_softmax(-1), atol=1e-5, rtol=1e-5)
                naive.append(torch.tensor([[event.token]]))


def cycling_model(model: Callable[..., GPT], cycle: list[int]) -> GPT:
    """The tiny model made to follow `cycle` greedily: every block's output projections zeroed (the stream
    is the token's own embedding, orthogonal to the others') and the head scoring each token's successor."""
    gpt = model(positions="rope", block_size=64, n_embd=16, norm="rmsnorm", tied=False)
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if ".c_proj." in name or name == "transformer.ln_f.weight":
                param.fill_(float(name == "transformer.ln_f.weight"))
        gpt.transformer.wte.weight.copy_(torch.linalg.qr(torch.randn(16, 16))[0][:13])  # orthonormal rows
        gpt.lm_head.weight.zero_()
        for i, token in enumerate(cycle):
            gpt.lm_head.weight[cycle[(i + 1) % len(cycle)]] = 5 * gpt.transformer.wte.weight[token]
    return gpt


def test_a_copying_row_drafts_past_its_window_and_stops_at_max_tokens_and_a_stop_id(
        model: Callable[..., GPT]) -> None:
    """A row that copies keeps drafting as it slides past its window; a verified run of tokens that crosses
    max_tokens or a stop id yields only the tokens up to there."""
    gpt, prompt = cycling_model(model, [5, 6, 7, 8]), [5, 6, 7, 8, 5, 6, 7, 8, 5]
    free = [int(t) for t in generate(gpt, [prompt], SamplingConfig(temperature=0, max_new_tokens=150))]
    assert free[:5] == [6, 7, 8, 5, 6]
    scheduler = Scheduler(gpt, CHARS, speculation=SPECULATION)  # far past the 64-token window
    recorder = queued(scheduler, prompt, SamplingConfig(temperature=0, max_new_tokens=150), True)
    run_until(scheduler, lambda: recorder.ended)
    assert recorder.tokens == free and scheduler.steps <= 31  # 5 tokens a step: drafting goes on
    for max_tokens in (1, 2, 7):
        scheduler = Scheduler(gpt, CHARS, speculation=SPECULATION)
        recorder = queued(scheduler, prompt, SamplingConfig(temperature=0, max_new_tokens=max_tokens), True)
        run_until(scheduler, lambda r=recorder: r.ended)
        assert recorder.tokens == free[:max_tokens]
        assert recorder.events[-1].completion_tokens == max_tokens
    scheduler = Scheduler(gpt, TwoStops("abcdefghijklm", (8,)), speculation=SPECULATION)
    recorder = queued(scheduler, prompt, SamplingConfig(temperature=0, max_new_tokens=30), True)
    run_until(scheduler, lambda: recorder.ended)
    assert recorder.tokens == [6, 7] and recorder.events[-1].finish_reason == "eot"
    # the draft 6 7 8 5 was accepted whole in one pass: the row keeps 6 7 8 and ends there
    assert recorder.events[-1].completion_tokens == 3 and scheduler.speculation_stats.accepted == 4


def test_requests_turn_it_off_or_are_refused_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    httpx = pytest.importorskip("httpx")
    from test_metrics import moved, scrape, serving
    from test_prefix_cache import char_run, served_apps

    plain, drafting = served_apps(char_run(tmp_path), [[], ["--speculative", "ngram", "--draft-tokens", "3",
                                                            "--ngram", "2"]], monkeypatch)
    assert plain.state.served.scheduler.speculation is None
    assert drafting.state.served.scheduler.speculation == SpeculationConfig(draft_tokens=3, ngram=2)
    body = {"prompt": "abc abc abc abc", "max_tokens": 24, "temperature": 0}
    with serving(plain) as url:
        expected = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4}
        for route, asked in (("completions", body), ("chat/completions", chat)):
            refused = httpx.post(f"{url}/v1/{route}", json={**asked, "speculative": True}, timeout=30)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "speculative"
        off = httpx.post(f"{url}/v1/completions", json={**body, "speculative": False}, timeout=30)
        assert off.status_code == 200
    with serving(drafting) as url:
        before = scrape(url)
        off = httpx.post(f"{url}/v1/completions", json={**body, "speculative": False}, timeout=30).json()
        middle = scrape(url)
        on = httpx.post(f"{url}/v1/completions", json={**body, "speculative": True}, timeout=30).json()
        after = scrape(url)
    assert off["choices"][0]["text"] == on["choices"][0]["text"] == expected
    for name in ("gptlab_speculative_draft_tokens_total", "gptlab_speculative_accepted_tokens_total"):
        assert moved(before, middle, name) == 0
    drafted = moved(middle, after, "gptlab_speculative_draft_tokens_total")
    accepted = moved(middle, after, "gptlab_speculative_accepted_tokens_total")
    assert drafted >= accepted > 0
    assert moved(middle, after, "gptlab_generation_tokens_total") == on["usage"]["completion_tokens"]


@pytest.mark.parametrize(("flags", "named"), [(["--draft-tokens", "3"], "--draft-tokens needs --speculative"),
                                              (["--speculative", "ngram", "--ngram", "0"],
                                               "--ngram: 0 is not")])
def test_bad_flags_are_one_line(flags: list[str], named: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("fastapi")
    from gptlab.cli import main

    assert main(["serve", str(tmp_path), "--port", "0", *flags]) == 2  # refused before the run is read
    assert named in capsys.readouterr().err
