"""Multi-process training with torchrun on CPU (gloo): the same run as one process, split across two."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from conftest import assert_identical_runs
from gptlab.checkpoint import LAST, load_checkpoint
from gptlab.data.prepare import prepare
from gptlab.training.resume import resume

pytestmark = pytest.mark.slow  # each test starts two Python processes that import torch

SETTINGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
            "--max-steps", "20", "--eval-interval", "5", "--eval-batches", "2", "--lr", "3e-3",
            "--warmup-steps", "2", "--device", "cpu", "--precision", "float32", "--samples", "0",
            "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    text = "".join("the cat sat on the mat. " if i % 3 else "a dog ran in the park! " for i in range(3000))
    (root / "text.txt").write_text(text)
    prepare(str(root / "text.txt"), root / "data", progress=False)
    return root / "data"


def gptlab(*args: str, nproc: int = 1, env: dict[str, str] | None = None,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `gptlab ARGS` in one process, or in `nproc` processes under torchrun."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = [*(launcher if nproc > 1 else [sys.executable]), "-m", "gptlab", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def curve(run: Path) -> torch.Tensor:
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    return torch.tensor([[float(r["step"]), float(r["train_loss"]), float(r["val_loss"])] for r in rows])


def assert_same_run(a: Path, b: Path, tolerance: float = 1e-5) -> None:
    assert_close(curve(a), curve(b), atol=tolerance, rtol=tolerance)
    weights_a = load_checkpoint(a, prefer=LAST).model_state
    weights_b = load_checkpoint(b, prefer=LAST).model_state
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert_close(weights_a[name], weights_b[name], atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one_with_the_whole_batch(data_dir: Path, tmp_path: Path, parallel: str) -> None:
    # grad-accum 2 also exercises skipping the all-reduce on the first micro-step
    common = [*SETTINGS, "--data", str(data_dir), "--grad-accum", "2"]
    gptlab("train", *common, "--out", str(tmp_path / "one"))
    two = gptlab("train", *common, "--out", str(tmp_path / "two"), "--parallel", parallel, nproc=2)
    assert "2 process(es)" in two.stdout and two.stdout.count("finished at step 20") == 1  # rank 0 speaks
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_muon_in_two_processes_equals_one(data_dir: Path, tmp_path: Path) -> None:
    common = [*SETTINGS, "--data", str(data_dir), "--optimizer", "muon", "--muon-lr", "0.02", "--max-steps",
              "2", "--eval-interval", "1"]
    gptlab("train", *common, "--out", str(tmp_path / "one"))
    gptlab("train", *common, "--out", str(tmp_path / "two"), nproc=2)
    # Muon orthogonalises in bfloat16 (torch's implementation), where the all-reduce's other summation
    # order (1e-7 in a gradient) can round differently: a step may differ by about lr x 2^-8 = 1e-4.
    # Gradients left unaveraged would differ by about lr = 2e-2, so 1e-3 after two steps still bites.
    assert_same_run(tmp_path / "one", tmp_path / "two", tolerance=1e-3)


def test_a_two_process_checkpoint_resumes_in_one_process(data_dir: Path, tmp_path: Path) -> None:
    common = [*SETTINGS, "--data", str(data_dir)]
    gptlab("train", *common, "--out", str(tmp_path / "one"))
    gptlab("train", *common, "--out", str(tmp_path / "split"), "--stop-at", "10", nproc=2)
    assert load_checkpoint(tmp_path / "split", prefer=LAST).state["step"] == 10
    result = resume(tmp_path / "split", progress=False)
    assert result.step == 20
    # Two processes sum the gradients in another order; on an AVX2 CPU 20 steps drift past 1e-5.
    assert_same_run(tmp_path / "one", tmp_path / "split", tolerance=1e-4)


def test_an_fsdp_run_saves_shards_that_resume_on_one_and_on_four_processes(data_dir: Path,
                                                                            tmp_path: Path) -> None:
    common = [*SETTINGS, "--data", str(data_dir)]
    gptlab("train", *common, "--out", str(tmp_path / "one"))
    gptlab("train", *common, "--out", str(tmp_path / "two"), "--parallel", "fsdp", "--stop-at", "10", nproc=2)
    two = tmp_path / "two"
    folder = two / json.loads((two / "last.shards.json").read_text())["folder"]
    assert not (two / LAST).exists()  # nothing was gathered to one process to be saved
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    shutil.copytree(two, tmp_path / "on-one")
    gptlab("train", "--resume", "--out", str(two), "--no-progress", "--samples", "0", nproc=4)
    folder = two / json.loads((two / "last.shards.json").read_text())["folder"]
    assert len(list(folder.glob("*.distcp"))) == 4  # four ranks, each its shards
    assert_same_run(tmp_path / "one", two)
    assert resume(tmp_path / "on-one", progress=False).step == 20  # one process: whole tensors, a file
    assert (tmp_path / "on-one" / LAST).is_file() and not (tmp_path / "on-one" / "shards").exists()
    assert_same_run(tmp_path / "one", tmp_path / "on-one")


def test_a_two_process_run_with_dropout_resumes_bit_for_bit(data_dir: Path, tmp_path: Path) -> None:
    # Every rank draws its own dropout masks. Stopped between evaluations and resumed on the same two
    # processes (the same slices, the same all-reduce order), the run must draw the masks an unbroken
    # one draws on each rank and end with the same bits.
    common = [*SETTINGS, "--data", str(data_dir), "--dropout", "0.1", "--max-steps", "8",
              "--eval-interval", "4"]
    gptlab("train", *common, "--out", str(tmp_path / "whole"), nproc=2)
    gptlab("train", *common, "--out", str(tmp_path / "split"), "--stop-at", "3", nproc=2)
    gptlab("train", "--resume", "--out", str(tmp_path / "split"), "--no-progress", "--samples", "0", nproc=2)
    assert_identical_runs(tmp_path / "whole", tmp_path / "split")


def test_batch_not_divisible_by_the_processes(data_dir: Path, tmp_path: Path) -> None:
    result = gptlab("train", *SETTINGS, "--data", str(data_dir), "--out", str(tmp_path / "run"),
                    "--batch-size", "7", nproc=2, check=False)
    assert result.returncode != 0
    assert "gptlab: error: batch_size=7 is not divisible by the 2 processes: choose a multiple of 2" in (
        result.stderr)
    frames = [line for line in result.stderr.splitlines() if line.strip().startswith("File ")]
    assert not any("gptlab" in frame for frame in frames)  # torchrun reports; gptlab shows no traceback


def test_missing_rendezvous_is_one_line(data_dir: Path, tmp_path: Path) -> None:
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    result = gptlab("train", *SETTINGS, "--data", str(data_dir), "--out", str(tmp_path / "run"),
                    env=env, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gptlab: error: WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT is not: start the run with "
        "torchrun (e.g. torchrun --nproc_per_node=2 -m gptlab train ...)"
    ]


def test_a_dying_rank_stops_the_run(data_dir: Path, tmp_path: Path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [*SETTINGS, "--data", str(data_dir), "--out", str(tmp_path / "run"), "--max-steps", "1000000",
            "--eval-interval", "100000"]
    proc = subprocess.Popen([*launcher, "-m", "gptlab", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (tmp_path / "run" / LAST).exists() and time.time() < deadline:  # both ranks are training
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[1]), signal.SIGKILL)
    started = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - started < 60  # torchrun tears the survivor down; nothing hangs
    assert "exitcode  : -9" in err or "Signal 9" in err


def test_a_seq2seq_run_in_two_processes_equals_one(tmp_path: Path) -> None:
    common = ["seq2seq", "train", "--task", "reverse", "--max-len", "5", "--n-embd", "32", "--n-head", "2",
              "--batch-size", "8", "--max-steps", "12", "--eval-interval", "6", "--eval-batches", "2",
              "--eval-examples", "20", "--device", "cpu", "--no-progress"]
    gptlab(*common, "--out", str(tmp_path / "one"))
    two = gptlab(*common, "--out", str(tmp_path / "two"), nproc=2)
    assert "2 process(es)" in two.stdout and two.stdout.count("finished at step 12") == 1
    assert_same_run(tmp_path / "one", tmp_path / "two")
