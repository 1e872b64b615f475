"""examples/python_api.ipynb, the notebook tour of `gptlab.load` and `LM`, run top to bottom in a real
Jupyter kernel (nbclient, ipykernel: the notebook-tests extra) from an empty working directory, so that
it trains its own tiny run and chat fine-tune; the tagged cells' outputs are then read. The notebook is
executed in memory: the file on disk keeps no outputs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_notebook_check import _kernel, _outputs  # tests/handout: the kernel spec, a cell's outputs

NOTEBOOK = Path(__file__).parents[2] / "examples" / "python_api.ipynb"


@pytest.mark.slow
def test_the_python_api_notebook_runs_and_shows_each_call(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    why = "the notebook test needs nbclient and ipykernel: pip install 'gptlab[notebook-tests]'"
    nbclient = pytest.importorskip("nbclient", reason=why)
    pytest.importorskip("ipykernel", reason=why)
    import nbformat

    saved_bytes = NOTEBOOK.read_bytes()
    book = nbformat.reads(saved_bytes.decode("utf-8"), as_version=4)
    saved = [cell for cell in book.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in saved), "saved with outputs"
    work = tmp_path / "work"  # no runs/demo here: the notebook trains its own tiny runs
    work.mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the kernel's tempfile puts those runs
    client = nbclient.NotebookClient(book, timeout=300, startup_timeout=120,
                                     kernel_name=_kernel(tmp_path / "jupyter", monkeypatch),
                                     resources={"metadata": {"path": str(work)}})
    started = time.monotonic()
    client.execute()
    print(f"examples/python_api.ipynb executed in {time.monotonic() - started:.1f} s")
    cells = {tag: cell for cell in book.cells for tag in cell.metadata.get("tags", [])}
    assert {"setup", "load", "generate", "stream", "chat", "attention", "json"} <= set(cells)
    text = _outputs(cells["setup"])[0]
    assert f"base run: {tmp_path / 'tmp'}" in text  # trained in a temporary folder
    assert _outputs(cells["load"])[0].startswith("LM(")
    assert _outputs(cells["generate"])[0].strip()
    assert _outputs(cells["stream"])[0].strip()
    assert _outputs(cells["chat"])[0].strip()
    page = _outputs(cells["attention"])[1]
    assert page.startswith("<iframe") and "http://" not in page and "https://" not in page
    printed = _outputs(cells["json"])[0].splitlines()
    assert json.loads(printed[0]) in ({"mood": "happy"}, {"mood": "sad"})
    assert not list(work.iterdir())  # nothing written into the working directory
    assert NOTEBOOK.read_bytes() == saved_bytes  # executed in memory only
