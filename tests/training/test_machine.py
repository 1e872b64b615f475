"""Start-up decisions (gptlab.training.machine): the precision probe, its record in config.json and
compare.json, and that a resumed run never measures again."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conftest import assert_identical_runs
from gptlab import common
from gptlab.checkpoint import LAST, load_checkpoint
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.prepare import prepare
from gptlab.experiments import compare as compare_module
from gptlab.experiments.compare import compare
from gptlab.experiments.grid import RunOptions
from gptlab.training import machine
from gptlab.training.loop import train
from gptlab.training.machine import Decision, decide_muon_precision, decide_precision, decide_threads
from gptlab.training.optim import orthogonalise
from gptlab.training.presets import resolve_configs
from gptlab.training.resume import resume

CPU = torch.device("cpu")
SMALL = ModelConfig(vocab_size=20, n_layer=1, n_head=2, n_embd=16, block_size=16)


def fixed_seconds(figures: dict[torch.dtype, list[float]]) -> Callable[..., float]:
    """A stand-in for machine.pass_seconds that returns the given seconds per precision, in turn."""
    turns: dict[torch.dtype, Iterator[float]] = {dtype: iter(values) for dtype, values in figures.items()}

    def seconds(model: torch.nn.Module, batch: list[torch.Tensor], dtype: torch.dtype) -> float:
        return next(turns[dtype])

    return seconds


def never(*args: object, **kwargs: object) -> float:
    raise AssertionError("the probe ran")


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this CPU multiplies bfloat16 natively, so that "auto" is probed on any machine."""
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(common, "cpu_has_bf16_matmul", lambda: True)


@pytest.fixture
def bf16_faster(monkeypatch: pytest.MonkeyPatch, native_bf16: None) -> None:
    """Every probe measures 61 ms a step in bfloat16 and 72 ms in float32 (warm-up passes excepted)."""
    monkeypatch.setattr(machine, "pass_seconds", fixed_seconds({torch.bfloat16: [0.2] + [0.061] * 99,
                                                                torch.float32: [0.2] + [0.072] * 99}))


def test_the_probe_keeps_the_precision_with_the_lower_median(monkeypatch: pytest.MonkeyPatch,
                                                              native_bf16: None) -> None:
    # Medians 72 ms (float32) and 61 ms (bfloat16); the means (181 ms, 340 ms) would pick float32.
    monkeypatch.setattr(machine, "pass_seconds", fixed_seconds({torch.float32: [0.2, 0.072, 0.070, 0.4],
                                                                torch.bfloat16: [0.2, 0.061, 0.9, 0.060]}))
    decision = decide_precision("auto", CPU, SMALL, rows=4)
    assert decision == Decision("precision", "bfloat16", "61 ms against 72 ms a step in float32",
                                {"float32": pytest.approx(72.0), "bfloat16": pytest.approx(61.0)})

    monkeypatch.setattr(machine, "pass_seconds", fixed_seconds({torch.float32: [0.2, 0.05, 0.05, 0.05],
                                                                torch.bfloat16: [0.2, 0.08, 0.08, 0.08]}))
    decision = decide_precision("auto", CPU, SMALL, rows=4)
    assert (decision.value, decision.why) == ("float32", "50 ms against 80 ms a step in bfloat16")

    # bfloat16 3% faster in the probe is within its margin (the step's casts are not probed): float32.
    monkeypatch.setattr(machine, "pass_seconds", fixed_seconds({torch.float32: [0.2, 0.10, 0.10, 0.10],
                                                                torch.bfloat16: [0.2, 0.097, 0.097, 0.097]}))
    decision = decide_precision("auto", CPU, SMALL, rows=4)
    assert (decision.value, decision.why) == ("float32", "100 ms against 97 ms a step in bfloat16")


def test_no_probe_for_a_given_precision_a_cpu_without_native_bf16_or_a_model_too_large(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "pass_seconds", never)
    for given in ("float32", "bfloat16"):
        assert decide_precision(given, CPU, SMALL, rows=4) == Decision("precision", given, "given")
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: False)
    assert decide_precision("auto", CPU, SMALL, rows=4) == Decision(
        "precision", "float32", "this CPU has no native bfloat16 matmul")

    # GPT-2 small at its full window: one row is ~0.8 TFLOP, far above the probe's budget; the width
    # rule (bfloat16 from 256 wide on a CPU with native bfloat16) decides without building the model.
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(common, "cpu_has_bf16_matmul", lambda: True)
    gpt2 = ModelConfig(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=1024)
    decision = decide_precision("auto", CPU, gpt2, rows=8)
    assert decision.value == "bfloat16" and decision.ms == {} and "width rule" in decision.why


def test_the_thread_count_is_reported_with_who_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert decide_threads() == Decision("threads", str(torch.get_num_threads()), "OMP_NUM_THREADS=3")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "text.txt").write_text("the cat sat on the mat.\n" * 200, encoding="utf-8")
    prepare(str(root / "text.txt"), root / "data", tokenizer="char", progress=False)
    return root / "data"


@pytest.mark.slow
def test_a_new_run_saves_the_decided_precision_and_a_resumed_one_never_probes(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bf16_faster: None,
        caplog: pytest.LogCaptureFixture, one_thread: None) -> None:
    model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
    auto = TrainConfig(batch_size=4, max_steps=6, warmup_steps=1, eval_interval=3, eval_batches=1,
                       device="cpu", precision="auto")
    with caplog.at_level(logging.INFO, logger="gptlab"):
        train(tmp_path / "whole", data_dir, model, auto, progress=False)
    line = (f"decided for this machine: precision bfloat16 (61 ms against 72 ms a step in float32), "
            f"{torch.get_num_threads()} thread")
    assert line in caplog.text and "; --precision float32 overrides" in caplog.text
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["train"]["precision"] == "bfloat16"
    assert config["machine"]["cpu"] == common.cpu_name()
    assert config["machine"]["precision"]["ms_per_step"] == {"float32": pytest.approx(72.0),
                                                             "bfloat16": pytest.approx(61.0)}
    assert config["machine"]["threads"]["value"] == str(torch.get_num_threads())
    assert load_checkpoint(tmp_path / "whole", prefer=LAST).train_config.precision == "bfloat16"

    train(tmp_path / "split", data_dir, model, auto, stop_at=2, progress=False)
    monkeypatch.setattr(machine, "decide_precision", never)
    monkeypatch.setattr(machine, "pass_seconds", never)
    resume(tmp_path / "split", progress=False)
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")
    resume(tmp_path / "split", changes={"max_steps": 7}, progress=False)  # rewrites config.json
    assert json.loads((tmp_path / "split" / "config.json").read_text())["machine"] == config["machine"]


def test_compare_decides_once_and_runs_every_cell_in_that_precision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls, jobs = [], []

    def probe(precision: str, device: torch.device, config: ModelConfig, rows: int,
              threads: int | None = None) -> Decision:
        calls.append((precision, config.n_embd, rows))
        return Decision("precision", "bfloat16", "61 ms against 72 ms a step in float32",
                        {"float32": 72.0, "bfloat16": 61.0})

    monkeypatch.setattr(machine, "decide_precision", probe)
    monkeypatch.setattr(compare_module, "run_jobs", lambda todo, n, report: jobs.extend(todo))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat sat on the mat.\n" * 200, encoding="utf-8")
    options = RunOptions(data=str(corpus), model=dict(n_layer=1, n_head=2, n_embd=16, block_size=16),
                         train=dict(batch_size=4, max_steps=30, precision="auto", device="cpu"))
    grid = [("positions", ("learned", "rope"))]
    out = tmp_path / "cmp"
    for _ in range(2):  # the second call keeps the first one's decision
        compare(options, grid, (1,), out, jobs=1, progress=False)
    assert calls == [("auto", 16, 4)]
    assert len(jobs) == 4 and {job.train["precision"] for job in jobs} == {"bfloat16"}
    record = json.loads((out / "compare.json").read_text())
    assert record["machine"]["precision"]["value"] == "bfloat16"
    assert {cell["train"]["precision"] for cell in record["cells"]} == {"bfloat16"}


def test_a_real_probe_of_the_tiny_preset_decides_within_a_second(native_bf16: None) -> None:
    model_config, train_config = resolve_configs("tiny")
    before = torch.get_rng_state()
    begin = time.perf_counter()  # one thread: two contend badly on a shared 2-core machine
    decision = decide_precision("auto", CPU, model_config, train_config.batch_size, threads=1)
    seconds = time.perf_counter() - begin
    assert seconds < 1.0
    assert set(decision.ms) == {"float32", "bfloat16"} and all(ms > 0 for ms in decision.ms.values())
    assert decision.value == min(decision.ms, key=decision.ms.__getitem__)
    assert torch.equal(torch.get_rng_state(), before)  # the run's random stream is not disturbed


def test_muon_orthogonalises_in_float32_where_the_cpu_lacks_native_bfloat16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: False)
    assert decide_muon_precision("auto", CPU) == Decision(
        "muon_precision", "float32", "this CPU has no native bfloat16 matmul")
    assert decide_muon_precision("bfloat16", CPU) == Decision("muon_precision", "bfloat16", "given")
    assert decide_muon_precision("auto", torch.device("cuda")).value == "bfloat16"
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: True)
    assert decide_muon_precision("auto", CPU) == Decision("muon_precision", "bfloat16", "native on this cpu")
    assert decide_muon_precision("float32", CPU) == Decision("muon_precision", "float32", "given")


def newton_schulz_float64(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic iteration on one matrix in float64, written out (the reference for the batched one)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.double()
    x = x.T if x.shape[0] > x.shape[1] else x
    x = x / max(float(x.norm()), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if update.shape[0] > update.shape[1] else x


def test_the_float32_iterations_match_a_float64_reference_where_bfloat16_rounds() -> None:
    updates = torch.randn(3, 48, 16, generator=torch.Generator().manual_seed(0))
    reference = torch.stack([newton_schulz_float64(u) for u in updates])
    coefficients = (3.4445, -4.7750, 2.0315)
    single = orthogonalise(updates, coefficients, 5, 1e-7, torch.float32)
    half = orthogonalise(updates, coefficients, 5, 1e-7)  # torch.optim.Muon's bfloat16
    assert single.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert torch.allclose(single.double(), reference, atol=1e-5)
    assert (half.double() - reference).abs().max() > 1e-3  # what float32 buys: bfloat16 keeps 8 bits


@pytest.mark.slow
def test_a_muon_run_saves_its_newton_schulz_precision_and_resumes_bit_exact(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        one_thread: None) -> None:
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: False)
    model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
    muon = TrainConfig(batch_size=4, max_steps=6, warmup_steps=1, eval_interval=3, eval_batches=1,
                       device="cpu", precision="float32", optimizer="muon")
    with caplog.at_level(logging.INFO, logger="gptlab"):
        train(tmp_path / "whole", data_dir, model, muon, progress=False)
    assert "muon precision float32 (this CPU has no native bfloat16 matmul)" in caplog.text
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["train"]["muon_precision"] == "float32"
    assert config["machine"]["muon_precision"]["value"] == "float32"

    train(tmp_path / "split", data_dir, model, muon, stop_at=3, progress=False)
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: True)  # another machine: the saved one holds
    resume(tmp_path / "split", progress=False)
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")

    train(tmp_path / "bf16", data_dir, model, muon.replace(muon_precision="bfloat16"), progress=False)
    whole = load_checkpoint(tmp_path / "whole", prefer=LAST).model_state
    other = load_checkpoint(tmp_path / "bf16", prefer=LAST).model_state
    assert any(not torch.equal(whole[name], other[name]) for name in whole)  # the setting takes effect


def test_compare_fixes_muons_precision_once_for_the_grid(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    jobs: list = []
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(compare_module, "run_jobs", lambda todo, n, report: jobs.extend(todo))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat sat on the mat.\n" * 200, encoding="utf-8")
    options = RunOptions(data=str(corpus), model=dict(n_layer=1, n_head=2, n_embd=16, block_size=16),
                         train=dict(batch_size=4, max_steps=30, precision="float32", device="cpu",
                                    optimizer="muon"))
    out = tmp_path / "cmp"
    compare(options, [("positions", ("learned", "rope"))], (1,), out, jobs=1, progress=False)
    monkeypatch.setattr(machine, "cpu_has_bf16_matmul", lambda: True)  # the grid keeps what it decided
    compare(options, [("positions", ("learned", "rope"))], (1,), out, jobs=1, progress=False)
    assert len(jobs) == 4 and {job.train["muon_precision"] for job in jobs} == {"float32"}
    record = json.loads((out / "compare.json").read_text())
    assert record["machine"]["muon_precision"]["value"] == "float32" and "precision" not in record["machine"]
