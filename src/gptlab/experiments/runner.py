"""Train a grid's runs, N at a time, so that the same command run again finishes the work and nothing more.

Each run is an ordinary run folder trained by `gptlab.training.loop`. Before anything trains, every run's
state is read: a finished run is skipped, an interrupted one resumed (its last checkpoint is at most
`save_every` seconds old), a new one started; a run folder trained with other settings is refused by name.
Runs train in worker processes of their own (`jobs` at once, the cores divided among them); a
worker follows its parent: Ctrl-C or SIGTERM to the comparison makes every running run save and stop,
and on Linux a killed parent takes its workers down the same way. Each run ends with its last
checkpoint scored on the validation split (`final.json`), the figure the report compares.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.checkpoint import LAST, has_checkpoint, load_header
from gptlab.config import CORPORA, ModelConfig, SettingError, TrainConfig
from gptlab.experiments.grid import Cell, Run, config_differences, safe_name
from gptlab.files import atomic_write_text

log = logging.getLogger("gptlab.compare")

FINAL = "final.json"  # the last checkpoint's loss on the validation split, written when a run finishes
FINAL_TOKENS = 2**17  # the first this many validation tokens are scored, the same ones for every run


@dataclass(frozen=True)
class Job:
    """What a worker process needs to train (or resume, or only score) one run."""

    label: str
    folder: Path
    data: Path
    model: dict[str, Any]
    train: dict[str, Any]
    action: str  # "train", "resume" or "score" (trained, but not yet scored)
    changes: dict[str, Any] = field(default_factory=dict)  # resume's: a larger max_steps extends the run
    threads: int = 1
    log_file: Path | None = None


@dataclass(frozen=True)
class Outcome:
    """What came of one job: `status` is finished, interrupted, diverged or failed."""

    label: str
    folder: Path
    action: str  # the job's: train, resume or score
    status: str
    message: str = ""
    val_loss: float | None = None
    seconds: float = 0.0
    settings: dict[str, str] = field(default_factory=dict)  # a SettingError's: key -> Python spelling
    template: str = ""  # ... and its template, so the command line can name its flags instead

    def describe(self, spell: Callable[[SettingError], str] = str) -> str:
        """The message, its settings named by `spell` (str: as Python does; the CLI gives its flags)."""
        return spell(SettingError(self.template, **self.settings)) if self.template else self.message


def content_key(source: str) -> str:
    """A built-in corpus's name, else `sha256-` and the start of the SHA-256 of the text `source` names, as
    `load_text` reads it: two files of one name get two keys, one text under two names one."""
    from gptlab.data.corpora import load_text

    if source in CORPORA:
        return source
    with warnings.catch_warnings():  # about the text: preparing it says so, once
        warnings.simplefilter("ignore")
        text = load_text(source)
    return "sha256-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def data_folders(cells: list[Cell], out: Path) -> dict[str, Path]:
    """Where each cell's text is prepared (cell name -> folder): OUT/data/<content_key>-<tokenizer>, shared
    by every cell that reads the same text with the same tokenizer; a prepared folder is used as it is."""
    keys: dict[str, str] = {}
    folders = {}
    for cell in cells:
        options = cell.options
        if (Path(options.data) / "meta.json").is_file():
            folders[cell.name] = Path(options.data)
            continue
        if options.data not in keys:  # each text is read once
            keys[options.data] = content_key(options.data)
        size = f"-{options.tokenizer_vocab_size}" if options.tokenizer_vocab_size else ""
        folders[cell.name] = out / "data" / safe_name(f"{keys[options.data]}-{options.tokenizer}{size}")
    return folders


def prepare_data(cells: list[Cell], out: Path, progress: bool) -> dict[str, Path]:
    """Prepare every distinct text once, before any run trains (a bad source fails here); cell name ->
    prepared folder. A folder prepared by an earlier call from the same text is reused."""
    from gptlab.data.prepare import prepare

    folders = data_folders(cells, out)
    for cell in cells:
        folder, options = folders[cell.name], cell.options
        if not (folder / "meta.json").is_file():
            log.info(f"preparing {options.data} with the {options.tokenizer} tokenizer into {folder}")
            prepare(options.data, folder, tokenizer=options.tokenizer,
                    vocab_size=options.tokenizer_vocab_size, progress=progress)
    return folders


def plan_job(run: Run, data: Path, threads: int, logs: Path) -> Job | None:
    """The job that brings `run` to its end, or None when it is finished and scored; a run folder trained
    with other settings than the grid's is refused, naming what differs."""
    from gptlab.data.tokens import TokenData
    from gptlab.training.resume import RESUMABLE

    model = run.cell.model_config.replace(vocab_size=TokenData(data).tokenizer.vocab_size)
    train = run.train_config
    log_file = logs / f"{safe_name(run.cell.name)}.seed-{run.seed}.log"
    job = Job(run.label, run.folder, data, model.to_dict(), train.to_dict(), "train", threads=threads,
              log_file=log_file)
    if not has_checkpoint(run.folder, LAST):
        return job
    header = load_header(run.folder, prefer=LAST)
    saved = header.train_config or TrainConfig()
    for name in ("precision", "muon_precision"):  # a run from before the choice was made at start-up
        if getattr(saved, name) == "auto":  # resumes as it began
            train = train.replace(**{name: "auto"})
    differs = config_differences(header.model_config, model)
    differs += [d for d in config_differences(saved, train) if d.split()[0] not in RESUMABLE]
    if differs:
        raise SettingError(f"{run.folder} was trained with other settings ({'; '.join(differs)}): this "
                           "command would change its work; give the options it was run with, or choose "
                           "another {out}", out="out")
    changes = {"max_steps": train.max_steps} if train.max_steps != saved.max_steps else {}
    step = header.state["step"]
    if step < train.max_steps or header.state.get("evaluation_due"):  # or its last evaluation abandoned
        return Job(**{**job.__dict__, "action": "resume", "changes": changes})
    if scored_step(run.folder) == step:
        return None
    return Job(**{**job.__dict__, "action": "score"})


def scored_step(folder: Path) -> int | None:
    """The step of the checkpoint `final.json` scored, if the run has been scored."""
    try:
        return int(json.loads((folder / FINAL).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def final_loss(folder: Path) -> float | None:
    """The loss `final.json` holds: the last checkpoint on the validation split."""
    try:
        return float(json.loads((folder / FINAL).read_text(encoding="utf-8"))["val_loss"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def score(folder: Path, data: Path) -> float:
    """Score a run's last checkpoint on the validation split (its first FINAL_TOKENS) into final.json."""
    from gptlab.data.tokens import TokenData
    from gptlab.evaluation.heldout import evaluate_tokens
    from gptlab.inference.loading import load

    lm = load(folder, prefer=LAST)
    result = evaluate_tokens(lm.model, TokenData(data).split("val"), max_tokens=FINAL_TOKENS)
    assert lm.header is not None, "a loaded run has its header"
    record = {"step": lm.header.state["step"], "val_loss": result.loss, "tokens": result.tokens,
              "checkpoint": LAST}
    atomic_write_text(folder / FINAL, json.dumps(record, indent=2) + "\n")
    return result.loss


def execute(job: Job) -> Outcome:
    """Train, resume or score one run in this process (with its log in `job.log_file`)."""
    import torch

    from gptlab.training.loop import TrainingDiverged, train
    from gptlab.training.resume import resume

    torch.set_num_threads(job.threads)
    handler = None
    if job.log_file is not None:
        job.log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(job.log_file, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("gptlab").addHandler(handler)
    begin = time.perf_counter()

    def outcome(status: str, message: str = "", val_loss: float | None = None,
                error: Exception | None = None) -> Outcome:
        seconds = time.perf_counter() - begin
        named = error if isinstance(error, SettingError) else None
        return Outcome(job.label, job.folder, job.action, status, message, val_loss, seconds,
                       named.settings if named else {}, named.template if named else "")

    try:
        if job.action == "train":
            result = train(job.folder, job.data, ModelConfig.from_dict(job.model),
                           TrainConfig.from_dict(job.train), progress=False)
        elif job.action == "resume":
            result = resume(job.folder, changes=job.changes, progress=False)
        if job.action != "score" and result.interrupted:
            return outcome("interrupted", f"saved at step {result.step}")
        return outcome("finished", val_loss=score(job.folder, job.data))
    except TrainingDiverged as err:
        return outcome("diverged", str(err), error=err)
    except (ValueError, OSError, RuntimeError) as err:
        return outcome("failed", str(err), error=err)
    finally:
        if handler is not None:
            logging.getLogger("gptlab").removeHandler(handler)
            handler.close()


def follow_parent() -> None:
    """Leave the terminal's process group (the parent forwards one stop signal itself) and, on Linux, be
    sent SIGTERM when the parent dies, so a killed comparison's runs save and stop rather than run on."""
    if hasattr(os, "setpgrp"):  # not on Windows
        os.setpgrp()
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def worker(jobs: Any, results: Any, parent: int) -> None:
    """A worker process: run jobs until told to stop (None) or interrupted."""
    follow_parent()
    if os.getppid() != parent:  # the parent died before the death signal was set
        return
    logging.getLogger("gptlab").setLevel(logging.INFO)
    try:
        while (job := jobs.get()) is not None:
            outcome = execute(job)
            results.put(outcome)
            if outcome.status == "interrupted":
                return
    except KeyboardInterrupt:  # a second signal, or one outside a run: stop at once
        return


def run_jobs(jobs: list[Job], n_workers: int, on_outcome: Callable[[Outcome], None]) -> None:
    """Run `jobs` in `n_workers` worker processes, handing each outcome to `on_outcome` as it comes; on
    Ctrl-C or SIGTERM every running run saves and stops, reports, and the interrupt is raised again."""
    context = multiprocessing.get_context("spawn")  # a clean interpreter: no inherited threads or locks
    pending, results = context.Queue(), context.Queue()
    for job in jobs:
        pending.put(job)
    n_workers = max(1, min(n_workers, len(jobs)))
    for _ in range(n_workers):
        pending.put(None)
    processes = [context.Process(target=worker, args=(pending, results, os.getpid()), daemon=True)
                 for _ in range(n_workers)]
    for process in processes:
        process.start()
    received = 0
    try:
        while received < len(jobs):
            try:
                outcome = results.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break  # every worker stopped (interrupted, or killed): the rest never started
                continue
            received += 1
            on_outcome(outcome)
    except KeyboardInterrupt:
        for process in processes:  # the workers left the terminal's group: tell each one, once
            if process.is_alive() and process.pid is not None:  # a started process has its pid
                os.kill(process.pid, signal.SIGTERM)
        for process in processes:
            process.join()
        for outcome in drain(results):
            on_outcome(outcome)
        raise
    finally:
        for process in processes:
            process.join(timeout=5)


def drain(results: Any) -> list[Outcome]:
    """The outcomes workers reported while the parent was stopping them."""
    found = []
    while True:
        try:
            found.append(results.get(timeout=0.2))
        except queue.Empty:
            return found
