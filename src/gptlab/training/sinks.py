"""Where a run's metrics go: `steps.csv` always, TensorBoard and Weights & Biases when `--log` asks.

The training loop (gptlab.training.loop.Trainer, on rank 0 only) makes the same calls on every sink:
`log(step, values)` after each optimiser step with `train/...` values (loss, lr, grad_norm,
tokens_per_s, elapsed_s) and after each evaluation with `eval/...` (the two losses and the data
source's metrics) and `heads/...` (--track-heads) values, then `close()` once, however the run ends.
The evaluations' own table, metrics.csv, stays with the loop (gptlab.training.logs.MetricsLog).

A resumed run continues from its checkpoint, so a run killed between two saves logs the steps after
the checkpoint again. steps.csv forgets the first copies (as metrics.csv does) and TensorBoard is told
to hide them (`purge_step`); W&B, whose own step counter may only grow, keeps both, plotted against the
`step` metric: they coincide, as a resumed run computes exactly what it computed before.
The dashboards' packages are optional extras, imported only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from gptlab.config import LOGS, SettingError
from gptlab.files import atomic_write_text
from gptlab.training.logs import CsvLog

log = logging.getLogger("gptlab.training.sinks")

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}  # what each --log choice imports
assert set(MODULES) == set(LOGS), "every --log choice has its module"


class Sink(Protocol):
    """Somewhere a run's metrics go."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values`, named like "train/loss" or "eval/val_loss", at optimiser step `step`."""

    def close(self) -> None:
        """Write out what is pending and let go of files and connections."""


def require(name: str) -> ModuleType:
    """The module that the `log` destination `name` needs; a missing package is one line that says how to
    install it."""
    try:
        return importlib.import_module(MODULES[name])
    except ImportError:
        raise SettingError(f"{{log}} {name} needs the {name} package: pip install 'gptlab[{name}]'",
                           log="TrainConfig.log") from None


def check_installed(names: Sequence[str]) -> None:
    """Refuse, before any training, a `log` destination whose package is missing (on every rank alike)."""
    for name in names:
        require(name)


class StepsCsv:
    """`steps.csv`, a row per optimiser step: its `train/...` values (evaluations go to metrics.csv).

    loss is the step's mean training loss, lr the learning rate the step used, grad_norm the global
    gradient norm before clipping, tokens_per_s the step's own throughput (scored target tokens over
    its time) and elapsed_s the training time so far, evaluations not counted.
    """

    COLUMNS = ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.table = CsvLog(path, ("step", *self.COLUMNS), resume_step)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        row = {name: values[f"train/{name}"] for name in self.COLUMNS if f"train/{name}" in values}
        if row:
            self.table.append(step=step, **row)

    def close(self) -> None:
        """Nothing is pending: each row is written and its file closed as it comes."""


class TensorBoard:
    """Event files in `folder` (RUN/tensorboard), one scalar per value: `tensorboard --logdir RUN`."""

    def __init__(self, folder: Path, resume_step: int | None) -> None:
        writer = require("tensorboard").SummaryWriter
        # TensorBoard hides whatever earlier event files hold from purge_step on: the steps a killed run
        # logged after its checkpoint, or all of a new run's failed first start. Each step shows once.
        self.writer = writer(str(folder), purge_step=0 if resume_step is None else resume_step + 1)
        log.info(f"TensorBoard: tensorboard --logdir {folder}")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # installed: torch's writer needs it

        # One event holding every value, each as add_scalar writes it (a simple_value): a quarter of the
        # cost of one add_scalar per value (0.1 ms a step, not 0.4).
        scalars = [Summary.Value(tag=name, simple_value=value) for name, value in values.items()]
        self.writer.file_writer.add_summary(Summary(value=scalars), step)

    def close(self) -> None:
        self.writer.close()


class WeightsAndBiases:
    """A W&B run named after the run folder, with the run's configs, in RUN/wandb.

    Its id is kept in RUN/wandb/run-id, so that a resumed run continues the same W&B run. WANDB_PROJECT
    chooses the project (default gptlab); WANDB_MODE=offline keeps it on disk for `wandb sync`.
    W&B's banners and console capture are off: gptlab prints where the run is, once.
    """

    def __init__(self, run_dir: Path, configs: Mapping[str, Any], resuming: bool) -> None:
        wandb = require("wandb")
        id_file = run_dir / "wandb" / "run-id"
        run_id = id_file.read_text(encoding="utf-8").strip() if resuming and id_file.exists() else None
        id_file.parent.mkdir(parents=True, exist_ok=True)  # wandb.init writes its files beside it
        try:
            self.run = wandb.init(dir=run_dir, project=os.environ.get("WANDB_PROJECT") or "gptlab",
                                  name=str(run_dir), config=dict(configs), id=run_id, resume="allow",
                                  settings=wandb.Settings(silent=True, console="off"))
        except wandb.errors.Error as err:
            raise SettingError(f"{{log}} wandb could not start a W&B run: {str(err).rstrip('.')}; or set "
                               "WANDB_MODE=offline to keep it on disk, for `wandb sync` later",
                               log="TrainConfig.log") from None
        self.run.define_metric("*", step_metric="step")  # resumed steps plot at their own step
        atomic_write_text(id_file, self.run.id + "\n")
        where = (f"offline in {self.run.settings.sync_dir} (upload: wandb sync {self.run.settings.sync_dir})"
                 if self.run.offline else self.run.url)
        log.info(f"W&B run {self.run.id}: {where}")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """All of a run's sinks as one: steps.csv, then each dashboard in `names` (TrainConfig.log).

    `configs` (the model's and the training's, as dicts) describe the run to W&B; `resume_step` is the
    checkpoint's step when the run resumes, else None.
    """

    def __init__(self, run_dir: Path, names: Sequence[str], configs: Mapping[str, Any],
                 resume_step: int | None) -> None:
        self.sinks: list[Sink] = []
        with contextlib.ExitStack() as opened:  # if one fails to open, those before it are closed
            for sink in self._open(run_dir, names, configs, resume_step):
                opened.callback(sink.close)
                self.sinks.append(sink)
            self._closing = opened.pop_all()

    @staticmethod
    def _open(run_dir: Path, names: Sequence[str], configs: Mapping[str, Any],
              resume_step: int | None) -> Iterator[Sink]:
        yield StepsCsv(run_dir / "steps.csv", resume_step)
        for name in names:
            if name == "tensorboard":
                yield TensorBoard(run_dir / "tensorboard", resume_step)
            elif name == "wandb":
                yield WeightsAndBiases(run_dir, configs, resuming=resume_step is not None)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, values)

    def close(self) -> None:
        """Close every sink, the others too when one fails (that failure is raised after)."""
        self._closing.close()
