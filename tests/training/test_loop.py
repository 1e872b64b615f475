"""Training, checkpoints and sampling on tiny models: behaviour, exact resume, crash safety."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from conftest import SAT_LINES, assert_identical_runs
from gptlab.checkpoint import BEST, LAST, load_checkpoint, save_checkpoint
from gptlab.config import ModelConfig, SamplingConfig, TrainConfig
from gptlab.data.prepare import prepare
from gptlab.generate import generate
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.training.loop import TrainingDiverged, train
from gptlab.training.optim import (
    BatchedMuon,
    hidden_matrices,
    learning_rate,
    make_optimizer,
    set_learning_rate,
)
from gptlab.training.presets import resolve_configs
from gptlab.training.resume import resume

MODEL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1)
TRAIN = TrainConfig(batch_size=8, max_steps=40, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_interval=10,
                    eval_batches=2, device="cpu", precision="float32")


@pytest.fixture(scope="module")
def data_dir(char_corpus: Callable[[str], Path]) -> Path:
    """A prepared character corpus with obvious structure, so a tiny model learns it in 40 steps."""
    return char_corpus("\n".join(SAT_LINES * 60))


@pytest.mark.slow
def test_a_run_that_evaluates_only_at_its_end_skips_the_untrained_baseline(data_dir: Path,
                                                                          tmp_path: Path) -> None:
    """A timed recipe (eval_interval >= max_steps) evaluates once, after its last step; a run with a curve
    to draw still starts it at step 0."""
    train(tmp_path / "end", data_dir, MODEL, TRAIN.replace(max_steps=4, eval_interval=4), progress=False)
    steps = [row.split(",")[0] for row in (tmp_path / "end" / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == ["4"]
    train(tmp_path / "curve", data_dir, MODEL, TRAIN.replace(max_steps=4, eval_interval=2), progress=False)
    steps = [row.split(",")[0] for row in (tmp_path / "curve" / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == ["0", "2", "4"]


@pytest.mark.slow  # trains 40 steps
def test_loss_falls(data_dir: Path, tmp_path: Path) -> None:
    result = train(tmp_path / "run", data_dir, MODEL, TRAIN, progress=False)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    first_val = float(rows[1].split(",")[2])
    assert result.step == 40
    assert result.best_val_loss < 0.7 * first_val  # from ~ln(vocab) to well below
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["vocab_size"] == len(set((data_dir.parent / "text.txt").read_text()))


@pytest.mark.slow  # trains 40 steps twice
def test_resume_is_exact(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "whole", data_dir, MODEL, TRAIN, progress=False)
    half = train(tmp_path / "split", data_dir, MODEL, TRAIN, stop_at=17, progress=False)
    assert half.step == 17
    resume(tmp_path / "split", progress=False)
    assert load_checkpoint(tmp_path / "split", prefer=LAST).state["step"] == 40
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")


@pytest.mark.slow
def test_muon_resume_is_exact_and_splits_the_parameters(data_dir: Path, tmp_path: Path) -> None:
    muon = TRAIN.replace(max_steps=12, optimizer="muon", muon_lr=0.03, eval_interval=6)
    train(tmp_path / "whole", data_dir, MODEL, muon, progress=False)
    train(tmp_path / "split", data_dir, MODEL, muon, stop_at=7, progress=False)
    resume(tmp_path / "split", progress=False)
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")
    whole = load_checkpoint(tmp_path / "whole", prefer=LAST)
    # Muon's momentum is saved for exactly the blocks' Linear weights, AdamW's moments for the rest
    slots = {name: set(state) for name, state in whole.optimizer_state.items()}
    hidden = {name for name in slots if ".h." in name and name.endswith("weight") and "ln_" not in name}
    assert hidden and all(slots[name] == {"momentum_buffer"} for name in hidden)
    assert all("exp_avg" in slots[name] for name in set(slots) - hidden)
    assert set(slots) == {name for name, _ in GPT(MODEL.replace(vocab_size=whole.model_config.vocab_size))
                          .named_parameters()}


def test_batched_muon_is_torchs_muon_within_bfloat16_rounding() -> None:
    def matrices() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return list(hidden_matrices(GPT(MODEL.replace(vocab_size=20, n_layer=3))))

    ours, theirs = matrices(), matrices()
    batched = BatchedMuon(ours, lr=0.04, weight_decay=0.01, adjust_lr_fn="original")
    reference = torch.optim.Muon(theirs, lr=0.04, weight_decay=0.01, adjust_lr_fn="original")
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        batched.step()
        reference.step()
    # Newton-Schulz as batched products (bmm) against torch's one matrix at a time (mm): a BLAS may block
    # them differently, and a flipped bfloat16 rounding moves an update by about lr * 2**-7 (Keller
    # Jordan's scale 2 times half a bfloat16 step), so within that per step, not bit for bit. A wrong
    # setting (ns_steps, nesterov, momentum) moves these weights by more than 5e-3.
    tolerance = 4 * 0.04 * 2**-7  # 4 steps at lr 0.04: 1.25e-3
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a, b, rtol=0, atol=tolerance)
        # the momentum is the same elementwise lerp of the same gradients on both sides: bit for bit
        assert torch.equal(batched.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"])


def test_muon_groups_follow_the_schedule_at_their_own_peak() -> None:
    model = GPT(MODEL.replace(vocab_size=20))
    config = TRAIN.replace(optimizer="muon", lr=1e-3, min_lr=1e-4, muon_lr=0.05, warmup_steps=0)
    optimizer = make_optimizer(model, config)
    assert set_learning_rate(optimizer, 0, config) == pytest.approx(1e-3)
    peaks = sorted({round(group["lr"], 9) for group in optimizer.param_groups})
    assert peaks == [1e-3, 0.05]
    set_learning_rate(optimizer, config.max_steps, config)  # the end of the cosine: min_lr, scaled
    assert sorted({round(group["lr"], 9) for group in optimizer.param_groups}) == [1e-4, 0.005]
    ours = {id(p) for p in hidden_matrices(model)}
    linear = {id(m.weight) for block in model.transformer.h for m in block.modules()
              if isinstance(m, torch.nn.Linear)}
    assert ours == linear and len(ours) == 4 * MODEL.n_layer


@pytest.mark.slow  # starts a Python process
def test_checkpoint_gives_the_same_logits_in_a_fresh_process(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=10), progress=False)
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    idx = torch.tensor([tokenizer.encode("the cat sat on")])
    expected = model(idx)[0]
    script = textwrap.dedent(f"""
        import sys, torch
        from gptlab.inference.loading import load
        lm = load({str(tmp_path / "run")!r})
        model, tokenizer = lm.model, lm.tokenizer
        logits = model(torch.tensor([tokenizer.encode("the cat sat on")]))[0]
        torch.save(logits, sys.argv[1])
    """)
    out = tmp_path / "logits.pt"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=120)
    assert torch.equal(torch.load(out), expected)


def test_checkpoint_holds_no_pickle_and_ties_stay_tied(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=5), progress=False)
    with open(tmp_path / "run" / LAST, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
    assert header["__metadata__"]["format"] == "gptlab-checkpoint-1"
    assert "model.lm_head.weight" not in header  # tied: stored once, as the embedding
    model = load(tmp_path / "run").model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_failed_save_leaves_the_previous_checkpoint(data_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=5), progress=False)
    before = load_checkpoint(tmp_path / "run", prefer=LAST)

    def crash_midway(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr("gptlab.checkpoint.save_file", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "run" / LAST, before)
    after = load_checkpoint(tmp_path / "run", prefer=LAST)
    assert after.state == before.state
    assert sorted(p.name for p in (tmp_path / "run").glob(".*.tmp-*")) == []  # no temporary file left


@pytest.mark.slow
def test_a_killed_writer_never_damages_the_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL.replace(n_embd=128, n_head=4), TRAIN.replace(max_steps=1),
          progress=False)
    script = textwrap.dedent(f"""
        from gptlab.checkpoint import LAST, load_checkpoint, save_checkpoint
        checkpoint = load_checkpoint({str(tmp_path / "run")!r}, prefer=LAST)
        print("ready", flush=True)
        while True:
            checkpoint.state["step"] += 1
            save_checkpoint({str(tmp_path / "run" / LAST)!r}, checkpoint)
    """)
    for delay in (0.3, 0.55, 0.8):
        writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        time.sleep(delay)
        writer.kill()  # SIGKILL: no chance to clean up
        writer.wait()
        assert load_checkpoint(tmp_path / "run", prefer=LAST).state["step"] >= 1


def test_nan_loss_stops_with_a_clear_message(data_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=20), stop_at=10, progress=False)
    good = load_checkpoint(tmp_path / "run", prefer=LAST)
    original = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", lambda *a, **k: original(*a, **k) * math.nan)
    with pytest.raises(TrainingDiverged, match="loss became nan at step 10.*last good weights"):
        resume(tmp_path / "run", progress=False)
    after = load_checkpoint(tmp_path / "run", prefer=LAST)
    assert after.state["step"] == 10
    for name, tensor in good.model_state.items():
        assert torch.equal(tensor, after.model_state[name])


def test_an_existing_run_is_never_overwritten(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=2), progress=False)
    with pytest.raises(ValueError, match="already holds a run: continue it with resume, or choose another "
                       "run_dir"):
        train(tmp_path / "run", data_dir, MODEL, TRAIN, progress=False)


@pytest.mark.slow  # trains 40 steps
def test_best_checkpoint_has_the_lowest_validation_loss(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN, progress=False)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    lowest = min(float(row.split(",")[2]) for row in rows)
    assert load_checkpoint(tmp_path / "run" / BEST).state["best_val_loss"] == pytest.approx(lowest)


@pytest.mark.slow
def test_same_seed_gives_the_same_samples(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=10), progress=False)
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    prompt = torch.tensor([tokenizer.encode("the ")])

    def sample(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        tokens = generate(model, prompt, SamplingConfig(max_new_tokens=30), generator=generator)
        return [int(t) for t in tokens]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_generation_crops_long_prompts_to_the_window(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=2), progress=False)
    lm = load(tmp_path / "run")
    model, tokenizer = lm.model, lm.tokenizer
    long_prompt = torch.tensor([tokenizer.encode("the cat sat on the mat. " * 3)])  # 72 > block_size 16
    greedy = [int(t) for t in generate(model, long_prompt, SamplingConfig(temperature=0, max_new_tokens=3))]
    expected = model(long_prompt[:, -16:])[0][0, -1].argmax().item()
    assert greedy[0] == expected


def test_learning_rate_schedule() -> None:
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert learning_rate(0, config) == pytest.approx(0.1)
    assert learning_rate(9, config) == pytest.approx(1.0)
    assert learning_rate(60, config) == pytest.approx(0.55)  # half way down the cosine
    assert learning_rate(110, config) == pytest.approx(0.1)


def test_configs_layer_preset_toml_and_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\n[model]\nn_layer = 3\n[train]\nlr = 0.01\nmax_steps = 7\n')
    model, train_config = resolve_configs(None, toml, {"n_embd": 48}, {"max_steps": 9})
    assert (model.n_layer, model.n_embd, model.block_size) == (3, 48, 32)  # toml, override, preset
    assert (train_config.lr, train_config.max_steps) == (0.01, 9)
    toml.write_text("[modle]\nn_layer = 3\n")
    with pytest.raises(ValueError, match="unknown table.*modle"):
        resolve_configs(None, toml)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        resolve_configs("huge")


@pytest.mark.slow
def test_ctrl_c_saves_and_resume_continues(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [sys.executable, "-m", "gptlab", "train", "--data", str(data_dir), "--out", str(run),
            "--preset", "tiny", "--max-steps", "100000", "--eval-interval", "1000", "--no-progress",
            "--device", "cpu"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (run / LAST).exists() and time.time() < deadline:  # the step-0 checkpoint
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted at step" in out and "Traceback" not in err
    step = load_checkpoint(run, prefer=LAST).state["step"]
    assert step > 0
    result = resume(run, stop_at=step + 3, progress=False)
    assert result.step == step + 3


@pytest.mark.slow  # starts a Python process
def test_train_command_reports_bad_data_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gptlab", "train", "--data", str(tmp_path / "missing.txt"),
                             "--out", str(tmp_path / "run"), "--no-progress"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "missing.txt" in result.stderr
    assert not (tmp_path / "run" / "data").exists()


def test_eval_scores_every_token_once(data_dir: Path, tmp_path: Path) -> None:
    from gptlab.data.tokens import TokenData
    from gptlab.evaluation.heldout import evaluate_tokens

    train(tmp_path / "run", data_dir, MODEL, TRAIN.replace(max_steps=5), progress=False)
    model = load(tmp_path / "run").model
    tokens = TokenData(data_dir).val[:161]  # 10 windows of 16 and one spare token
    result = evaluate_tokens(model, tokens, batch_size=3)
    x = torch.from_numpy(tokens.astype("int64"))
    _, loss = model(x[:160].view(10, 16), x[1:161].view(10, 16))
    assert result.tokens == 160
    assert_close(torch.tensor(result.loss), loss)


@pytest.mark.slow
def test_fine_tuning_starts_from_the_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    from gptlab.cli import main

    train(tmp_path / "base", data_dir, MODEL, TRAIN.replace(max_steps=10), progress=False)
    text = tmp_path / "new.txt"
    text.write_text("my bird sat on the rug. the cat sat on the step.\n" * 80)
    tuned_dir = str(tmp_path / "tuned")
    args = ["train", "--init-from", str(tmp_path / "base"), "--data", str(text), "--out", tuned_dir,
            "--max-steps", "3", "--eval-interval", "3", "--batch-size", "4", "--no-progress",
            "--samples", "0", "--device", "cpu"]
    assert main([*args, "--stop-at", "0"]) == 0  # only the step-0 evaluation and checkpoint
    base = load_checkpoint(tmp_path / "base", prefer=LAST)
    start = load_checkpoint(tmp_path / "tuned", prefer=LAST)
    assert start.model_config == base.model_config and start.tokenizer == base.tokenizer
    for name, tensor in base.model_state.items():
        assert torch.equal(start.model_state[name], tensor), name
    assert main([*args, "--resume"]) == 0  # the same command again continues it
    tuned = load_checkpoint(tmp_path / "tuned", prefer=LAST)
    assert tuned.state["step"] == 3
    embedding = "transformer.wte.weight"
    assert not torch.equal(tuned.model_state[embedding], base.model_state[embedding])

    other = tmp_path / "other.txt"
    other.write_text("xyz " * 500)
    prepare(str(other), tmp_path / "other", progress=False)
    with pytest.raises(ValueError, match="prepared with another tokenizer"):
        train(tmp_path / "wrong", tmp_path / "other", MODEL, TRAIN, init_from=tmp_path / "base",
              progress=False)


@pytest.mark.slow  # trains 4 steps in 3 commands
def test_the_same_command_with_resume_continues_and_a_different_value_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`make demo`'s command line (a preset, a text, a folder), shrunk by options, given again with
    --resume: every value it gives equals the run's, so the run continues; a value that differs is refused,
    named with the run's value and the new one."""
    from gptlab.cli import main

    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. a dog sat on the rug.\n" * 60, encoding="utf-8")
    run = tmp_path / "run"
    command = ["train", "--preset", "demo", "--data", str(text), "--out", str(run), "--n-layer", "1",
               "--n-embd", "32", "--block-size", "16", "--batch-size", "8", "--lr", "6e-3",
               "--max-steps", "4", "--eval-interval", "2", "--eval-batches", "1", "--no-progress",
               "--samples", "0"]
    assert main([*command, "--stop-at", "2"]) == 0
    assert load_checkpoint(run, prefer=LAST).state["step"] == 2
    before = (run / LAST).read_bytes()
    for different, named in ((["--lr", "0.1"], "--lr (lr 0.006 -> 0.1)"),
                             (["--n-head", "2"], "--n-head (n_head 4 -> 2)"),
                             (["--preset", "tiny"], "--preset tiny (n_head 4 -> 2, min_lr 0.0006 -> 0.0003"),
                             (["--data", str(tmp_path / "other.txt")], "--data (text ")):
        capsys.readouterr()
        assert main([*command, "--resume", *different]) == 2, different
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err and "would change it" in err, err
        assert (run / LAST).read_bytes() == before
    assert main([*command, "--lr", "0.1"]) == 2  # without --resume, a changed value is refused as well
    assert "--lr (lr 0.006 -> 0.1)" in capsys.readouterr().err and (run / LAST).read_bytes() == before
    assert main(command) == 0  # the same command again, without --resume, continues the run
    assert "already holds a run: continuing it" in capsys.readouterr().out
    assert load_checkpoint(run, prefer=LAST).state["step"] == 4
    finished = (run / LAST).read_bytes()
    assert main([*command, "--resume"]) == 0 and (run / LAST).read_bytes() == finished  # done: nothing moves
    # the library compares values too: the run's own learning rate is no change
    assert resume(run, progress=False, changes={"lr": 0.006, "max_steps": 5}).step == 5


@pytest.mark.slow
def test_a_run_resumed_from_its_step_0_checkpoint_logs_step_0_once(data_dir: Path, tmp_path: Path) -> None:
    config = TRAIN.replace(max_steps=4, eval_interval=2)
    train(tmp_path / "run", data_dir, MODEL, config, stop_at=0, progress=False)
    resume(tmp_path / "run", progress=False)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["0", "2", "4"]
