"""gptlab compare keys prepared data by content: two texts of one file name each train on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptlab.experiments.compare import compare, plan
from gptlab.experiments.grid import RunOptions
from gptlab.experiments.runner import data_folders

MODEL = dict(n_layer=1, n_head=2, n_embd=16, block_size=16)
TRAIN = dict(batch_size=4, max_steps=4, lr=3e-3, min_lr=3e-4, warmup_steps=1, eval_interval=4,
             eval_batches=1, precision="float32", device="cpu")


def corpus(folder: Path, line: str) -> Path:
    """`folder`/corpus.txt holding `line` many times."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    path.write_text(line * 300, encoding="utf-8")
    return path


def test_one_text_under_two_names_is_one_folder_and_two_texts_of_one_name_are_two(tmp_path: Path) -> None:
    a = corpus(tmp_path / "da", "a cat sat on the mat.\n")
    b = corpus(tmp_path / "db", "my dog ran to the door.\n")
    same = tmp_path / "copy.txt"
    same.write_bytes(a.read_bytes())
    options = RunOptions(model=dict(MODEL), train=dict(TRAIN))
    grid = plan(options, [("data", (str(a), str(b), str(same)))], (1,), tmp_path / "cmp")
    folders = [data_folders(grid.cells, tmp_path / "cmp")[cell.name] for cell in grid.cells]
    assert folders[0] != folders[1] and folders[0] == folders[2]
    assert folders[0].parent == tmp_path / "cmp" / "data" and folders[0].name.endswith("-char")


@pytest.mark.slow  # trains two runs in a worker process, then asks again
def test_two_corpora_of_one_file_name_each_train_on_their_own_and_a_repeat_reuses_them(
        tmp_path: Path) -> None:
    a = corpus(tmp_path / "da", "a cat sat on the mat.\n")
    b = corpus(tmp_path / "db", "my dog ran to the door.\n")
    options = RunOptions(model=dict(MODEL), train=dict(TRAIN))
    out = tmp_path / "cmp"
    vary = [("data", (str(a), str(b)))]
    result = compare(options, vary, (1,), out, jobs=1, progress=False)
    assert [o.status for o in result.outcomes] == ["finished", "finished"]
    sources = {}
    for run in plan(options, vary, (1,), out).runs:
        data_dir = Path(json.loads((run.folder / "config.json").read_text(encoding="utf-8"))["data_dir"])
        sources[json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))["source"]] = data_dir
    assert sorted(sources) == [str(a), str(b)] and len(set(sources.values())) == 2
    assert (sources[str(a)] / "train.bin").read_bytes() != (sources[str(b)] / "train.bin").read_bytes()

    prepared = {p: p.stat().st_mtime_ns for p in (out / "data").rglob("*.bin")}
    again = compare(options, vary, (1,), out, jobs=1, progress=False)
    assert again.outcomes == [] and again.skipped == 2
    assert {p: p.stat().st_mtime_ns for p in (out / "data").rglob("*.bin")} == prepared
