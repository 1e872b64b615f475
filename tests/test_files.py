"""Crash-safe files (gptlab.files): what a write killed mid-way leaves behind is cleaned up by the next
command that owns the folder, and nothing else is touched."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gptlab.checkpoint import LAST, Checkpoint, model_tensors, save_checkpoint
from gptlab.cli import main
from gptlab.config import ModelConfig
from gptlab.files import process_alive, remove_abandoned_temporaries, remove_stale_temporaries
from gptlab.model import GPT
from gptlab.text.tokenizer import ByteTokenizer


def dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_folder_loses_every_kind_of_killed_write_and_keeps_the_rest(tmp_path: Path) -> None:
    left = [".tmpAb12Cd", ".best.safetensors.tmp-4242", ".data.tmp-7"]  # safetensors', ours, prepare's
    kept = [".tmpfile", ".tmpAb12Cd.bak", "notes.txt", ".lock"]
    for name in left + kept:
        (tmp_path / name).write_text("x")
    assert sorted(p.name for p in remove_stale_temporaries(tmp_path)) == sorted(left)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_consolidate_cleans_what_a_killed_save_left(tiny_config: Callable[..., ModelConfig], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = GPT(tiny_config(vocab_size=256))
    checkpoint = Checkpoint(model.config, ByteTokenizer().to_dict(), model_tensors(model))
    save_checkpoint(tmp_path / LAST, checkpoint)
    (tmp_path / ".tmpQ1w2E3").write_bytes(b"\0" * 4096)  # safetensors' temporary file, orphaned by kill -9
    assert main(["consolidate", str(tmp_path)]) == 0
    assert "single-file checkpoints already" in capsys.readouterr().out
    assert not (tmp_path / ".tmpQ1w2E3").exists() and (tmp_path / LAST).is_file()


def test_an_export_removes_only_the_temporaries_of_processes_that_are_gone(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    gone, running = dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not process_alive(gone) and process_alive(running.pid)
        for pid in (gone, running.pid):
            (tmp_path / f".m.gguf.tmp-{pid}").write_text("half")
        (tmp_path / ".other.gguf.tmp-1").write_text("another file's")
        assert remove_abandoned_temporaries(out) == [tmp_path / f".m.gguf.tmp-{gone}"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".m.gguf.tmp-{running.pid}",
                                                                     ".other.gguf.tmp-1"])
    finally:
        running.kill()
        running.wait()
