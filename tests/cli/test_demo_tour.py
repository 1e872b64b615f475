"""`make demo`'s ending (issue 42): the link runs/demo on the latest finished run, its real path and three
next commands that work as printed, and `gptlab serve runs/demo` answering to model "demo"."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptlab.cli import main
from gptlab.training.runs import point_link

ROOT = Path(__file__).resolve().parents[2]
RUN = "runs/demo-20260101-000000"  # as the Makefile names it: runs/demo-$(date +%Y%m%d-%H%M%S)
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nO Romeo, Romeo!\n" * 60
# The Makefile's demo command, shrunk by options to a few tiny steps on a small text.
SHRUNK = ["--n-layer", "1", "--n-embd", "32", "--block-size", "16", "--batch-size", "8", "--max-steps", "3",
          "--eval-interval", "3", "--eval-batches", "1", "--no-progress", "--samples", "0"]


def demo_command() -> list[str]:
    """The arguments of the Makefile's demo line (its --data corpus replaced by a small text), shrunk."""
    makefile = (ROOT / "Makefile").read_text()
    line = next(x for x in makefile.splitlines() if "gptlab train --preset demo" in x and "echo" not in x)
    assert "out=runs/demo-$$(date +%Y%m%d-%H%M%S)" in makefile  # a new run's folder, when none is unfinished
    words = shlex.split(line.replace("$$out", RUN).rstrip("\\ "))
    args = words[words.index("train"):]
    assert args[args.index("--out") + 1] == RUN and args[args.index("--link") + 1] == "runs/demo", line
    args[args.index("--data") + 1] = "text.txt"
    return [*args, *SHRUNK]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A folder where the shrunk demo command ran (as make demo runs it, from that folder), and its output."""
    folder = tmp_path_factory.mktemp("clone")
    before = Path.cwd()
    os.chdir(folder)
    try:
        (folder / "text.txt").write_text(TEXT, encoding="utf-8")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(demo_command()) == 0
        yield folder, printed.getvalue()
    finally:
        os.chdir(before)


def next_commands(output: str) -> list[list[str]]:
    """The commands printed under "next", each split as a shell splits it."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next")) + 1
    return [shlex.split(line) for line in lines[start:] if line.startswith("  ")]


@pytest.mark.slow  # trains a few tiny steps, then samples, evaluates and serves the run
def test_the_demo_ends_with_its_real_path_and_next_commands_that_work_as_printed(
        demo: tuple[Path, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    folder, output = demo
    link = folder / "runs" / "demo"
    assert link.is_symlink() and os.readlink(link) == "demo-20260101-000000"
    assert f"the run: {(folder / RUN).resolve()} (runs/demo points to it)" in output
    commands = next_commands(output)
    assert [c[1:] for c in commands] == [["sample", "runs/demo", "--prompt", "ROMEO:"],
                                         ["eval", "runs/demo"], ["serve", "runs/demo"]]
    program = commands[0][0]
    assert all(c[0] == program for c in commands) and shutil.which(program), program
    monkeypatch.chdir(folder)
    for command in commands[:2]:  # serve runs until Ctrl-C: the next test serves runs/demo
        assert main(command[1:]) == 0, command
        assert "gptlab: error" not in capsys.readouterr().err
    # one command exactly as printed, through the shell, program and all
    shown = next(line.strip() for line in output.splitlines() if line.strip().startswith(program)
                 and " eval " in line)
    done = subprocess.run(shown, shell=True, cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loss" in done.stdout, done.stderr


@pytest.mark.slow
def test_serving_runs_demo_answers_to_model_demo_as_the_docs_snippet_asks(demo: tuple[Path, str]) -> None:
    """docs/serve.md's openai snippet (model="demo") against `gptlab serve runs/demo`: not a 404."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_serve import start_server

    from gptlab.serve.server import app_for_run

    folder, _ = demo
    served = app_for_run(folder / "runs" / "demo", max_batch=2)
    assert served.name == "demo"
    url, server, thread = start_server(served.app)
    try:
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "demo"
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 5, "seed": 1}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["model"] == "demo", reply.text
        dated = {**body, "model": "demo-20260101-000000"}
        other = httpx.post(f"{url}/v1/completions", json=dated, timeout=30)
        assert other.status_code == 404  # one name: the one the server was given
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=5, stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_link_is_replaced_by_the_next_run_and_a_folder_there_is_left_alone(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first, second = runs / "demo-1", runs / "demo-2"
    for run in (first, second):
        run.mkdir(parents=True)
    link = runs / "demo"
    assert point_link(link, first) is None and os.readlink(link) == "demo-1"
    assert point_link(link, second) is None and os.readlink(link) == "demo-2"
    assert sorted(p.name for p in runs.iterdir()) == ["demo", "demo-1", "demo-2"]  # no temporary left
    assert point_link(second, second) is None and not second.is_symlink()  # the run is at that path
    link.unlink()
    link.mkdir()  # the tour's own `--out runs/demo`: a real run folder
    (link / "config.json").write_text("{}")
    assert "is not a link" in (point_link(link, first) or "")
    assert link.is_dir() and not link.is_symlink() and (link / "config.json").exists()


def test_a_run_whose_link_cannot_be_made_prints_commands_on_its_own_folder(
        trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A folder in the link's place is left alone, named in a note, and the commands name the run itself
    (without --prompt "ROMEO:", which this run's characters cannot encode)."""
    from gptlab.cli.train import print_next_commands

    monkeypatch.chdir(tmp_path)
    shutil.copytree(trained_run, tmp_path / "runs" / "demo-2")
    (tmp_path / "runs" / "demo").mkdir()  # a folder in the way
    print_next_commands(Path("runs/demo-2"), Path("runs/demo"))
    out = capsys.readouterr().out
    assert f"the run: {(tmp_path / 'runs' / 'demo-2').resolve()}\nnote: runs/demo is not a link" in out
    assert [c[1:] for c in next_commands(out)] == [["sample", "runs/demo-2"], ["eval", "runs/demo-2"],
                                                   ["serve", "runs/demo-2"]]


def test_the_program_is_printed_as_it_can_be_pasted(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make demo` in a clone without the venv activated prints `.venv/bin/gptlab`; activated, `gptlab`."""
    import sys

    from gptlab.cli.train import gptlab_program

    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "gptlab").exists():
        pytest.skip("gptlab is not installed as a script beside this Python")
    monkeypatch.chdir(bin_dir.parent.parent)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), os.defpath]))
    assert gptlab_program() == "gptlab"
    monkeypatch.setenv("PATH", os.defpath)
    assert gptlab_program() == f"{bin_dir.parent.name}/bin/gptlab"
