"""Speculative decoding by prompt lookup against independent references: plain greedy decoding token for
token, the uncached decoder's logits after every rollback, hand-made logits for the acceptance rule, and
the exact distribution of a short continuation (enumerated with plain forward passes) for sampling."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chisquare
from torch.testing import assert_close

from conftest import covering
from gptlab.checkpoint import Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import POSITIONS, ModelConfig, SamplingConfig
from gptlab.generate import Decoder, generate
from gptlab.model import GPT
from gptlab.sampling import token_probabilities
from gptlab.speculative import SpeculationConfig, SpeculationStats, accept_draft, ngram_draft
from gptlab.text.tokenizer import CharTokenizer

WINDOW = 16  # small, so that the runs below cross the context window (and wrap the cache's ring) often
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7, 8, 5], [3], [4, 9, 4, 9, 4, 9, 11, 4, 9],
           list(range(13)) * 2]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models only lose time to a 2nd thread


@pytest.fixture
def random_model(tiny_config: Callable[..., ModelConfig]) -> Callable[..., GPT]:
    """`random_model(seed, **changes)`: a tiny model with large random weights (every part moves the
    logits)."""

    def make(seed: int = 0, **changes: object) -> GPT:
        torch.manual_seed(seed)
        model = GPT(tiny_config(block_size=WINDOW, **changes)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.4)
        return model

    return make


def tokens_of(model: GPT, prompt: list[int], sampling: SamplingConfig, **options: Any) -> list[int]:
    """The tokens one prompt's generation yields (each step (1, 1))."""
    return [int(token) for token in generate(model, [prompt], sampling, **options)]


# ------------------------------------------------------------------------------------------------ drafting


def test_the_draft_copies_what_followed_the_most_recent_earlier_copy_of_the_last_ngram() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_draft(tokens, 3, ngram=3) == [7, 5, 1]  # the copy at 4, not the one at 0
    assert ngram_draft(tokens, 0, ngram=3) == []


def test_the_draft_falls_back_to_shorter_ngrams_and_copies_itself_past_the_end() -> None:
    assert ngram_draft([4, 5, 6, 9, 6], 3, ngram=3) == [9, 6, 9]  # only "6" occurred before
    assert ngram_draft([1, 2, 1, 2], 5, ngram=2) == [1, 2, 1, 2, 1]  # a period shorter than the draft
    assert ngram_draft([1, 2, 3], 4, ngram=3) == []  # nothing repeats
    assert ngram_draft([7], 4, ngram=3) == []


# -------------------------------------------------------------------------------------- the acceptance rule


def peaked(*rows: int, vocab: int = 6) -> torch.Tensor:
    """Logits (len(rows), vocab) whose argmax in row i is rows[i]."""
    logits = torch.zeros(len(rows), vocab)
    logits[torch.arange(len(rows)), list(rows)] = 5.0
    return logits


def test_greedy_keeps_the_drafted_tokens_that_equal_the_argmax_then_the_argmax() -> None:
    greedy = SamplingConfig(temperature=0)
    assert accept_draft(peaked(1, 2, 4, 5), [1, 2, 3], greedy) == [1, 2, 4]
    assert accept_draft(peaked(1, 2, 3, 5), [1, 2, 3], greedy) == [1, 2, 3, 5]
    assert accept_draft(peaked(0, 2, 3, 5), [1, 2, 3], greedy) == [0]


@pytest.mark.slow
def test_a_sampled_first_token_has_the_target_distribution_whatever_the_draft() -> None:
    """Whatever the drafted token's probability, the first kept token is distributed as p (with top-k,
    top-p and logit_bias, as the processed p): accepted with p(x), else drawn from p without x."""
    logits = torch.tensor([[0.1, 1.2, 0.4, -0.5, 0.9, 0.0], [0.3, 0.2, 0.1, 0.0, -0.1, -0.2]])
    generator = torch.Generator().manual_seed(0)
    for sampling in (SamplingConfig(temperature=1.0),
                     SamplingConfig(temperature=0.7, top_k=4, top_p=0.9, logit_bias={1: -100, 2: 1.5})):
        p = token_probabilities(logits[:1], sampling)[0].double()
        p /= p.sum()  # exactly 1 in float64, as chisquare checks
        n = 6_000
        firsts = Counter(accept_draft(logits, [4], sampling, generator)[0] for _ in range(n))
        support = [t for t in range(6) if p[t] > 0]
        assert set(firsts) <= set(support)
        observed = [firsts[t] for t in support]
        assert chisquare(observed, [n * float(p[t]) for t in support]).pvalue > 0.01


# --------------------------------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("positions", POSITIONS)
def test_rolled_back_drafts_leave_the_logits_of_the_uncached_decoder(
        positions: str, random_model: Callable[..., GPT]) -> None:
    """Random drafts, random accepted lengths: after every keep() the cached logits equal the naive
    loop's on the same tokens, across the sliding window, the ring's wrap and learned restarts."""
    model = random_model(positions=positions, n_kv_head=1)
    rng = random.Random(0)
    decoder = Decoder(model, [[1, 2, 3]], max_new_tokens=300, spare=4)
    for _ in range(60):
        decoder.logits()
        decoder.append(torch.tensor([[rng.randrange(13)]]))  # a plain step
        room = min(decoder.draft_room(), 4)  # 0 where a prefill is due
        if room:
            draft = [rng.randrange(13) for _ in range(rng.randint(1, room))]
            assert decoder.verify(draft).shape == (len(draft) + 1, 13)
            kept = rng.randint(0, len(draft))
            decoder.keep([*draft[:kept], rng.randrange(13)], len(draft))
        reference = Decoder(model, decoder.rows, use_cache=False)
        reference.starts = list(decoder.starts)
        assert_close(decoder.logits(), reference.logits(), atol=1e-5, rtol=1e-5)
    assert len(decoder.rows[0]) > 2 * WINDOW  # the window moved (and the ring wrapped) several times


# ------------------------------------------------------------------------------------ greedy = plain greedy


@pytest.mark.parametrize(("positions", "kv_heads"), covering(list(itertools.product(POSITIONS, (2, 1)))))
def test_greedy_speculation_gives_plain_greedy_tokens(positions: str, kv_heads: int,
                                                      random_model: Callable[..., GPT]) -> None:
    greedy = SamplingConfig(temperature=0, max_new_tokens=70)
    stats = SpeculationStats()
    for seed, prompt in enumerate(PROMPTS):
        model = random_model(seed, positions=positions, n_kv_head=kv_heads)
        plain = tokens_of(model, prompt, greedy)
        for speculation in (SpeculationConfig(), SpeculationConfig(draft_tokens=2, ngram=1)):
            assert tokens_of(model, prompt, greedy, speculation=speculation, stats=stats) == plain
        biased = greedy.replace(logit_bias={plain[-1]: -100, 4: 3.0})  # acts on verified tokens alike
        assert (tokens_of(model, prompt, biased, speculation=SpeculationConfig(), stats=stats)
                == tokens_of(model, prompt, biased))
    assert stats.drafted > stats.accepted > 0 and stats.passes > 0


def test_stop_ids_and_max_new_tokens_end_a_speculative_run_where_they_end_a_plain_one(
        random_model: Callable[..., GPT]) -> None:
    model = random_model(3)
    free = tokens_of(model, [1, 2, 3, 1, 2], SamplingConfig(temperature=0, max_new_tokens=40))
    speculation = SpeculationConfig()
    for stop in sorted(set(free[5:])):  # a stop id met inside an accepted draft ends the run there too
        greedy = SamplingConfig(temperature=0, max_new_tokens=40)
        plain = tokens_of(model, [1, 2, 3, 1, 2], greedy, eot_id=[stop, 99])
        assert tokens_of(model, [1, 2, 3, 1, 2], greedy, eot_id=[stop, 99], speculation=speculation) == plain
        assert plain[-1] == stop
    for n in (0, 1, 2, 7):
        assert tokens_of(model, [1, 2, 3, 1, 2], SamplingConfig(temperature=0, max_new_tokens=n),
                         speculation=speculation) == free[:n]


def test_only_one_prompt_with_the_cache_can_speculate(random_model: Callable[..., GPT]) -> None:
    model, sampling = random_model(), SamplingConfig(max_new_tokens=3)
    with pytest.raises(ValueError, match="one prompt"):
        list(generate(model, [[1], [2]], sampling, speculation=SpeculationConfig()))
    with pytest.raises(ValueError, match="use_cache=True"):
        list(generate(model, [[1]], sampling, use_cache=False, speculation=SpeculationConfig()))
    with pytest.raises(ValueError, match="SpeculationConfig.draft_tokens=0 must be positive"):
        SpeculationConfig(draft_tokens=0)


# ------------------------------------------------------------------------ sampling keeps the distribution


def continuation_probabilities(model: GPT, prompt: list[int], sampling: SamplingConfig,
                               length: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every continuation of `length` tokens under plain sampling: one forward
    pass over every possible continuation, multiplying the processed next-token probabilities."""
    vocab = model.config.vocab_size
    continuations = list(itertools.product(range(vocab), repeat=length))
    idx = torch.tensor([prompt + list(c) for c in continuations])  # (V^length, P + length)
    with torch.no_grad():
        logits = model(idx)[0][:, len(prompt) - 1:-1]  # (N, length, V): the predictions of each new token
    probs = token_probabilities(logits.flatten(0, 1), sampling).view(len(continuations), length, vocab)
    chosen = probs.gather(2, idx[:, len(prompt):, None])[..., 0].prod(dim=1)  # (N,)
    return dict(zip(continuations, chosen.tolist(), strict=True))


@pytest.mark.slow
def test_sampled_speculation_keeps_the_distribution_of_plain_sampling(
        random_model: Callable[..., GPT]) -> None:
    """10,000 speculative samples of 4 tokens against the exact distribution plain sampling draws from
    (with top-k; top-p and logit_bias are checked above, at less cost), chi-squared with rare
    continuations pooled: p > 0.01 (fixed seed)."""
    model = random_model(1, vocab_size=5, n_layer=1)  # one layer: 10,000 runs in about 20 s
    prompt, n = [0, 1, 2, 3, 4, 0, 1, 2], 10_000  # every token occurs: every step after the first drafts
    sampling = SamplingConfig(temperature=1.3, top_k=4, max_new_tokens=4)
    exact = continuation_probabilities(model, prompt, sampling, 4)
    generator, stats = torch.Generator().manual_seed(0), SpeculationStats()
    counts = Counter(tuple(tokens_of(model, prompt, sampling, generator=generator, stats=stats,
                                     speculation=SpeculationConfig(draft_tokens=3, ngram=2)))
                     for _ in range(n))
    assert set(counts) <= {c for c, p in exact.items() if p > 0}
    common = [c for c, p in exact.items() if p * n >= 5]
    observed = [counts[c] for c in common] + [n - sum(counts[c] for c in common)]
    total = sum(exact.values())  # 1 up to float32 rounding, which chisquare would refuse
    expected = [exact[c] * n / total for c in common]
    expected.append(n - sum(expected))
    assert chisquare(observed, expected).pvalue > 0.01
    assert 0 < stats.accepted < stats.drafted  # drafts were both kept and rejected


# ------------------------------------------------------------------------------------------------------ CLI


def test_cli_speculative_greedy_prints_the_same_tokens_and_the_acceptance(
        tmp_path: Path, random_model: Callable[..., GPT], capsys: pytest.CaptureFixture) -> None:
    tokenizer = CharTokenizer.train("abcdefgh .\n")
    model = random_model(2, vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path / "run" / "best.safetensors",
                    Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    common = ["sample", str(tmp_path / "run"), "--prompt", "abcab", "--temperature", "0",
              "--max-new-tokens", "40", "--json"]
    assert main(common) == 0
    plain = capsys.readouterr()
    assert main([*common, "--speculative", "ngram", "--draft-tokens", "4", "--ngram", "2"]) == 0
    speculated = capsys.readouterr()
    assert json.loads(speculated.out)["tokens"] == json.loads(plain.out)["tokens"]
    note = re.fullmatch(r"note: speculative decoding: (\d+) of (\d+) drafted tokens accepted \((\d+)%\) "
                        r"in (\d+) verifying passes\n", speculated.err)
    assert note is not None and plain.err == ""
    accepted, drafted, _, passes = map(int, note.groups())
    assert drafted >= accepted > 0 and passes > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--draft-tokens", "4"], "--draft-tokens needs --speculative ngram"),
    (["--speculative", "ngram", "--no-kv-cache"], "drop --no-kv-cache"),
    (["--speculative", "ngram", "--ngram", "0"], "argument --ngram: 0 is not an integer of at least 1"),
])
def test_cli_speculative_mistakes_are_one_line(args: list[str], message: str, tmp_path: Path,
                                               random_model: Callable[..., GPT],
                                               capsys: pytest.CaptureFixture) -> None:
    tokenizer = CharTokenizer.train("abc")
    model = random_model(vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path / "run" / "best.safetensors",
                    Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    assert main(["sample", str(tmp_path / "run"), "--prompt", "ab", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("gptlab: error: ") and message in captured.err and captured.out == ""
