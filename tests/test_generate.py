"""Generation against independent references: the naive recompute loop, the plain forward pass,
Hugging Face's GPT-2 `generate`, hand-made distributions and written-out stop-string rules."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from conftest import TwoStops
from gptlab.checkpoint import Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ARRANGEMENTS, POSITIONS, ModelConfig, SamplingConfig
from gptlab.generate import (
    Chunk,
    Decoder,
    generate,
    stream_text,
    text_chunks,
)
from gptlab.inference.layouts import decoding_layout, faster_layout
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.sampling import token_probabilities
from gptlab.text.tokenizer import ByteTokenizer, CharTokenizer

WINDOW = 16  # small, so that 200 steps cross the context window many times
STEPS = 200
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models only lose time to a 2nd thread

RandomModel = Callable[..., GPT]  # the `random_model` fixture below


@pytest.fixture
def random_model(tiny_config: Callable[..., ModelConfig]) -> RandomModel:
    """`random_model(**changes)`: a tiny model with weights large enough that every part of it moves the
    logits."""

    def make(**changes: object) -> GPT:
        model = GPT(tiny_config(block_size=WINDOW, **changes)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.4)
        return model

    return make


def greedy(steps: int) -> SamplingConfig:
    return SamplingConfig(temperature=0, max_new_tokens=steps)


def rows_of(stream: Iterator[torch.Tensor]) -> list[list[int]]:
    """The rows of a token stream (each step (B, 1)) as lists."""
    return torch.cat(list(stream), dim=1).tolist()


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- cached = recomputed = plain forward

COMBINATIONS = list(itertools.product(POSITIONS, ("layernorm", "rmsnorm"), ARRANGEMENTS, (True, False)))
# 32 combinations of 200 steps, about 0.3 s each: `make test-fast` decodes every 7th (5, which between them
# cover every position scheme, norm, arrangement and tying), `make test` all of them.
SAMPLED_COMBINATIONS = [c if i % 7 == 0 else pytest.param(*c, marks=pytest.mark.slow)
                        for i, c in enumerate(COMBINATIONS)]


@pytest.mark.slow
@pytest.mark.parametrize(("positions", "norm", "arrangement", "tied"), SAMPLED_COMBINATIONS)
def test_cached_logits_equal_recomputed_logits_for_200_steps(
    positions: str, norm: str, arrangement: str, tied: bool, random_model: RandomModel
) -> None:
    """Across the window boundary, the logits agree to 1e-5 and the greedy choice is the same at every
    step, for two rows of a batch: one decoded greedily, one sampled (a varied sequence, since a loop of
    one repeated token, where greedy decoding of a random model ends, would hide a wrong mask)."""
    model = random_model(positions=positions, norm=norm, arrangement=arrangement, tied=tied)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached, recomputed = Decoder(model, prompts), Decoder(model, prompts, use_cache=False)
    keys = cached.cache.keys.data_ptr()
    generator = seeded(0)
    fast, slow = [], []
    for _ in range(STEPS):
        fast.append(cached.logits())
        slow.append(recomputed.logits())  # (2, V)
        sampled = torch.multinomial(slow[-1][:1].softmax(-1), 1, generator=generator)  # (1, 1)
        greedy = fast[-1][1:].argmax(-1, keepdim=True)  # (1, 1): the cached decoder's own choice
        cached.append(torch.cat([sampled, greedy]))
        recomputed.append(torch.cat([sampled, greedy]))
    assert_close(torch.stack(fast), torch.stack(slow), **TOLERANCE)
    assert torch.equal(torch.stack(fast).argmax(-1), torch.stack(slow).argmax(-1))  # same greedy tokens
    assert len(set(cached.rows[0])) > 5  # the sampled sequence really varies
    assert cached.cache.keys.data_ptr() == keys  # the cache memory was allocated once for the run


@pytest.mark.slow
@pytest.mark.parametrize("positions", POSITIONS)
def test_greedy_and_seeded_generation_are_the_same_without_the_cache(
    positions: str, random_model: RandomModel
) -> None:
    model = random_model(positions=positions)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    for temperature in (0.0, 1.0):
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=STEPS)
        cached = rows_of(generate(model, prompts, sampling, generator=seeded(3)))
        recomputed = rows_of(generate(model, prompts, sampling, generator=seeded(3), use_cache=False))
        assert cached == recomputed
        assert len(cached[0]) == STEPS


@pytest.mark.parametrize("positions", POSITIONS)
def test_cache_gives_the_plain_forward_logits_inside_the_window(
    positions: str, random_model: RandomModel
) -> None:
    """Independent of the recompute loop: below the window, each cached step equals model(row)[-1]."""
    model = random_model(positions=positions)
    decoder = Decoder(model, [[3, 1, 4, 1, 5], [9, 2]])
    for step in range(WINDOW - 5):
        logits = decoder.logits()
        for b, row in enumerate(decoder.rows):
            assert_close(logits[b], model(torch.tensor([row]))[0][0, -1], **TOLERANCE)
        decoder.append(torch.tensor([[step % 13], [(5 * step + 1) % 13]]))


@pytest.mark.parametrize("positions", ["rope", "none"])
def test_sliding_window_is_a_band_mask(positions: str, random_model: RandomModel) -> None:
    """With one layer, a band of W keys is exactly the last W tokens (these schemes see only relative
    positions); with two it is not, because older tokens live on in the kept keys (module docstring)."""
    sequence = torch.randint(0, 13, (1, 40), generator=seeded(1)).tolist()[0]
    for n_layer in (1, 2):
        model = random_model(positions=positions, n_layer=n_layer)
        decoder = Decoder(model, [sequence[:WINDOW]])
        for token in sequence[WINDOW:]:
            decoder.logits()  # one cached step per token
            decoder.append(torch.tensor([[token]]))
        last_window = model(torch.tensor([sequence[-WINDOW:]]))[0][0, -1]
        if n_layer == 1:
            assert_close(decoder.logits()[0], last_window, **TOLERANCE)
        else:
            assert not torch.allclose(decoder.logits()[0], last_window, atol=1e-3)


def test_learned_positions_restart_from_the_last_half_window(random_model: RandomModel) -> None:
    """Independent of the recompute loop: the written-out rule, then the plain forward on the window."""
    model = random_model(positions="learned")
    decoder = Decoder(model, [[1, 2, 3]])
    start = 0
    for step in range(3 * WINDOW):
        row = decoder.rows[0]
        if len(row) - start > WINDOW:
            start = len(row) - WINDOW // 2
        assert_close(decoder.logits()[0], model(torch.tensor([row[start:]]))[0][0, -1], **TOLERANCE)
        decoder.append(torch.tensor([[(7 * step) % 13]]))
    assert start > WINDOW  # the window moved more than once


@pytest.mark.slow
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_prompts_of_different_lengths_give_each_prompt_its_own_tokens(
    positions: str, use_cache: bool, random_model: RandomModel
) -> None:
    model = random_model(positions=positions)
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 7, 2, 9, 1]]
    batched = rows_of(generate(model, prompts, greedy(3 * WINDOW), use_cache=use_cache))
    for prompt, row in zip(prompts, batched, strict=True):
        assert [row] == rows_of(generate(model, [prompt], greedy(3 * WINDOW), use_cache=use_cache))
    # and on varied (sampled) rows, the logits of the padded batch equal each row's alone, step by step
    decoders = [Decoder(model, prompts, use_cache)] + [Decoder(model, [p], use_cache) for p in prompts]
    for step in range(3 * WINDOW):
        together = decoders[0].logits()
        for b, alone in enumerate(decoders[1:]):
            assert_close(together[b], alone.logits()[0], **TOLERANCE)
        tokens = torch.multinomial(together.softmax(-1), 1, generator=seeded(step))  # (B, 1)
        decoders[0].append(tokens)
        for b, alone in enumerate(decoders[1:]):
            alone.append(tokens[b : b + 1])


@pytest.mark.parametrize("positions", POSITIONS)
def test_a_short_run_gets_a_cache_of_its_own_length_and_the_same_tokens(positions: str,
                                                                        random_model: RandomModel) -> None:
    model = random_model(positions=positions)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert Decoder(model, prompts, max_new_tokens=6).cache.capacity == 5 + 6  # not WINDOW = 16
    assert Decoder(model, prompts, max_new_tokens=40).cache.capacity == WINDOW  # a ring past the window
    short = rows_of(generate(model, prompts, greedy(6)))
    assert short == rows_of(generate(model, prompts, greedy(6), use_cache=False))
    assert [row[:6] for row in rows_of(generate(model, prompts, greedy(12)))] == short


def test_prompts_longer_than_the_window_keep_their_last_tokens(random_model: RandomModel) -> None:
    model = random_model(positions="rope")
    prompt = torch.randint(0, 13, (1, 3 * WINDOW), generator=seeded(2))
    first = next(generate(model, prompt, greedy(1)))
    assert first.item() == model(prompt[:, -WINDOW:])[0][0, -1].argmax().item()


@pytest.mark.slow
def test_cached_greedy_generation_matches_transformers_gpt2(random_model: RandomModel) -> None:
    """Hugging Face's GPT-2, with its own KV cache, on the same weights: same tokens, same logits."""
    pytest.importorskip("transformers")
    from gptlab.interop.huggingface import to_transformers

    model = random_model(n_embd=16, n_head=4, vocab_size=50)
    hf = to_transformers(model)
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = hf.generate(prompt, max_new_tokens=WINDOW - 4, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    decoder = Decoder(model, prompt.tolist())
    for hf_logits in out.logits:
        ours = decoder.logits()
        assert_close(ours, hf_logits, **TOLERANCE)
        decoder.append(ours.argmax(-1, keepdim=True))
    assert decoder.rows == out.sequences.tolist()


# ---------------------------------------------------------------------------------------- sampling


def test_the_decoding_layout_changes_strides_only(run: Path, random_model: RandomModel) -> None:
    model = random_model()
    prompt = torch.tensor([[1, 2, 3]])
    before = model(prompt)[0]
    tokens = rows_of(generate(model, prompt, greedy(30)))
    decoding_layout(decoding_layout(model, "column"), "column")  # twice: the second call changes nothing
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert_close(model(prompt)[0], before, atol=1e-6, rtol=1e-6)
    assert rows_of(generate(model, prompt, greedy(30))) == tokens
    decoding_layout(model, "row")  # and back
    assert all(m.weight.is_contiguous() for m in linears)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert faster_layout(model) in ("row", "column")  # measured on this CPU
    loaded = load(run).model  # models loaded for inference on the CPU come in one of the two layouts
    assert loaded.lm_head.weight.is_contiguous() or loaded.lm_head.weight.t().is_contiguous()


def test_sampled_distribution_sums_to_one_after_every_filter() -> None:
    logits = 3 * torch.randn(4, 50)
    for temperature, top_k, top_p in itertools.product((0.5, 1.0, 2.0), (None, 1, 7), (1.0, 0.9, 0.3)):
        probs = token_probabilities(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
        assert_close(probs.sum(-1), torch.ones(4))
        if top_k is not None:
            assert ((probs > 0).sum(-1) <= top_k).all()


def test_top_p_keeps_exactly_the_smallest_set_that_reaches_p() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])  # sorted: 0.4 (id 1), 0.3 (id 3), 0.2 (id 2), 0.1 (id 0)
    for top_p, kept in [(0.3, {1}), (0.45, {1, 3}), (0.65, {1, 3}), (0.75, {1, 3, 2}), (0.95, {0, 1, 2, 3}),
                        (1.0, {0, 1, 2, 3})]:
        result = token_probabilities(probs.log(), SamplingConfig(top_p=top_p))[0]
        assert set(result.nonzero().flatten().tolist()) == kept, top_p
        expected = torch.tensor([p if i in kept else 0.0 for i, p in enumerate(probs[0].tolist())])
        assert_close(result, expected / expected.sum())
    # a set whose probability equals p exactly reaches it: two of four equally likely tokens for p = 0.5
    equal = token_probabilities(torch.zeros(1, 4), SamplingConfig(top_p=0.5))
    assert_close(equal, torch.tensor([[0.5, 0.5, 0.0, 0.0]]))


def test_top_k_of_one_is_greedy_and_the_same_seed_gives_the_same_samples(random_model: RandomModel) -> None:
    model = random_model(positions="rope")
    top_1 = SamplingConfig(temperature=1.3, top_k=1, max_new_tokens=40)
    assert rows_of(generate(model, [[1, 2, 3]], top_1, generator=seeded(5))) == rows_of(
        generate(model, [[1, 2, 3]], greedy(40)))

    def sample(seed: int) -> list[list[int]]:
        sampling = SamplingConfig(top_k=5, top_p=0.9, max_new_tokens=40)
        return rows_of(generate(model, [[1, 2, 3]], sampling, generator=seeded(seed)))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(temperature=-0.5), "SamplingConfig.temperature=-0.5 must be >= 0"),
        (dict(temperature=float("inf")), "SamplingConfig.temperature=inf must be a finite number"),
        (dict(top_k=0), "SamplingConfig.top_k=0 must be at least 1"),
        (dict(top_p=0.0), "SamplingConfig.top_p=0.0 must be in (0, 1]"),
        (dict(top_p=1.5), "SamplingConfig.top_p=1.5 must be in (0, 1]"),
        (dict(max_new_tokens=-1), "SamplingConfig.max_new_tokens=-1 must not be negative"),
        (dict(stop=["\n", ""]), "SamplingConfig.stop=['\\n', '']: stop strings must not be empty"),
        (dict(top_k="3"), "SamplingConfig.top_k='3' must be of type int"),
    ],
)
def test_invalid_settings_are_one_line_errors_naming_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        SamplingConfig(**settings)
    assert "\n" not in str(err.value)


def test_sampling_config_round_trips_through_json() -> None:
    config = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9, stop=("\n", "E"), seed=3)
    assert SamplingConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert SamplingConfig.from_dict({"stop": ["a"]}).stop == ("a",)


# ------------------------------------------------------------------------------------------ stopping


def chunks_for(text: str, stop: list[str], tokenizer: CharTokenizer | ByteTokenizer) -> list[Chunk]:
    """The text chunks of a scripted stream of tokens that spell `text`."""
    tokens = (torch.tensor([[token]]) for token in tokenizer.encode(text))
    return list(text_chunks(tokens, tokenizer, stop))


def test_stop_strings_end_the_text_and_are_never_shown_even_in_part() -> None:
    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz \n")
    chunks = chunks_for("the end is near\n\nnext", ["\n\n", "is nix"], tokenizer)
    shown = "".join(c.text for c in chunks)
    assert shown == "the end is near" and chunks[-1].stop_reason == "stop"
    assert [c.token for c in chunks[:-1]] == tokenizer.encode("the end is near\n\n")  # up to the stop
    # "is n" might have begun "is nix": it was held back until "e" ruled that out
    revealed = list(itertools.accumulate(c.text for c in chunks))
    assert "the end " in revealed and "the end is" not in revealed
    assert all(not text.endswith("\n") for text in revealed)
    assert chunks_for("no stop here", ["\n\n"], tokenizer)[-1] == Chunk("", None, "length")


def test_cut_characters_are_held_back_until_complete() -> None:
    chunks = chunks_for("naïve ✓ done", [], ByteTokenizer())
    assert "".join(c.text for c in chunks) == "naïve ✓ done"
    assert all("\ufffd" not in c.text for c in chunks)


def test_generation_stops_at_the_end_of_text_token(random_model: RandomModel) -> None:
    model = random_model(vocab_size=CharTokenizer.train("abcdefghijklm").vocab_size)
    tokenizer = CharTokenizer.train("abcdefghijklm")
    sampling = SamplingConfig(max_new_tokens=30)
    free = [c.token for c in stream_text(model, tokenizer, "abc", sampling, generator=seeded(4))][:-1]
    tokenizer.eot_id = free[6]
    stop_at = free.index(tokenizer.eot_id)
    chunks = list(stream_text(model, tokenizer, "abc", sampling, generator=seeded(4)))
    assert [c.token for c in chunks[:-1]] == free[: stop_at + 1]
    assert "".join(c.text for c in chunks) == tokenizer.decode(free[:stop_at])
    assert chunks[-1].stop_reason == "eot"


def test_a_batch_stops_when_every_row_has_ended(random_model: RandomModel) -> None:
    model = random_model()
    sampling = SamplingConfig(max_new_tokens=30)
    free = rows_of(generate(model, [[1], [2, 3]], sampling, generator=seeded(8)))
    eot = free[0][4]
    rows = rows_of(generate(model, [[1], [2, 3]], sampling, generator=seeded(8), eot_id=eot))
    ends = [row.index(eot) if eot in row else 29 for row in free]
    assert len(rows[0]) == max(ends) + 1
    for row, free_row, end in zip(rows, free, ends, strict=True):
        assert row[: end + 1] == free_row[: end + 1]
        assert set(row[end + 1 :]) <= {eot}  # a row that ended keeps yielding the end-of-text token


@pytest.mark.slow
def test_a_padded_model_vocabulary_is_never_sampled(random_model: RandomModel) -> None:
    """A byte tokenizer (256 ids) on a model of 300: at temperature 2 the 44 padded ids would come up
    many times in 200 tokens; generate and stream_text never choose one."""
    model = random_model(vocab_size=300, positions="rope")
    sampling = SamplingConfig(temperature=2.0, max_new_tokens=200)
    rows = rows_of(generate(model, [[65], [66, 67]], sampling, generator=seeded(1), vocab_size=256))
    assert all(len(r) == 200 and max(r) < 256 for r in rows)
    chunks = list(stream_text(model, ByteTokenizer(), "AB", sampling, generator=seeded(2)))
    assert len(chunks) == 201 and max(c.token for c in chunks[:-1]) < 256


def test_generation_stops_at_any_of_several_stop_ids(random_model: RandomModel) -> None:
    model = random_model()
    sampling = SamplingConfig(max_new_tokens=30)
    free = rows_of(generate(model, [[1], [2, 3]], sampling, generator=seeded(8)))
    stops = (free[0][3], free[1][3])
    ends = [min(row.index(s) for s in stops if s in row) for row in free]
    rows = rows_of(generate(model, [[1], [2, 3]], sampling, generator=seeded(8), eot_id=stops))
    assert len(rows[0]) == max(ends) + 1
    for row, free_row, end in zip(rows, free, ends, strict=True):
        assert row[: end + 1] == free_row[: end + 1]
        assert set(row[end + 1 :]) <= {row[end]}  # an ended row repeats the id it stopped at
    chars = "abcdefghijklm"
    text = [c.token for c in stream_text(model, CharTokenizer(chars), "b", sampling, generator=seeded(4))]
    never = next(i for i in range(13) if i not in text)
    for pair in ((text[5], never), (never, text[5])):  # either position of the pair stops it
        chunks = list(stream_text(model, TwoStops(chars, pair), "b", sampling, generator=seeded(4)))
        assert [c.token for c in chunks[:-1]] == text[: text.index(text[5]) + 1]
        assert chunks[-1].stop_reason == "eot"


# ----------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def run(tmp_path: Path, random_model: RandomModel) -> Path:
    """A run folder holding an untrained tiny model with a character tokenizer."""
    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz .\n")
    model = random_model(vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path / "run" / "best.safetensors",
                    Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    return tmp_path / "run"


def sample_json(run: Path, capsys: pytest.CaptureFixture, *args: str) -> list[dict]:
    assert main(["sample", str(run), "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_cli_json_streaming_stop_strings_and_the_naive_loop(run: Path, capsys: pytest.CaptureFixture,
                                                            tmp_path: Path) -> None:
    common = ["--prompt", "to be", "--max-new-tokens", "40", "--temperature", "1", "--top-p", "0.95"]
    first, second = sample_json(run, capsys, *common, "--num-samples", "2")
    assert first["prompt"] == "to be" and first["stop_reason"] == "length" and len(first["tokens"]) == 40
    assert first["completion"] != second["completion"] and first["tokens_per_s"] > 0
    naive = sample_json(run, capsys, *common, "--num-samples", "2", "--no-kv-cache")[1]
    assert (naive["completion"], naive["tokens"]) == (second["completion"], second["tokens"])
    stop = first["completion"][10:13]
    (stopped,) = sample_json(run, capsys, *common, "--stop", "zzz", stop)
    assert stopped["completion"] == first["completion"][: first["completion"].find(stop)]
    assert stopped["stop_reason"] == "stop"
    # streamed text: the same completion, after the header and the prompt, without the stop string
    (tmp_path / "prompt.txt").write_text("to be", encoding="utf-8")
    assert main(["sample", str(run), "--prompt-file", str(tmp_path / "prompt.txt"), *common[2:],
                 "--stop", stop]) == 0
    assert capsys.readouterr().out == f"--- sample 1 ---\nto be{stopped['completion']}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "0"], "SamplingConfig.top_p=0.0 must be in (0, 1]"),
        (["--max-new-tokens", "-3"], "SamplingConfig.max_new_tokens=-3 must not be negative"),
        (["--stop", ""], "stop strings must not be empty"),
        (["--temperature", "inf"], "argument --temperature: inf is not a finite number"),
        (["--num-samples", "0"], "argument --num-samples: 0 is not an integer of at least 1"),
        (["--prompt", ""], "the prompt encodes to no tokens"),
        (["--prompt-file", "{tmp}/missing.txt"], "missing.txt"),
    ],
)
def test_cli_mistakes_are_one_line(args: list[str], message: str, run: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    assert main(["sample", str(run), *[a.format(tmp=tmp_path) for a in args]]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("gptlab: error: ") and captured.err.count("\n") == 1
    assert message in captured.err and captured.out == ""
