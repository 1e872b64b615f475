"""gptlab compare: the grid, resuming and repeating, the report's statistics against scipy, bad input."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gptlab.checkpoint import LAST, load_checkpoint
from gptlab.cli import main
from gptlab.cli.compare import parse_seeds, parse_vary
from gptlab.config import TrainConfig
from gptlab.experiments.compare import compare, plan
from gptlab.experiments.grid import RunOptions
from gptlab.experiments.report import Difference
from gptlab.experiments.runner import FINAL, data_folders

TEXT = "".join(f"{w} the {o} {i % 7}.\n" for i in range(400) for w, o in (("a cat sat on", "mat"),
                                                                         ("my dog ran to", "door")))
# A model and run small enough that a grid of eight trains in seconds.
MODEL = dict(n_layer=1, n_head=2, n_embd=16, block_size=16)
TRAIN = dict(batch_size=4, max_steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_interval=10,
             eval_batches=2, precision="float32", device="cpu")


def options(tmp_path: Path, **train: object) -> RunOptions:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TEXT, encoding="utf-8")
    return RunOptions(data=str(corpus), model=dict(MODEL), train={**TRAIN, **train})


GRID = [("positions", ("learned", "rope")), ("tied", ("true", "false"))]


@pytest.mark.slow
def test_a_two_by_two_grid_reports_welch_tests_as_scipy_computes_them_and_a_repeat_trains_nothing(
        tmp_path: Path) -> None:
    from scipy import stats

    out = tmp_path / "cmp"
    result = compare(options(tmp_path), GRID, (1, 2), out, jobs=2, progress=False)
    assert [o.status for o in result.outcomes] == ["finished"] * 8
    for name in ("report.md", "report.html", "curves.png", "compare.json"):
        assert (out / name).is_file()
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "data:image/png;base64," in html and "src=\"http" not in html  # self-contained
    finals = {}
    for cell in ("positions=learned,tied=true", "positions=learned,tied=false", "positions=rope,tied=true",
                 "positions=rope,tied=false"):
        finals[cell] = [json.loads((out / cell / f"seed-{s}" / FINAL).read_text())["val_loss"]
                        for s in (1, 2)]
        config = json.loads((out / cell / "seed-2" / "config.json").read_text())
        assert config["train"]["seed"] == 2
        assert config["model"]["positions"] == cell.split(",")[0].split("=")[1]
    report = (out / "report.md").read_text(encoding="utf-8")
    base = finals["positions=learned,tied=true"]
    for cell, values in finals.items():
        summary = next(s for s in result.summaries if s.cell.name == cell)
        expected = (statistics.mean(values), statistics.stdev(values))
        assert summary.mean_sd("final_val") == pytest.approx(expected)
        if values is base:
            continue
        p = stats.ttest_ind(values, base, equal_var=False).pvalue
        delta = statistics.mean(values) - statistics.mean(base)
        stderr = (statistics.variance(values) / 2 + statistics.variance(base) / 2) ** 0.5
        line = next(line for line in report.splitlines() if line.startswith(f"- {cell} is"))
        assert f"{abs(delta):.3f} ± {stderr:.3f} nats, p = {p:.2g}, 2 seeds each" in line
        assert f"| {cell} | 2 | {statistics.mean(values):.4f} ± {statistics.stdev(values):.4f} |" in report

    weights = {p: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")}
    again = compare(options(tmp_path), GRID, (1, 2), out, jobs=2, progress=False)
    assert again.outcomes == [] and again.skipped == 8
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")} == weights

    grid = GRID[:1] + [("tied", ("true",))]
    more = compare(options(tmp_path), grid, (1, 2, 3), out, jobs=2, progress=False)
    assert sorted(o.label for o in more.outcomes) == ["positions=learned,tied=true seed 3",
                                                      "positions=rope,tied=true seed 3"]
    with pytest.raises(ValueError, match=r"seed-1 was trained with other settings \(lr 0.003 -> 0.01"):
        compare(options(tmp_path, lr=0.01), GRID, (1, 2), out, jobs=2, progress=False)


def lock_holder(run: Path) -> int | None:
    """The process id a run folder's lock names, while that process lives."""
    try:
        pid = int((run / ".lock").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_a_killed_comparison_resumes_its_runs_to_the_weights_of_uninterrupted_ones(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    opts = options(tmp_path, max_steps=600, eval_interval=200, save_every=0.1)
    command = [sys.executable, "-m", "gptlab", "compare", "--data", opts.data, "--out", str(out), "--seeds",
               "1", "--vary", "positions=learned,rope", "--jobs", "1", "--no-progress"]
    command += [f"--{k.replace('_', '-')}={v}" for k, v in {**opts.model, **opts.train}.items()]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    first = out / "positions=learned" / "seed-1"
    deadline = time.monotonic() + 120
    while not (first / LAST).exists() or load_checkpoint(first, prefer=LAST).state["step"] == 0:
        assert time.monotonic() < deadline and process.poll() is None, "the comparison never saved a step"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)  # the parent dies at once; its worker saves and stops
    process.wait()
    while lock_holder(first) is not None:
        time.sleep(0.1)
    stopped = load_checkpoint(first, prefer=LAST).state["step"]
    assert 0 < stopped < 600

    result = compare(opts, [("positions", ("learned", "rope"))], (1,), out, jobs=1, progress=False)
    assert {o.label: o.action for o in result.outcomes} == {"positions=learned seed 1": "resume",
                                                            "positions=rope seed 1": "train"}
    from gptlab.training.loop import train
    from gptlab.training.machine import share_cores, thread_count

    grid = plan(opts, [("positions", ("learned",))], (1,), out)
    reference = tmp_path / "reference"
    data = data_folders(grid.cells, out)[grid.cells[0].name]
    with thread_count(share_cores(1)[1]):  # the worker's threads: another count sums in another order
        train(reference, data, grid.cells[0].model_config, grid.runs[0].train_config, progress=False)
    resumed = load_checkpoint(first, prefer=LAST).model_state
    straight = load_checkpoint(reference, prefer=LAST).model_state
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in resumed)


def test_a_bad_key_or_value_is_one_line_before_anything_trains(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    for vary, expected in (("position=learned,rope", "no such option of gptlab train; did you mean"),
                           ("positions=learned,bogus", "cell positions=bogus: ModelConfig.positions='bogus'"),
                           ("lr=fast", "--vary lr=fast: --lr takes a float"),
                           ("seed=1,2", "--vary seed is not offered: seeds are the grid's other axis"),
                           ("positions", "must be KEY=V1,V2")):
        assert main(["compare", "--vary", vary, "--out", str(out), "--preset", "tiny"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    assert main(["compare", "--vary", "lr=1e-3,2e-3", "--lr", "1e-3", "--out", str(out)]) == 2
    assert "--lr is both given (0.001) and varied" in capsys.readouterr().err
    assert main(["compare", "--baseline", "rope", "--vary", "positions=learned,none",
                 "--out", str(out)]) == 2
    assert "--baseline 'rope' is not one cell" in capsys.readouterr().err
    assert not out.exists()


def test_a_dry_run_counts_the_runs_and_measures_a_time_and_trains_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", "--dry-run", "--preset", "tiny", "--vary", "norm=layernorm,rmsnorm", "--vary",
                 "arrangement=pre,post", "--seeds", "3", "--out", str(out), "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "4 cell(s) x 3 seed(s) = 12 runs, 1 at a time" in printed
    assert "norm=rmsnorm,arrangement=post: 60 steps, about" in printed and "estimated" in printed
    assert not out.exists()


def test_an_out_folder_holding_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no comparison"):
        compare(options(tmp_path), [], (1,), tmp_path, jobs=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "notes.txt"]


def test_vary_and_seeds_parse_as_documented() -> None:
    assert parse_vary("--warmup-steps=0,20") == ("warmup_steps", ("0", "20"))
    assert parse_seeds("3") == (1, 2, 3) and parse_seeds("1,5,9") == (1, 5, 9)
    with pytest.raises(ValueError, match="each once"):
        parse_seeds("1,1")
    grid = plan(RunOptions(preset="tiny"), [parse_vary("tied=true,false"), parse_vary("n_kv_head=none,1")],
                (1,), "out", baseline="false,none")
    assert [c.name for c in grid.cells] == ["tied=true,n_kv_head=none", "tied=true,n_kv_head=1",
                                            "tied=false,n_kv_head=none", "tied=false,n_kv_head=1"]
    assert grid.baseline.name == "tied=false,n_kv_head=none" and grid.cells[1].model_config.n_kv_head == 1
    assert grid.cells[2].model_config.tied is False and isinstance(grid.cells[0].train_config, TrainConfig)


def test_one_seed_is_never_called_significant() -> None:
    one = Difference("rope", "learned", -0.05, float("nan"), float("nan"), 1, 1).sentence()
    assert "one seed cannot tell a difference from noise" in one
    worse = Difference("none", "learned", 0.2, 0.01, 0.001, 3, 3).sentence()
    assert worse == ("none is worse than learned by 0.200 ± 0.010 nats, p = 0.001, 3 seeds each "
                     "(significant at the 5% level).")
