"""A worker lost under `torchrun --max-restarts`: the restarted workers find the run's last checkpoint and
continue it on their own (the command line is unchanged), ending where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import assert_identical_runs
from gptlab.checkpoint import LAST, load_header

pytestmark = pytest.mark.slow  # torchrun, two workers, started twice, and an uninterrupted run

STEPS = 2000
SETTINGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
            "--max-steps", str(STEPS), "--eval-interval", "1000", "--eval-batches", "2", "--device", "cpu",
            "--precision", "float32", "--samples", "0", "--no-progress", "--save-every", "0.3"]


def torchrun(*args: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", "-m", "gptlab", *args]


def saved_step(run: Path) -> int:
    """The step of the run's `last` checkpoint, -1 while there is none."""
    return load_header(run, prefer=LAST).state["step"] if (run / LAST).exists() else -1


def test_a_killed_worker_is_replaced_and_the_run_ends_as_an_uninterrupted_one(
        char_corpus: Callable[[str], Path], tmp_path: Path) -> None:
    data = char_corpus("the cat sat on the mat. a dog ran in the park!\n" * 400)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    healed = tmp_path / "healed"
    command = torchrun("train", *SETTINGS, "--data", str(data), "--out", str(healed), restarts=1)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while saved_step(healed) < 1 and time.time() < deadline:  # a time-based save after step 0's
        time.sleep(0.1)
    killed_after = saved_step(healed)
    assert 0 < killed_after < STEPS, "the run should be under way when a worker is lost"
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[1]), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "torchrun restarted the workers (restart 1)" in out
    assert out.count(f"finished at step {STEPS}") == 1

    whole = tmp_path / "whole"
    subprocess.run(torchrun("train", *SETTINGS, "--data", str(data), "--out", str(whole)), check=True,
                   capture_output=True, env=env, timeout=300)
    assert_identical_runs(healed, whole)
