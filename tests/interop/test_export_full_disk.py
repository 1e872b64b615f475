"""`gptlab export-hf` onto a full disk (the writer made to raise ENOSPC, which names no file): one line that
names the file it was writing, in the folder asked for (not its temporary copy), and nothing left behind."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from test_huggingface import siblings, small_run  # noqa: E402

from gptlab.cli import main  # noqa: E402
from gptlab.interop import huggingface  # noqa: E402


def full_disk(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    """`real`, a writer whose first argument is the path, except that writing `name` fills the disk."""

    def write(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == name or Path(path).name.startswith(f".{name}.tmp-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    return write


@pytest.mark.parametrize(("writer", "name"), [("atomic_write_text", "config.json"),
                                              ("atomic_write_text", "tokenizer.json"),
                                              ("save_file", "model.safetensors")])
def test_a_full_disk_names_the_file_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], writer: str,
                                                  name: str) -> None:
    run, out = small_run(tmp_path), tmp_path / "out"
    real = getattr(huggingface, writer)
    if writer == "save_file":  # save_file(tensors, path, ...): the path comes second
        monkeypatch.setattr(huggingface, writer, lambda tensors, path, **kw: full_disk(
            name, lambda p, **k: real(tensors, p, **k))(path, **kw))
    else:
        monkeypatch.setattr(huggingface, writer, full_disk(name, real))
    assert main(["export-hf", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"could not write {out / name} (No space left on device)" in err, err
    assert not out.exists() and siblings(out) == []
