"""Metric sinks: steps.csv, TensorBoard and W&B hold every step once, across a kill and a resume."""

from __future__ import annotations

import csv
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.testing import assert_close

from conftest import assert_identical_runs
from gptlab.checkpoint import LAST, load_checkpoint
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.prepare import prepare
from gptlab.data.tokens import TokenData
from gptlab.model import GPT
from gptlab.training.logs import plot_losses, smoothed
from gptlab.training.loop import Trainer, train
from gptlab.training.optim import learning_rate
from gptlab.training.resume import resume

MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
TRAIN = TrainConfig(batch_size=4, max_steps=6, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_interval=3,
                    eval_batches=1, device="cpu", precision="float32", save_every=0)
TEXT = "\n".join(f"{who} sat on the {what}." for who in ("the cat", "a dog") for what in ("mat", "rug")) * 50


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(str(root / "text.txt"), root / "data", tokenizer="char", progress=False)
    return root / "data"


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def column(path: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) of one column of a run's CSV log."""
    return [(int(row["step"]), float(row[name])) for row in rows(path)]


def tensorboard(run: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar as TensorBoard's own reader shows it (orphaned steps purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def assert_same_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, and values equal to float32 rounding (TensorBoard keeps scalars as float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert_close(torch.tensor([v for _, v in got], dtype=torch.float64),
                 torch.tensor([v for _, v in expected], dtype=torch.float64), rtol=1e-6, atol=0)


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (run-ID.wandb), read independently of W&B's own code: the file is
    a 7-byte header (":W&B", magic, version), then LevelDB's log format (32 KiB blocks of records with a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST), each record a wandb_internal Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's last bytes too few for a header are padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        pending += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            records.append(Record.FromString(pending))
            pending = b""
    return records


def wandb_history(path: Path) -> list[dict[str, float]]:
    """The rows a W&B run file logged: every history record's values, by name."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
            for record in wandb_records(path) if record.WhichOneof("record_type") == "history"]


class Killed(BaseException):
    """kill -9 as the run folder sees it: the loop stops between two steps and saves nothing."""


@pytest.mark.slow  # three short runs
def test_tensorboard_and_steps_csv_hold_each_step_once_across_a_kill_and_resume(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed two steps after its last checkpoint logs those steps again when resumed: steps.csv and
    TensorBoard show each once, with the values of an uninterrupted run, whose weights the run ends with."""
    model = MODEL.replace(dropout=0.1)  # so the saved random state matters
    logged = TRAIN.replace(log=["tensorboard"])
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(whole, data_dir, model, logged, progress=False)
    step = Trainer.train_step

    def killed_after_step_5(trainer: Trainer, *args: bool) -> object:
        if trainer.step == 5:
            raise Killed
        return step(trainer, *args)

    monkeypatch.setattr(Trainer, "train_step", killed_after_step_5)
    with pytest.raises(Killed):
        train(split, data_dir, model, logged, progress=False)
    monkeypatch.undo()
    assert [s for s, _ in column(split / "steps.csv", "loss")] == [1, 2, 3, 4, 5]
    assert load_checkpoint(split, prefer=LAST).state["step"] == 3
    assert resume(split, progress=False).step == 6
    assert_identical_runs(whole, split)
    expected = column(whole / "steps.csv", "loss")
    assert [s for s, _ in expected] == [1, 2, 3, 4, 5, 6]
    assert column(split / "steps.csv", "loss") == expected  # resume is exact: the same losses
    for run in (whole, split):
        assert_same_series(tensorboard(run, "train/loss"), expected)
        for name in ("lr", "grad_norm"):
            assert_same_series(tensorboard(run, f"train/{name}"), column(run / "steps.csv", name))
        for name in ("train_loss", "val_loss"):
            assert_same_series(tensorboard(run, f"eval/{name}"), column(run / "metrics.csv", name))
        assert [s for s, _ in tensorboard(run, "eval/val_loss")] == [0, 3, 6]


@pytest.mark.slow  # trains a run
def test_steps_csv_has_one_row_per_step_and_torchs_gradient_norm(data_dir: Path, tmp_path: Path) -> None:
    """Step 1's loss and gradient norm, measured by hand on the same first batch, clipped or not."""
    data = TokenData(data_dir)
    config = MODEL.replace(vocab_size=data.tokenizer.vocab_size)
    torch.manual_seed(TRAIN.seed)  # the trainer seeds, then builds the model, then draws batches
    reference = GPT(config)
    batch = data.get_batch("train", TRAIN.batch_size, config.block_size,
                           torch.Generator().manual_seed(TRAIN.seed))
    _, loss = reference(*batch)
    loss.backward()
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    by_hand = torch.cat([g.flatten() for g in grads]).norm()
    assert_close(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0), by_hand)
    for clip in (1.0, 0.0):  # clipping measures the norm; without it, the norm is measured alone
        run = tmp_path / f"clip{clip}"
        train(run, data_dir, MODEL, TRAIN.replace(max_steps=3, grad_clip=clip), progress=False)
        table = rows(run / "steps.csv")
        assert [int(row["step"]) for row in table] == [1, 2, 3]
        assert_close(float(table[0]["grad_norm"]), by_hand.item())
        assert_close(float(table[0]["loss"]), loss.item())
        assert [float(row["lr"]) for row in table] == [learning_rate(s, TRAIN) for s in range(3)]
        assert all(float(row["tokens_per_s"]) > 0 for row in table)
        elapsed = [float(row["elapsed_s"]) for row in table]
        assert 0 < elapsed[0] < elapsed[1] < elapsed[2]
        assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_smoothed_curve_is_centred_and_old_runs_still_plot(tmp_path: Path) -> None:
    # By hand: the mean of up to `radius` values either side, fewer near the ends so the window stays centred.
    assert_close(smoothed([1.0, 2.0, 3.0, 10.0, 5.0], 1), [1.0, 2.0, 5.0, 6.0, 5.0])
    assert_close(smoothed([1.0, 2.0, 3.0, 10.0, 5.0], 5), [1.0, 2.0, 4.2, 6.0, 5.0])
    falling = [10.0 - 0.5 * step for step in range(40)]
    assert_close(smoothed(falling, 7), falling)  # a straight line is its own smoothing: no lag behind it
    metrics = tmp_path / "metrics.csv"  # a run from before steps.csv: the evaluations alone
    metrics.write_text("step,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n0,3.0,3.1,0,0,0\n5,2.0,2.2,0,1,1\n")
    plot_losses(metrics, tmp_path / "loss.png", "old", steps_csv=tmp_path / "steps.csv")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # two W&B runs (each starts W&B's service)
def test_wandb_offline_logs_every_step_and_a_resumed_run_keeps_its_id(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    environment = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "gptlab-test",
                   **{f"WANDB_{name}_DIR": str(tmp_path / name) for name in ("CONFIG", "CACHE", "DATA")}}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"
    train(run, data_dir, MODEL, TRAIN.replace(log=["wandb"]), stop_at=3, progress=False)
    resume(run, progress=False)
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    run_id = (run / "wandb" / "run-id").read_text().strip()
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # the resumed run kept the id
    history = [row for f in files for row in wandb_history(f)]
    losses = [(row["step"], row["train/loss"]) for row in history if "train/loss" in row]
    assert losses == column(run / "steps.csv", "loss")  # JSON keeps every digit
    val = [(row["step"], row["eval/val_loss"]) for row in history if "eval/val_loss" in row]
    assert val == column(run / "metrics.csv", "val_loss")
    first = next(r.run for r in wandb_records(files[0]) if r.WhichOneof("record_type") == "run")
    assert first.project == "gptlab-test" and first.display_name == str(run)
    config = {item.key: json.loads(item.value_json) for item in first.config.update}
    assert config["train"]["max_steps"] == TRAIN.max_steps and config["model"]["n_embd"] == MODEL.n_embd


def command(text: Path, out: Path) -> list[str]:
    return ["train", "--data", str(text), "--out", str(out), "--n-layer", "1", "--n-head", "2", "--n-embd",
            "16", "--block-size", "16", "--batch-size", "4", "--max-steps", "4", "--eval-interval", "2",
            "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu", "--precision", "float32",
            "--no-progress", "--samples", "0"]


def test_an_unknown_or_missing_logger_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from gptlab.cli import main

    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main([*command(text, tmp_path / "run"), "--log", "tensorbored"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tensorbored' is not one of: tensorboard, wandb" in err, err
    for name, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
        monkeypatch.setitem(sys.modules, module, None)  # `import` of it now fails as if not installed
        assert main([*command(text, tmp_path / "run"), "--log", name]) == 2
        err = capsys.readouterr().err
        assert err == f"gptlab: error: --log {name} needs the {name} package: pip install 'gptlab[{name}]'\n"
        assert not (tmp_path / "run").exists()  # a run that never started leaves no folder


def without_log(checkpoint: Path) -> None:
    """Rewrite a checkpoint as gptlab wrote it before TrainConfig had `log`."""
    with safe_open(str(checkpoint), "pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    train_config = json.loads(metadata["train_config"])
    del train_config["log"]
    save_file(tensors, str(checkpoint), metadata={**metadata, "train_config": json.dumps(train_config)})


@pytest.mark.slow  # trains and resumes a run
def test_a_run_from_before_log_existed_resumes_with_log_tensorboard(tmp_path: Path) -> None:
    from gptlab.cli import main

    text, run = tmp_path / "text.txt", tmp_path / "run"
    text.write_text(TEXT, encoding="utf-8")
    assert main([*command(text, run), "--stop-at", "2"]) == 0
    without_log(run / LAST)
    assert load_checkpoint(run, prefer=LAST).train_config.log == ()  # the field's default
    assert main([*command(text, run), "--resume", "--log", "tensorboard"]) == 0
    assert json.loads((run / "config.json").read_text())["train"]["log"] == ["tensorboard"]
    assert [s for s, _ in column(run / "steps.csv", "loss")] == [1, 2, 3, 4]
    assert [s for s, _ in tensorboard(run, "train/loss")] == [3, 4]  # logged from the resume on


def test_log_to_is_the_same_option_as_log_for_torchrun() -> None:
    """torchrun's own parser reads `--log` as an abbreviation of its options; `--log-to` reaches gptlab."""
    from torch.distributed.run import get_args_parser

    from gptlab.cli import build_parser

    for spelling in ("--log", "--log-to"):
        args = build_parser().parse_args(["train", spelling, "tensorboard", "wandb"])
        assert args.log == ["tensorboard", "wandb"]
    launcher = get_args_parser()
    parsed = launcher.parse_args(["-m", "gptlab", "train", "--log-to", "tensorboard"])
    assert parsed.training_script_args[-2:] == ["--log-to", "tensorboard"]
    with pytest.raises(SystemExit):  # the clash this alias avoids
        launcher.parse_args(["-m", "gptlab", "train", "--log", "tensorboard"])
