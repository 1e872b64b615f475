"""`gptlab compare` as a library call: plan the grid, prepare its data, train what is not done, report.

OUT holds compare.json (the grid, and the precision decided once for this machine), data/ (each text
prepared once, named by its content), logs/ (one log per run), a run folder per cell and seed, and the
report (report.md, report.html, curves.png), rewritten after every call.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gptlab.common import cpu_name, on_terminal, resolve_device
from gptlab.config import SettingError
from gptlab.experiments.estimate import run_seconds, step_seconds
from gptlab.experiments.grid import Cell, Run, RunOptions, build_grid, find_cell, grid_runs, safe_name
from gptlab.experiments.report import CellSummary, write_report
from gptlab.experiments.runner import Outcome, data_folders, plan_job, prepare_data, run_jobs
from gptlab.files import RunLock, atomic_write_text
from gptlab.training.machine import cores, share_cores

log = logging.getLogger("gptlab.compare")

GRID_FILE = "compare.json"


@dataclass(frozen=True)
class Grid:
    """A comparison's cells, runs (cell by cell, seed by seed) and baseline cell."""

    cells: list[Cell]
    runs: list[Run]
    baseline: Cell


@dataclass(frozen=True)
class CompareResult:
    """What a call achieved: the outcome of every job it ran, and the cells as the report shows them."""

    out: Path
    outcomes: list[Outcome]
    summaries: list[CellSummary]
    skipped: int  # runs finished and scored by an earlier call

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in ("failed", "diverged")]


def plan(options: RunOptions, varies: Sequence[tuple[str, tuple[str, ...]]], seeds: Sequence[int],
         out: str | Path, baseline: str | None = None) -> Grid:
    """The grid of `options` with `varies` over `seeds`, each cell validated (a bad value is one line)."""
    cells = build_grid(options, list(varies))
    return Grid(cells, grid_runs(cells, tuple(seeds), Path(out)), find_cell(cells, baseline))


def describe(grid: Grid, jobs: int, threads: int) -> list[str]:
    """The grid as lines: each cell's settings and size, the number of runs, and the time it should take,
    measured with a few steps of each distinct cell shape on this machine."""
    from gptlab.data.tokens import TokenData

    seeds = len(grid.runs) // len(grid.cells)
    lines = [f"{len(grid.cells)} cell(s) x {seeds} seed(s) = {len(grid.runs)} runs, {jobs} at a time with "
             f"{threads} thread(s) each; baseline {grid.baseline.name}"]
    seconds, probes = 0.0, {}
    folders = data_folders(grid.cells, grid.runs[0].folder.parents[1])
    for cell in grid.cells:
        folder = folders[cell.name]
        vocab = TokenData(folder).tokenizer.vocab_size if (folder / "meta.json").is_file() else 256
        model = cell.model_config.replace(vocab_size=vocab)
        shape = (json.dumps(model.to_dict()), cell.train_config.batch_size, cell.train_config.grad_accum,
                 cell.train_config.optimizer)
        if shape not in probes:
            probes[shape] = step_seconds(model, cell.train_config, threads)
        each = run_seconds(probes[shape], cell.train_config, cell.train_config.max_steps)
        seconds += each * seeds
        lines.append(f"  {cell.name}: {cell.train_config.max_steps} steps, about {each:.1f} s a run")
    lines.append(f"estimated {seconds / jobs / 60:.1f} min in all (a few timed steps of each cell here; "
                 "startup, data preparation and scoring not counted)")
    return lines


def compare(options: RunOptions, varies: Sequence[tuple[str, tuple[str, ...]]], seeds: Sequence[int],
            out: str | Path, *, jobs: int | None = None, baseline: str | None = None, progress: bool = True,
            command: str = "", spell: Callable[[SettingError], str] = str) -> CompareResult:
    """Train every run of the grid that is not finished (N at a time), then write the report.

    The same call again trains nothing and rewrites the report; an interrupted call's runs are resumed from
    their last checkpoints. A run folder trained with other settings is refused before anything trains.
    `spell` names the settings in a failed run's message (str: as Python does; the CLI gives its flags).
    """
    out = Path(out)
    grid = plan(options, varies, seeds, out, baseline)
    check_folder(out)
    with RunLock(out):
        earlier = saved_machine(out)
        write_grid(out, grid, command, earlier)  # first: a failed preparation still leaves a comparison
        jobs, threads = share_cores(jobs)
        data = prepare_data(grid.cells, out, progress)
        grid, machine = decide_for_grid(grid, out, data, threads, earlier)
        write_grid(out, grid, command, machine)
        planned = [(run, plan_job(run, data[run.cell.name], threads, out / "logs")) for run in grid.runs]
        todo = [job for _, job in planned if job is not None]
        skipped = len(planned) - len(todo)
        kinds = {a: sum(j.action == a for j in todo) for a in ("train", "resume", "score")}
        log.info(f"{len(grid.runs)} runs: {skipped} finished before, {kinds['resume']} to resume, "
                 f"{kinds['train']} to train, {kinds['score']} to score; {min(jobs, max(1, len(todo)))} at a "
                 f"time with {threads} thread(s) each (logs in {out / 'logs'})")
        outcomes: list[Outcome] = []
        context = report_context(command, jobs, threads)
        bar = tqdm(total=len(todo), unit="run", disable=not (progress and on_terminal()), dynamic_ncols=True)
        begin = time.perf_counter()

        def report_outcome(outcome: Outcome) -> None:
            outcomes.append(outcome)
            bar.update(1)
            loss = f", final val loss {outcome.val_loss:.4f}" if outcome.val_loss is not None else ""
            detail = f": {outcome.describe(spell)}" if outcome.message else ""
            log.info(f"[{len(outcomes)}/{len(todo)}] {outcome.label}: {outcome.status} in "
                     f"{outcome.seconds:.0f} s{loss}{detail}")

        try:
            if todo:
                run_jobs(todo, jobs, report_outcome)
        except KeyboardInterrupt:
            log.info(f"interrupted: the running runs saved their last step; run the same command again to "
                     f"continue (report of the finished runs in {out / 'report.md'})")
            raise
        finally:
            bar.close()
            summaries = write_report(out, grid.runs, grid.baseline, context)
        if todo:
            minutes = (time.perf_counter() - begin) / 60
            log.info(f"trained for {minutes:.1f} min; report in {out / 'report.md'}, {out / 'report.html'} "
                     f"and {out / 'curves.png'}")
    return CompareResult(out, outcomes, summaries, skipped)


def check_folder(out: Path) -> None:
    """Refuse an `out` that holds something other than a comparison (or nothing)."""
    others = out.is_dir() and any(p.name != RunLock.NAME for p in out.iterdir())
    if others and not (out / GRID_FILE).is_file():
        raise SettingError(f"{out} is not empty and holds no comparison: choose a new or empty {{out}} "
                           "(nothing in it was changed)", out="out")


def decide_for_grid(grid: Grid, out: Path, data: dict[str, Path], threads: int,
                    earlier: dict[str, Any] | None) -> tuple[Grid, dict[str, Any] | None]:
    """The grid with precision "auto" (and Muon's) made concrete once for every cell, so that no two cells
    differ by a probe's noise, and compare.json's "machine" entry; None when no cell asks for "auto".

    One `machine.decide`, probing the first such cell's model at its micro-batch with the threads each run
    gets, decides for the whole grid: give a precision (or vary it) to choose otherwise. A later call in
    the same OUT reuses the decisions compare.json holds (`earlier`), so its runs all keep one precision
    and the ones it resumes are not refused as changed."""
    from gptlab.data.tokens import TokenData
    from gptlab.training.machine import decide, describe, record

    auto = [cell for cell in grid.cells if cell.train_config.precision == "auto"]
    muon = [cell for cell in grid.cells
            if cell.train_config.optimizer == "muon" and cell.train_config.muon_precision == "auto"]
    if not auto and not muon:
        return grid, None
    earlier = earlier or {}  # None: nothing was decided before
    first = (auto or muon)[0]
    probe: dict[str, Any] = {"cell": first.name, "rows": first.train_config.batch_size, "threads": threads}
    asking = (("precision", auto), ("muon_precision", muon))
    kept = [name for name, those in asking if those and name in earlier]
    if auto and "precision" in earlier:
        probe = earlier.get("probe", probe)
    model = first.model_config.replace(vocab_size=TokenData(data[first.name]).tokenizer.vocab_size)
    decisions = decide(resolve_device(first.train_config.device), model, first.train_config.batch_size,
                       precision="auto" if auto else None, muon_precision="auto" if muon else None,
                       threads=threads, earlier=earlier)
    kept_note = f" (as decided before, in {GRID_FILE})" if kept else ""
    log.info(describe(decisions, auto=bool(auto)) + kept_note)
    chosen = {d.name: d.value for d in decisions}
    cells = [dataclasses.replace(c, train_config=c.train_config.replace(
        **{name: chosen[name] for name, those in asking if c in those})) for c in grid.cells]
    seeds = tuple(dict.fromkeys(r.seed for r in grid.runs))  # in the grid's order
    concrete = Grid(cells, grid_runs(cells, seeds, out), cells[grid.cells.index(grid.baseline)])
    return concrete, {**record(decisions), "probe": probe}


def write_grid(out: Path, grid: Grid, command: str, machine: dict[str, Any] | None = None) -> None:
    """compare.json: the cells (settings and configs), the seeds, the baseline and what was decided for this
    machine (`machine`, gptlab.training.machine's record), for readers of OUT."""
    seeds = sorted({r.seed for r in grid.runs})
    record = {"command": command, "seeds": seeds, "baseline": grid.baseline.name,
              **({"machine": machine} if machine else {}), "cells": [
        {"name": c.name, "folder": safe_name(c.name), "settings": dict(c.settings), "data": c.options.data,
         "tokenizer": c.options.tokenizer, "model": c.model_config.to_dict(),
         "train": c.train_config.to_dict()}
        for c in grid.cells]}
    atomic_write_text(out / GRID_FILE, json.dumps(record, indent=2) + "\n")


def saved_machine(out: Path) -> dict[str, Any] | None:
    """The "machine" entry an earlier call wrote into compare.json, if any."""
    try:
        return json.loads((out / GRID_FILE).read_text(encoding="utf-8")).get("machine")
    except (OSError, ValueError, AttributeError):
        return None


def report_context(command: str, jobs: int, threads: int) -> list[str]:
    """The lines that say where and how the figures were measured."""
    lines = [f"command: `{command}`"] if command else []
    return lines + [f"measured on {cpu_name()} ({cores()} cores), torch {torch.__version__}, Python "
                    f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}",
                    f"{jobs} run(s) at a time with {threads} thread(s) each: times are comparable within "
                    "this report, not with runs trained alone"]
