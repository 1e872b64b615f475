"""The first hour's refusals and errors (issue 42, points 4 and 5): a refusal changes nothing in the
folder or file it refuses, and every error names its file, its port or the name the user meant."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.files import RunLock

SFT_LINE = {"prompt": "the cat sat on the ", "completion": "mat."}
LATIN1 = "the cat sat on the mat.\nthe dog sat on the caf\xe9 rug.\n".encode("latin-1")
ICONV = "iconv -f latin1 -t utf-8"


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *parts: str) -> str:
    """Run the command in-process: exit 2 with one `gptlab: error:` line holding every part, and no
    raw `[Errno N]` text."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptlab: error: ") and err.count("\n") == 1, err
    assert "[Errno" not in err and "codec can't" not in err, err
    for part in parts:
        assert part in err, err
    return err


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (relative path), with a file's bytes (None for a folder)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def sft_file(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text((json.dumps(SFT_LINE) + "\n") * 4, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# 4. Refusals change nothing


def foreign_folder(folder: Path, **_: Any) -> str:
    """A folder of the user's own files, which no run wrote."""
    folder.mkdir()
    (folder / "config.json").write_text('{"theme": "dark"}')
    (folder / "notes").mkdir()
    (folder / "notes" / "todo.txt").write_text("buy milk\n")
    return "is not empty and is not a gptlab run folder"


def foreign_folder_with_a_lock(folder: Path, **_: Any) -> str:
    """The same, with the lock file an earlier (refused) command left there, holding another pid."""
    foreign_folder(folder)
    (folder / RunLock.NAME).write_bytes(b" 4242\n")
    return "is not empty and is not a gptlab run folder"


def imported_model(folder: Path, random_gpt: Callable[..., Any], save_model: Callable[..., Path]) -> str:
    """A model as import-hf writes it: a best checkpoint with no training settings."""
    from gptlab.text.tokenizer import CharTokenizer

    save_model(folder, random_gpt(vocab_size=13), CharTokenizer("abcdefghijkl\n"))
    return "holds a model"


@pytest.mark.parametrize("make", [foreign_folder, foreign_folder_with_a_lock, imported_model])
@pytest.mark.parametrize("command", ["train", "finetune"])
def test_a_refused_out_is_left_byte_for_byte(command: str, make: Callable[..., str], trained_run: Path,
                                            sft_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                            random_gpt: Callable[..., Any],
                                            save_model: Callable[..., Path]) -> None:
    out = tmp_path / "out"
    reason = make(out, random_gpt=random_gpt, save_model=save_model)
    before = snapshot(out)
    argv = (["train", "--data", str(trained_run.parent / "data"), "--preset", "tiny"] if command == "train"
            else ["finetune", str(trained_run), "--data", str(sft_file)])
    one_line_error(capsys, [*argv, "--out", str(out), "--device", "cpu", "--no-progress"], reason,
                   "nothing in it was changed" if make is not imported_model else str(out))
    assert snapshot(out) == before


def test_a_run_folder_is_left_as_found_when_its_lock_is_refused(trained_run: Path, tmp_path: Path) -> None:
    """A second writer is refused by the holder's lock and writes nothing of its own."""
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):
        before = snapshot(run)
        with pytest.raises(ValueError, match="is in use by another gptlab process"), RunLock(run):
            pass
        assert snapshot(run) == before


def test_a_lock_file_a_refusal_removed_is_never_held_by_a_late_opener(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that opened RUN/.lock just before a refusal removed it locks the new file, not the old."""
    run = tmp_path / "run"
    refused = RunLock(run).__enter__()
    late = os.open(run / RunLock.NAME, os.O_RDWR)  # opened while the refused command still held the lock
    refused.restore()
    refused.__exit__(None, None, None)
    assert not (run / RunLock.NAME).exists()
    opens = iter([(False, late)])
    fresh = RunLock._open
    monkeypatch.setattr(RunLock, "_open", lambda self: next(opens, None) or fresh(self))
    with RunLock(run) as lock:
        assert lock.fd is not None and os.fstat(lock.fd).st_ino == os.stat(run / RunLock.NAME).st_ino
        assert (run / RunLock.NAME).read_bytes().strip() == str(os.getpid()).encode()


@pytest.mark.parametrize("command", [
    ["attention", "--prompt", "the cat", "--out", "OUT.png"],
    ["attention", "--prompt", "the cat", "--out", "OUT.html"],
    ["lens", "--prompt", "the cat", "--out", "OUT.html"],
    ["ablate", "--prompt", "the cat", "--out", "OUT.png"],
    ["heads", "--out", "OUT.png"],
])
@pytest.mark.slow
def test_a_picture_out_is_redone_when_gptlab_wrote_it_and_refused_otherwise(
        command: list[str], trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / command[-1]
    argv = [command[0], str(trained_run), *command[1:-1], str(out)]
    assert main(argv) == 0  # a new file
    assert main(argv) == 0  # the same command twice just works: the file is gptlab's own
    written = out.read_bytes()
    out.write_bytes(b"my own picture")
    refusal = f"--out {out} exists and was not written by gptlab: pass --force to replace it"
    one_line_error(capsys, argv, refusal)
    assert out.read_bytes() == b"my own picture"
    assert main([*argv, "--force"]) == 0 and main(argv) == 0
    assert len(out.read_bytes()) > 0 and out.read_bytes()[:8] == written[:8]


# ---------------------------------------------------------------------------------------------
# 5. Errors that name their file, their port, or the name meant


def test_sample_names_a_prompt_file_that_is_not_utf8(trained_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(LATIN1)
    one_line_error(capsys, ["sample", str(trained_run), "--prompt-file", str(prompt)],
                   f"{prompt}:2: not UTF-8 (byte 0xe9 at column 23)", f"{ICONV} prompt.txt")


def test_finetune_names_a_data_file_that_is_not_utf8(trained_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_bytes(json.dumps(SFT_LINE).encode() + b"\n" + json.dumps(
        {"prompt": "caf\xe9 ", "completion": "mat."}, ensure_ascii=False).encode("latin-1") + b"\n")
    one_line_error(capsys, ["finetune", str(trained_run), "--data", str(data), "--out", str(tmp_path / "ft")],
                   f"{data}:2: not UTF-8 (byte 0xe9", f"{ICONV} tasks.jsonl")
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("option", ["sample", "finetune"])
def test_a_missing_file_is_named(option: str, trained_run: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing.txt"
    argv = (["sample", str(trained_run), "--prompt-file", str(missing)] if option == "sample"
            else ["finetune", str(trained_run), "--data", str(missing), "--out", str(tmp_path / "ft")])
    one_line_error(capsys, argv, f"{missing}: no such file" if option == "sample" else
                   f"cannot read {missing}: No such file or directory")


def test_serve_names_a_busy_port(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        one_line_error(capsys, ["serve", str(trained_run), "--port", str(port)],
                       f"port {port} is in use: pick another with --port")


def test_a_misspelt_corpus_name_gets_a_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    one_line_error(capsys, ["train", "--data", "shakespear", "--out", str(tmp_path / "run"), "--no-progress"],
                   "no such file or folder: shakespear", "did you mean shakespeare?")
    assert not (tmp_path / "run").exists()


def test_a_misspelt_task_name_gets_a_suggestion(trained_run: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    from gptlab.evaluation import tasks

    folders = {name: {"rc_0shot": tmp_path / name} for name in ("arc_easy", "piqa", "winogrande")}
    monkeypatch.setattr(tasks, "task_folders", lambda: folders)
    one_line_error(capsys, ["eval", str(trained_run), "--tasks", "winogrand"],
                   "no task 'winogrand'", "did you mean winogrande?")


def test_an_out_that_cannot_be_created_is_named(trained_run: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    one_line_error(capsys, ["train", "--data", str(trained_run.parent / "data"), "--preset", "tiny",
                            "--out", str(blocker / "run"), "--no-progress"],
                   f"cannot create the folder {blocker / 'run'}: Not a directory: choose another --out")
    assert blocker.read_text() == "mine"


def test_an_os_error_is_one_line_naming_its_file() -> None:
    from gptlab.cli import error_line

    missing = FileNotFoundError(2, "No such file or directory", "nodir/a.png")
    assert error_line(missing) == "nodir/a.png: No such file or directory"
    moved = OSError(18, "Invalid cross-device link", "a.bin", None, "/mnt/b.bin")
    assert error_line(moved) == "a.bin -> /mnt/b.bin: Invalid cross-device link"
    assert error_line(OSError("disk on fire")) == "disk on fire"
    assert error_line(ValueError("--lr must be positive")) == "--lr must be positive"
