"""Faults a careful user or an attacker can cause, and what each must cost: nothing lost, one line.

Concurrent writers on one run folder, a folder that is not a run, options a resume would ignore, a
run or its data moved, kill -9 between evaluations, a full disk (a small file-size limit), damaged
checkpoints, values that must be refused, and the exit status of each signal. Each test reproduces
the fault and checks the clean outcome: the one-line error, and the files as they were.
"""

from __future__ import annotations

import errno
import json
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import assert_identical_runs
from gptlab.checkpoint import BEST, LAST, load_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.prepare import prepare
from gptlab.files import RunLock, atomic_write_text
from gptlab.inference.loading import load
from gptlab.training.loop import StepResult, Trainer, train
from gptlab.training.optim import learning_rate
from gptlab.training.resume import resume

MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
TRAIN = TrainConfig(batch_size=4, max_steps=6, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_interval=3,
                    eval_batches=1, device="cpu", precision="float32", save_every=0)
TEXT = "\n".join(f"{who} sat on the {what}." for who in ("the cat", "a dog") for what in ("mat", "rug")) * 80


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data_dir(text_file: Path) -> Path:
    prepare(str(text_file), text_file.parent / "data", tokenizer="char", progress=False)
    return text_file.parent / "data"


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *parts: str) -> str:
    """Run the command in-process; it must exit 2 with one `gptlab: error:` line holding every part."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, err
    return err


def gptlab_process(*args: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gptlab", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def wait_for(condition: Callable[[], bool], seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def long_run(data_dir: Path, run: Path, *extra: str) -> subprocess.Popen:
    """`gptlab train` on the tiny preset for far more steps than a test waits for; it evaluates (and so
    saves `last`) at step 0 and then not again for as long as a test waits."""
    return gptlab_process("train", "--data", str(data_dir), "--out", str(run), "--preset", "tiny",
                          "--max-steps", "100000", "--eval-interval", "50000", "--no-progress",
                          "--device", "cpu", "--samples", "0", *extra)


# ---------------------------------------------------------------------------------------------
# 1. One writer per run folder


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_folder_and_the_holder(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, progress=False)
    before = (run / LAST).read_bytes(), (run / "metrics.csv").read_text()
    with RunLock(run):  # another process's run, as far as the folder can tell
        for attempt in (lambda: train(run, data_dir, MODEL, TRAIN, progress=False),
                        lambda: resume(run, progress=False, changes={"max_steps": 12})):
            with pytest.raises(ValueError, match=rf"{run} is in use by another gptlab process \(pid \d+\)"):
                attempt()
    assert ((run / LAST).read_bytes(), (run / "metrics.csv").read_text()) == before


@pytest.mark.slow
def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from gptlab.files import RunLock
        with RunLock(Path({str(run)!r})):
            print("locked", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    with pytest.raises(ValueError, match=f"pid {holder.pid}"), RunLock(run):
        pass
    holder.kill()  # SIGKILL: the operating system releases the lock
    holder.wait()
    with RunLock(run):
        assert (run / ".lock").read_text().strip() == str(__import__("os").getpid())


@pytest.mark.slow  # two real training processes
def test_two_trainings_on_one_folder_cannot_both_run(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = long_run(data_dir, run)
    try:
        wait_for(lambda: (run / LAST).exists())
        second = subprocess.run([sys.executable, "-m", "gptlab", "train", "--resume", "--out", str(run)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr.count("\n") == 1 and f"pid {first.pid}" in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    assert first.returncode == 130


# ---------------------------------------------------------------------------------------------
# 2. A folder that is not a run


def test_a_folder_that_is_not_a_run_is_left_alone(data_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "config.json").write_text('{"theme": "dark"}')
    (mine / "metrics.csv").write_text("my,own,numbers\n")
    one_line_error(capsys, ["train", "--data", str(data_dir), "--out", str(mine), "--preset", "tiny",
                            "--no-progress"], f"{mine} is not empty and is not a gptlab run folder")
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "metrics.csv"]  # no lock left either
    assert (mine / "config.json").read_text() == '{"theme": "dark"}'
    assert (mine / "metrics.csv").read_text() == "my,own,numbers\n"


def test_a_new_run_that_fails_early_leaves_no_folder(text_file: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    one_line_error(capsys, ["train", "--data", str(text_file), "--out", str(tmp_path / "run"),
                            "--block-size", "100000", "--no-progress"], "block_size")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# 3. --resume refuses what it would ignore, and extends a finished run


@pytest.mark.parametrize("extra, named", [
    (["--n-embd", "64"], "--n-embd"),
    (["--lr", "0.1"], "--lr"),
    (["--preset", "tiny"], "--preset"),
    (["--tokenizer", "byte"], "--tokenizer"),
    (["--data", "shakespeare"], "--data"),
])
@pytest.mark.slow
def test_resume_refuses_options_that_would_change_the_run(data_dir: Path, tmp_path: Path, extra: list[str],
                                                          named: str, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    before = (run / LAST).read_bytes()
    one_line_error(capsys, ["train", "--resume", "--out", str(run), *extra], named, "would change it")
    assert (run / LAST).read_bytes() == before


@pytest.mark.slow
def test_resume_with_more_steps_extends_a_finished_run_exactly(data_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "short", data_dir, MODEL, TRAIN, progress=False)
    result = resume(tmp_path / "short", progress=False, changes={"max_steps": 10})
    assert result.step == 10
    # the same as one run of 10 steps whose cosine ended at step 6: the schedule was kept, then min_lr
    train(tmp_path / "long", data_dir, MODEL, TRAIN.replace(max_steps=10, decay_steps=6), progress=False)
    assert_identical_runs(tmp_path / "short", tmp_path / "long")
    config = load_checkpoint(tmp_path / "short", prefer=LAST).train_config
    assert (config.max_steps, config.decay_steps) == (10, 6)
    assert [learning_rate(s, config) for s in (6, 9)] == [TRAIN.min_lr] * 2
    assert json.loads((tmp_path / "short" / "config.json").read_text())["train"]["max_steps"] == 10
    with pytest.raises(ValueError, match="the run is at step 10: TrainConfig.max_steps must be larger"):
        resume(tmp_path / "short", progress=False, changes={"max_steps": 8})


# ---------------------------------------------------------------------------------------------
# 4. A moved run, and a run whose data moved


@pytest.mark.slow
def test_a_renamed_run_with_its_own_data_resumes_and_evaluates(text_file: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    train(tmp_path / "run", text_file, MODEL, TRAIN, stop_at=3, progress=False)  # data in RUN/data
    assert load_checkpoint(tmp_path / "run", prefer=LAST).state["data_dir"] == "data"
    (tmp_path / "run").rename(tmp_path / "renamed")
    assert resume(tmp_path / "renamed", progress=False).step == TRAIN.max_steps
    assert main(["eval", str(tmp_path / "renamed")]) == 0
    assert "val split: loss" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_whose_data_moved_says_so_and_takes_the_new_place(data_dir: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    train(tmp_path / "run", data, MODEL, TRAIN, stop_at=3, progress=False)
    data.rename(tmp_path / "moved")
    one_line_error(capsys, ["train", "--resume", "--out", str(tmp_path / "run")], "which is not there",
                   "--data FOLDER")
    one_line_error(capsys, ["eval", str(tmp_path / "run")], "which is not there")
    assert main(["eval", str(tmp_path / "run"), "--data", str(tmp_path / "moved")]) == 0
    assert "val split: loss" in capsys.readouterr().out
    assert main(["train", "--resume", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "moved"),
                 "--no-progress", "--samples", "0"]) == 0
    assert load_checkpoint(tmp_path / "run", prefer=LAST).state["data_dir"] == str(tmp_path / "moved")


# ---------------------------------------------------------------------------------------------
# 5. Saving by time, so kill -9 loses at most a minute; no temporary files left behind


class Killed(BaseException):
    """kill -9 as the run folder sees it: the loop stops between two steps and saves nothing on the way
    out (gptlab saves on the way out only for KeyboardInterrupt, SIGINT and SIGTERM)."""


@pytest.mark.slow
def test_a_crash_between_evaluations_resumes_exactly_from_the_time_based_save(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = MODEL.replace(dropout=0.1)  # so the saved random state matters
    often = TRAIN.replace(max_steps=8, eval_interval=7, save_every=1e-9)  # evaluations at 0, 7 and 8
    step = Trainer.train_step

    def crash_before_step_7(trainer: Trainer, *args: bool) -> StepResult:
        if trainer.step == 6:
            raise Killed
        return step(trainer, *args)

    monkeypatch.setattr(Trainer, "train_step", crash_before_step_7)
    with pytest.raises(Killed):
        train(tmp_path / "split", data_dir, model, often, progress=False)
    monkeypatch.undo()
    # Only a time-based save can have written step 6: the one evaluation so far was at step 0.
    assert load_checkpoint(tmp_path / "split", prefer=LAST).state["step"] == 6
    rows = (tmp_path / "split" / "metrics.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["0"]
    assert resume(tmp_path / "split", progress=False).step == 8
    train(tmp_path / "whole", data_dir, model, often.replace(save_every=0), progress=False)
    assert_identical_runs(tmp_path / "split", tmp_path / "whole")


@pytest.mark.slow  # a real training process, killed
def test_kill_9_between_evaluations_loses_at_most_save_every(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = long_run(data_dir, run, "--save-every", "0.5")
    saved: set[int] = set()

    def saved_twice_by_time() -> bool:  # the only evaluation is at step 0; later saves are time-based
        if (run / LAST).exists():
            saved.add(load_checkpoint(run, prefer=LAST).state["step"])
        return len(saved - {0}) >= 2

    try:
        wait_for(saved_twice_by_time)
    finally:
        trainer.kill()  # SIGKILL at once: mid-step, or mid-save
        trainer.communicate()
    assert load_checkpoint(run, prefer=LAST).state["step"] >= max(saved)  # whole, and no older than seen


@pytest.mark.slow
def test_temporary_files_of_a_killed_save_are_removed(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    (run / f".{LAST}.tmp-99999").write_bytes(b"half a checkpoint" * 1000)  # what kill -9 mid-save leaves
    resume(run, progress=False)
    assert list(run.glob(".*.tmp-*")) == []


# ---------------------------------------------------------------------------------------------
# 7. Damaged checkpoints and a full disk: one line each, and the earlier files survive


def rewrite(path: Path, change_tensors: Callable[[dict], None] = lambda t: None,
            change_header: Callable[[dict], None] = lambda h: None) -> None:
    with safe_open(str(path), framework="pt") as reader:
        header, tensors = dict(reader.metadata()), {k: reader.get_tensor(k) for k in reader.keys()}
    change_tensors(tensors)
    change_header(header)
    save_file(tensors, str(path), metadata=header)


def narrower_embedding(tensors: dict) -> None:
    tensors["model.transformer.wte.weight"] = tensors["model.transformer.wte.weight"][:, :8].contiguous()


def deeper_model(header: dict) -> None:
    header["model_config"] = json.dumps({**json.loads(header["model_config"]), "n_layer": 3})


def not_a_config(header: dict) -> None:
    header["model_config"] = "{broken"


@pytest.mark.parametrize("damage, message", [
    (dict(change_tensors=narrower_embedding), "is damaged: its weights do not fit the model config"),
    (dict(change_header=deeper_model), "is damaged: its weights do not fit the model config"),
    (dict(change_header=not_a_config), "has a damaged header"),
])
def test_a_damaged_checkpoint_is_one_line(data_dir: Path, tmp_path: Path, damage: dict, message: str,
                                          capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    rewrite(run / BEST, **damage)
    with pytest.raises(ValueError, match=message):
        load(run)
    one_line_error(capsys, ["sample", str(run), "--max-new-tokens", "3"], str(run / BEST), message)


@pytest.mark.slow
def test_a_truncated_last_checkpoint_says_how_to_resume_from_the_intact_best(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    best_step = load_checkpoint(run, prefer=BEST).state["step"]
    data = (run / LAST).read_bytes()
    (run / LAST).write_bytes(data[: len(data) // 2])
    one_line_error(capsys, ["train", "--resume", "--out", str(run)], "last.safetensors is not a readable",
                   f"best.safetensors (step {best_step}) is intact: copy it over")
    (run / LAST).write_bytes((run / BEST).read_bytes())  # as the line says
    assert resume(run, progress=False).step == TRAIN.max_steps


@pytest.mark.slow
def test_a_float16_checkpoint_cannot_be_resumed(data_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, stop_at=3, progress=False)

    def half(tensors: dict) -> None:
        tensors.update({k: t.half() for k, t in tensors.items() if k.startswith("model.")})

    rewrite(run / LAST, change_tensors=half)
    one_line_error(capsys, ["train", "--resume", "--out", str(run)], "float16", "--init-from")


@pytest.mark.slow  # a training process under a file-size limit
def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    size = (run / LAST).stat().st_size
    limit = textwrap.dedent(f"""
        import resource, sys
        from gptlab.cli import main
        resource.setrlimit(resource.RLIMIT_FSIZE, ({size // 2}, {resource.RLIM_INFINITY}))
        sys.exit(main(["train", "--resume", "--out", {str(run)!r}, "--no-progress", "--samples", "0"]))
    """)
    full = subprocess.run([sys.executable, "-c", limit], capture_output=True, text=True, timeout=120)
    assert full.returncode == 2, full.stderr
    assert full.stderr.count("\n") == 1 and "could not write" in full.stderr and "untouched" in full.stderr
    assert load_checkpoint(run, prefer=LAST).state["step"] == 3  # the previous checkpoint, intact
    assert list(run.glob(".*.tmp-*")) == []
    assert resume(run, progress=False).step == TRAIN.max_steps  # and the run goes on once there is space


# ---------------------------------------------------------------------------------------------
# 8. Values that must be refused, and the exit status of each signal


@pytest.mark.parametrize("argv, message", [
    (["train", "--lr", "nan"], "argument --lr: nan is not a finite number"),
    (["train", "--lr", "inf"], "argument --lr: inf is not a finite number"),
    (["train", "--min-lr", "nan"], "argument --min-lr: nan is not a finite number"),
    (["train", "--dropout", "nan"], "argument --dropout: nan is not a finite number"),
])
def test_non_finite_numbers_are_refused_before_anything_is_written(
        argv: list[str], message: str, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    one_line_error(capsys, [*argv, "--data", str(data_dir), "--out", str(tmp_path / "run")], message)
    assert not (tmp_path / "run").exists()


def test_eval_refuses_a_token_budget_below_one(data_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    for budget in ("0", "-5"):
        one_line_error(capsys, ["eval", str(tmp_path / "run"), "--max-tokens", budget],
                       f"argument --max-tokens: {budget} is not an integer of at least 1")


def test_ablate_refuses_an_output_that_is_not_png(data_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    train(tmp_path / "run", data_dir, MODEL, TRAIN, stop_at=3, progress=False)
    one_line_error(capsys, ["ablate", str(tmp_path / "run"), "--prompt", "the cat", "--out",
                            str(tmp_path / "x.jpg")], "must end in .png")
    assert not (tmp_path / "x.jpg").exists()


@pytest.mark.slow  # a real training process
def test_sigterm_saves_and_exits_143(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = long_run(data_dir, run)
    wait_for(lambda: (run / LAST).exists())
    time.sleep(0.5)
    trainer.send_signal(signal.SIGTERM)
    out, err = trainer.communicate(timeout=60)
    assert trainer.returncode == 143, err
    assert "interrupted at step" in out and "Traceback" not in err
    assert load_checkpoint(run, prefer=LAST).state["step"] > 0


@pytest.mark.slow  # a real process
def test_sigterm_outside_training_exits_143_and_leaves_nothing(text_file: Path, tmp_path: Path) -> None:
    # `prepare` is held at its riskiest moment, its hidden staging folder half written, so the signal
    # lands there on any machine however fast (a timed signal could arrive after the work was done).
    script = textwrap.dedent(f"""
        import sys, time
        import gptlab.data.prepare
        from gptlab.cli import main

        def hold(path):
            print("staging", flush=True)
            time.sleep(600)

        gptlab.data.prepare.fsync = hold
        sys.exit(main(["prepare", {str(text_file)!r}, "--out", {str(tmp_path / "data")!r}]))
    """)
    preparing = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    assert preparing.stdout is not None and preparing.stdout.readline() == "staging\n"
    assert [p.name for p in tmp_path.glob(".data.tmp-*")] != []  # the signal comes mid-write
    preparing.send_signal(signal.SIGTERM)
    _, err = preparing.communicate(timeout=60)
    assert preparing.returncode == 143, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_write_past_the_file_size_limit_raises_and_keeps_the_old_file(tmp_path: Path) -> None:
    # The premise of the full-disk test above, in this process: Python ignores SIGXFSZ, so a write past
    # RLIMIT_FSIZE raises OSError (EFBIG) instead of killing, and atomic_write removes its temporary file.
    path = tmp_path / "notes.txt"
    atomic_write_text(path, "the old text\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError) as raised:
            atomic_write_text(path, "x" * 8192)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG
    assert path.read_text() == "the old text\n"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
