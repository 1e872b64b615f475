"""N-gram embeddings (`ModelConfig.ngram_embeddings`) against independent references: a naive lookup per
position written out here, the plain forward pass, the recompute loop, each row of a batch alone, an
unbroken training run; and the places that must refuse them or skip a property they break."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from conftest import SAT_LINES, assert_identical_runs
from gptlab.cli import main
from gptlab.config import (
    ModelConfig,
    SamplingConfig,
    Seq2SeqConfig,
    SettingError,
    TrainConfig,
    parameter_count,
)
from gptlab.generate import Decoder, generate
from gptlab.handout.verify import verify_model
from gptlab.inspection.hooks import hooked, record
from gptlab.interop import gguf, gpt2, llama
from gptlab.interop.families import export_family
from gptlab.kv_cache import KVCache
from gptlab.model import GPT
from gptlab.speculative import SpeculationConfig
from gptlab.training.loop import train
from gptlab.training.optim import make_optimizer
from gptlab.training.resume import resume

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models only lose time to a 2nd thread

V, WINDOW = 13, 8
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
PRIME = 1_000_003  # the hashed tables' multiplier, as positions.py documents it
# (orders, table size): exact bigrams ((V + 1)^2 = 196 rows), exact + hashed trigrams, hashed bigrams.
TABLES = [((2,), 16384), ((2, 3), 500), ((2,), 50)]


def ngram_model(orders: tuple[int, ...] = (2, 3), size: int = 500, seed: int = 0, **changes: Any) -> GPT:
    """A tiny GPT whose every weight, the n-gram tables included, is far from zero."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=V, block_size=WINDOW, n_layer=2, n_head=2, n_embd=8,
                         ngram_embeddings=orders, ngram_table_size=size, **changes)
    model = GPT(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


def naive_rows(model: GPT, sequence: list[int]) -> torch.Tensor:
    """The n-gram rows (T, D) of one sequence, looked up position by position from the written-out rule."""
    size, rows = model.config.ngram_table_size, []
    for t in range(len(sequence)):
        row = torch.zeros(model.config.n_embd)
        for n, table in zip(model.config.ngram_embeddings, model.ngrams.tables, strict=True):
            gram = [sequence[i] if i >= 0 else V for i in range(t - n + 1, t + 1)]  # V: the start id
            if (V + 1) ** n <= size:  # exact: the n-gram's digits in base V + 1
                index = sum(token * (V + 1) ** (n - 1 - j) for j, token in enumerate(gram))
            else:  # hashed: h = (h * PRIME + id) mod size, oldest id first
                index = 0
                for token in gram:
                    index = (index * PRIME + token) % size
            row = row + table[index]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize(("orders", "size"), TABLES)
def test_embedding_rows_are_a_naive_per_position_lookup(orders: tuple[int, ...], size: int) -> None:
    """E[w] + n-gram rows + p_i, for each position, and the `embed` hook point sees the same rows."""
    model = ngram_model(orders, size)
    idx = torch.randint(V, (3, WINDOW), generator=torch.Generator().manual_seed(1))
    wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
    expected = torch.stack([wte[row] + naive_rows(model, row.tolist()) + wpe[:WINDOW] for row in idx])
    with torch.no_grad(), record(model, ["embed"]) as seen:
        assert_close(model.embed(idx), expected, **TOLERANCE)
        model(idx)
    assert_close(seen["embed"], expected, **TOLERANCE)


def test_patching_the_embedding_rows_moves_the_prediction_with_them() -> None:
    """Patching `embed` with another prompt's rows (n-gram part included) gives that prompt's logits."""
    model = ngram_model()
    a, b = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[4, 3, 2, 1]])
    with torch.no_grad(), record(model, ["embed"]) as seen:
        logits_a = model(a)[0]
    with torch.no_grad(), hooked(model, {"embed": lambda value, name: seen["embed"]}):
        assert_close(model(b)[0], logits_a, **TOLERANCE)
    with torch.no_grad(), hooked(model, {"embed": lambda value, name: torch.zeros_like(value)}):
        assert not torch.allclose(model(a)[0], logits_a)  # an ablation reaches the logits


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cached_generation_equals_recomputation_and_the_plain_forward(positions: str) -> None:
    """Across the window (learned positions restart it, rope slides a band), the cached step's logits are
    the recompute loop's; inside the window both are model(row)'s."""
    model = ngram_model(positions=positions)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached, recomputed = Decoder(model, prompts), Decoder(model, prompts, use_cache=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4 * WINDOW):
        fast, slow = cached.logits(), recomputed.logits()  # (2, V)
        assert_close(fast, slow, **TOLERANCE)
        if len(cached.rows[1]) <= WINDOW:
            for b, row in enumerate(cached.rows):
                assert_close(fast[b], model(torch.tensor([row]))[0][0, -1], **TOLERANCE)
        tokens = torch.multinomial(slow.softmax(-1), 1, generator=generator)  # (2, 1): varied rows
        cached.append(tokens)
        recomputed.append(tokens)


def test_left_padded_batch_rows_equal_each_row_alone() -> None:
    """Padding never enters a row's n-grams: its first token reads the start id, as alone."""
    model = ngram_model(positions="rope")
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7], [7, 7, 2]]
    decoders = [Decoder(model, prompts)] + [Decoder(model, [p]) for p in prompts]
    for step in range(2 * WINDOW):
        together = decoders[0].logits()
        for b, alone in enumerate(decoders[1:]):
            assert_close(together[b], alone.logits()[0], **TOLERANCE)
        tokens = torch.multinomial(together.softmax(-1), 1, generator=torch.Generator().manual_seed(step))
        decoders[0].append(tokens)
        for b, alone in enumerate(decoders[1:]):
            alone.append(tokens[b:b + 1])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    batched = torch.cat(list(generate(model, prompts, greedy)), dim=1).tolist()
    for prompt, row in zip(prompts, batched, strict=True):
        assert [row] == torch.cat(list(generate(model, [prompt], greedy)), dim=1).tolist()


def test_speculation_rewinds_the_token_history_with_the_keys() -> None:
    """Rejected drafts leave the cache's ids as they leave its keys: greedy tokens are plain greedy's."""
    model = ngram_model(positions="rope")
    prompt = [[1, 2, 3, 1, 2, 3, 1, 2]]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=3 * WINDOW)
    plain = [int(t) for t in generate(model, prompt, sampling)]
    speculation = SpeculationConfig(draft_tokens=3)
    drafted = [int(t) for t in generate(model, prompt, sampling, speculation=speculation)]
    assert drafted == plain


def test_cache_rows_keep_their_history_when_moved_resized_cleared_and_rewound() -> None:
    """The scheduler's row operations (select, move, resize, clear, rewind) carry each row's last ids."""
    model = ngram_model(positions="rope")
    cache = KVCache(model.config, 3, capacity=WINDOW)
    cache.reset(torch.zeros(3, dtype=torch.long))
    sequence = [3, 1, 4, 1, 5, 9]

    def step(row: int, ids: list[int]) -> torch.Tensor:
        cache.select(row, row + 1)
        with torch.no_grad():
            return model(torch.tensor([ids]), cache=cache)[0][0, -1]

    def alone(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids]))[0][0, -1]

    step(2, sequence[:4])
    step(0, [8, 8])  # another row's tokens, never read by row 2's n-grams
    cache.move(2, 1)
    cache.clear(2)
    cache.resize(2, WINDOW + 2)
    assert_close(step(1, sequence[4:5]), alone(sequence[:5]), **TOLERANCE)
    cache.rewind(1, 2)  # forget 1 and 5: the next token follows 3 1 4
    assert_close(step(1, [2]), alone(sequence[:3] + [2]), **TOLERANCE)
    cache.clear(0)
    assert_close(step(0, [6, 2]), alone([6, 2]), **TOLERANCE)  # a cleared row starts from the start id


def test_verify_skips_order_blindness_and_causality_still_holds() -> None:
    model = ngram_model(positions="none")
    checks = {c.name: c for c in verify_model(model)}
    blind = checks["no positions, no mask: permutation equivariant"]
    assert blind.passed is None and "n-gram" in blind.note and "local order" in blind.note
    assert checks["logits at i ignore every input after i"].passed is True
    assert checks["logits at i ignore every input after i"].deviation == 0.0
    assert checks["cached generation = uncached"].passed is True


def test_parameter_count_holds_the_tables() -> None:
    config = ModelConfig(vocab_size=65, n_embd=128, ngram_embeddings=(2, 3), ngram_table_size=8192)
    counts = parameter_count(config)
    tables = 128 * (66 * 66 + 8192)  # an exact bigram table, a hashed trigram one
    assert counts["n-gram tables"] == tables
    assert GPT(config).num_parameters() == counts["total"]
    assert parameter_count(config.replace(ngram_embeddings=()))["total"] == counts["total"] - tables


@pytest.mark.parametrize(("changes", "message"), [
    ({"ngram_embeddings": [1]}, r"ngram_embeddings=\[1\]: each order must be from 2"),
    ({"ngram_embeddings": [2, 9]}, r"block_size=8"),
    ({"ngram_embeddings": ["2"]}, r"ngram_embeddings\[0\]='2' must be of type int"),
    ({"ngram_table_size": 0}, r"ngram_table_size=0 must be positive"),
])
def test_bad_settings_name_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(block_size=WINDOW, **changes)


def test_settings_round_trip_and_stay_with_the_gpt() -> None:
    config = ModelConfig(ngram_embeddings=[2, 3])  # JSON and TOML give lists
    assert config.ngram_embeddings == (2, 3) and config.to_dict()["ngram_embeddings"] == [2, 3]
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"ngram_embeddings=\(2,\): this option is offered for the GPT"):
        Seq2SeqConfig(ngram_embeddings=(2,))


def test_exporters_refuse_by_name() -> None:
    config = ModelConfig(ngram_embeddings=(2,))
    with pytest.raises(ValueError, match=r"ngram_embeddings=\(2,\) \(GPT-2 needs \(\)\)") as err:
        gpt2.check_exportable(config)
    assert "\n" not in str(err.value)
    llama_shape = config.replace(positions="rope", norm="rmsnorm", ffn="swiglu", bias=False)
    assert llama.llama_problems(llama_shape) == ["ngram_embeddings=(2,) (a Llama needs ())"]
    with pytest.raises(ValueError, match="ngram_embeddings"):
        export_family(llama_shape)
    for shape in (config, llama_shape):
        problems = gguf.export_problems(shape)
        error = SettingError("; ".join(problems), ngram_embeddings="ModelConfig.ngram_embeddings")
        assert error.as_flags({}).startswith("--ngram-embeddings 2: llama.cpp's")
        assert error.as_flags({}).endswith("needs --ngram-embeddings left out")


def test_the_optimisers_treat_the_tables_as_embeddings() -> None:
    """AdamW with weight decay, like the token embedding, under both optimisers; never Muon."""
    model = ngram_model()
    for name in ("adamw", "muon"):
        optimizer = make_optimizer(model, TrainConfig(optimizer=name, weight_decay=0.1))
        decayed = [p for g in optimizer.param_groups if g["weight_decay"] == 0.1 and "momentum" not in g
                   for p in g["params"]]
        for table in [*model.ngrams.tables, model.transformer.wte.weight]:
            assert any(table is p for p in decayed), name


def test_the_command_line_turns_them_on(capsys: pytest.CaptureFixture) -> None:
    assert main(["model", "--vocab-size", "65", "--n-layer", "1", "--ngram-embeddings", "2", "3"]) == 0
    out = capsys.readouterr().out
    assert "ngram_embeddings = [2, 3]" in out and "n-gram tables" in out


@pytest.fixture(scope="module")
def data_dir(char_corpus: Callable[[str], Path]) -> Path:
    return char_corpus("\n".join(SAT_LINES * 30))


@pytest.mark.slow  # trains 8 steps twice
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bit_exact(optimizer: str, data_dir: Path, tmp_path: Path) -> None:
    model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, ngram_embeddings=(2, 3),
                        ngram_table_size=1024)
    steps = TrainConfig(batch_size=4, max_steps=8, warmup_steps=2, eval_interval=4, eval_batches=1,
                        optimizer=optimizer, device="cpu", precision="float32")
    train(tmp_path / "whole", data_dir, model, steps, progress=False)
    train(tmp_path / "split", data_dir, model, steps, stop_at=3, progress=False)
    resume(tmp_path / "split", progress=False)
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")
