"""A missing optional package (an extra of pyproject.toml) ends the command in one line that names the extra
to install, never a traceback: each package is hidden with `sys.modules[name] = None`, which makes `import
name` raise ImportError as if it were not installed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.common import need
from gptlab.text.tokenizer import train_tokenizer


def hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make `import name` fail for each of `names`, and drop gptlab modules that already imported them."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)
    for loaded in ("gptlab.serve.server", "gptlab.serve.app", "gptlab.serve.completion",
                   "gptlab.serve.prometheus"):
        monkeypatch.delitem(sys.modules, loaded, raising=False)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gptlab: error: ") and "Traceback" not in err, err
    return err


def test_need_imports_or_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert need("json", "x", "y") is sys.modules["json"]
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ValueError) as info:
        need("gguf", "gguf", "export-gguf")
    assert str(info.value) == "export-gguf needs the gguf package: pip install 'gptlab[gguf]'"


def test_export_gguf_without_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str],
                                  random_gpt: Callable[..., Any], save_model: Callable[..., Path]) -> None:
    run = save_model(tmp_path / "run", random_gpt(), train_tokenizer("char", "abcdefgh"))
    hide(monkeypatch, "gguf")
    assert main(["export-gguf", str(run), "--out", str(tmp_path / "m.gguf")]) == 2
    assert one_error_line(capsys) == ("gptlab: error: export-gguf needs the gguf package: "
                                      "pip install 'gptlab[gguf]'\n")
    assert not (tmp_path / "m.gguf").exists()


def test_reading_gguf_without_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gptlab.interop.gguf import load_gguf

    hide(monkeypatch, "gguf")
    with pytest.raises(ValueError, match=r"^reading a GGUF file needs the gguf package: "
                                         r"pip install 'gptlab\[gguf\]'$"):
        load_gguf(tmp_path / "m.gguf")


def test_to_transformers_without_transformers(monkeypatch: pytest.MonkeyPatch,
                                              random_gpt: Callable[..., Any]) -> None:
    from gptlab.interop.huggingface import to_transformers

    hide(monkeypatch, "transformers")
    with pytest.raises(ValueError, match=r"^to_transformers needs transformers: pip install 'gptlab\[hf\]'$"):
        to_transformers(random_gpt())


def test_gpt2_tokenizer_without_tiktoken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("hello world\n" * 20, encoding="utf-8")
    hide(monkeypatch, "tiktoken")
    assert main(["prepare", str(text), "--out", str(tmp_path / "data"), "--tokenizer", "gpt2"]) == 2
    err = one_error_line(capsys)
    assert "needs the tiktoken package" in err and "pip install 'gptlab[gpt2]'" in err, err
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_log_destination_without_its_package(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gptlab.training.sinks import MODULES, check_installed

    hide(monkeypatch, MODULES[name])
    with pytest.raises(ValueError, match=rf"needs the {name} package: pip install 'gptlab\[{name}\]'$"):
        check_installed([name])


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "prometheus_client"])
def test_serve_without_the_serve_extra(missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], random_gpt: Callable[..., Any],
                                       save_model: Callable[..., Path]) -> None:
    run = save_model(tmp_path / "run", random_gpt(), train_tokenizer("char", "abcdefgh"))
    hide(monkeypatch, missing)
    assert main(["serve", str(run), "--port", "0"]) == 2
    err = one_error_line(capsys)
    assert f"gptlab serve needs the serve extra ({missing} is missing)" in err and "[serve]'" in err, err


@pytest.mark.parametrize(("missing", "flag", "value"), [("llguidance", "--choice", "ab,ba"),
                                                         ("jsonschema", "--json-schema", None)])
def test_structured_output_without_the_structured_extra(missing: str, flag: str, value: str | None,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        random_gpt: Callable[..., Any],
                                                        save_model: Callable[..., Path]) -> None:
    run = save_model(tmp_path / "run", random_gpt(), train_tokenizer("char", "abcdefgh{}\":"))
    if value is None:
        value = str(tmp_path / "schema.json")
        (tmp_path / "schema.json").write_text('{"type": "object"}', encoding="utf-8")
    hide(monkeypatch, missing)
    assert main(["sample", str(run), flag, value]) == 2
    err = one_error_line(capsys)
    assert f"needs the {missing} package: pip install 'gptlab[structured]'" in err, err
