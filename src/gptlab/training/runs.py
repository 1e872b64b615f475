"""A run folder's lifecycle: its lock, its start-up checks and decisions, and `config.json`.

A run folder is a gptlab run when it holds a checkpoint or the `config.json` a run writes first. A new run
refuses a folder that holds a run or other files; one that fails before its first checkpoint leaves
nothing behind. At start-up the settings are checked together (`check_settings`, naming the fields), what
this machine is fast at is decided once (gptlab.training.machine) and saved in `config.json` beside
the resolved configs, and text given as the data is prepared into RUN/data. The loop itself is
gptlab.training.loop; continuing a run, gptlab.training.resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from gptlab import sharded
from gptlab.checkpoint import BEST, LAST, architecture, has_checkpoint, load_header, portable
from gptlab.common import on_terminal
from gptlab.config import ModelConfig, SettingError, TrainConfig
from gptlab.data.prepare import prepare
from gptlab.files import RunLock, atomic_write_text, remove_stale_temporaries
from gptlab.text.tokenizer import Tokenizer
from gptlab.training import distributed, machine, sinks

log = logging.getLogger("gptlab.training.runs")


class TrainingData(Protocol):
    """What the loop needs of its examples (TokenData for text, TaskData for a seq2seq task)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The columns `metrics` adds to metrics.csv."""

    @property
    def selects_best(self) -> bool:
        """Whether its validation set can choose a best checkpoint; if not, best is the last one."""

    def check_window(self, block_size: int) -> None: ...

    def get_batch(self, split: str, batch_size: int, block_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """The model's inputs, then its targets (-1 where nothing is scored); all (batch_size, ...)."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to rebuild this data source (see `resume.data_from_state`)."""

    def metrics(self, model: torch.nn.Module, losses: dict[str, float], seed: int,
                device: torch.device) -> Mapping[str, float | str]: ...


@contextlib.contextmanager
def run_folder(run_dir: Path, new: bool, redoes: Callable[[Path], bool] | None = None) -> Iterator[None]:
    """Hold the run folder's lock for the whole run (the main process writes every file).

    Under the lock: a new run refuses a folder holding a run, a model or other files (`redoes` may accept
    a model the same command wrote before), temporary files that a killed save left are removed, and a
    new run that fails before its first checkpoint takes its folder away again, so nothing half-written
    is left. A command that refuses or fails leaves the lock file as it found it (or none, as it found
    none), so a refused folder is byte for byte what it was, but for a killed save's temporary files.
    """
    if not distributed.this_process().is_main:
        yield
        return
    created = not run_dir.exists()
    with RunLock(run_dir) as lock:
        try:
            remove_stale_temporaries(run_dir)  # first: a killed save's leftover is no file of the user's
            if new:
                check_new_run(run_dir, redoes)
            sharded.remove_unnamed(run_dir)  # sharded saves a kill interrupted
            yield
        except BaseException:
            lock.restore()
            if created and not has_checkpoint(run_dir, LAST):
                shutil.rmtree(run_dir, ignore_errors=True)
            raise


def check_new_run(run_dir: Path, redoes: Callable[[Path], bool] | None = None) -> None:
    """Refuse to start a run in a folder that holds one, a model (an import's or a merge's best checkpoint
    alone, unless `redoes(run_dir)` says the same command wrote it), or files that are not a gptlab run."""
    if has_checkpoint(run_dir, LAST):
        raise SettingError(f"{run_dir} already holds a run: continue it with {{resume}}, or choose another "
                           "{run_dir}", resume="resume", run_dir="run_dir")
    if holds_model(run_dir) and not (redoes and redoes(run_dir)):
        raise SettingError(f"{run_dir} holds a model ({BEST}, as import-hf and merge write) that a new run "
                           "would replace: choose another {run_dir} (nothing in it was changed)",
                           run_dir="run_dir")
    if is_run_folder(run_dir):
        return  # a run that was stopped before its first checkpoint: start it again
    if run_dir.is_dir() and any(p.name != RunLock.NAME for p in run_dir.iterdir()):
        raise SettingError(f"{run_dir} is not empty and is not a gptlab run folder: choose a new or empty "
                           "{run_dir} (nothing in it was changed)", run_dir="run_dir")


def holds_model(run_dir: Path) -> bool:
    """Whether the folder holds a model that was not trained in it: a best checkpoint alone whose header
    has no training settings (what import-hf and merge write), or one too damaged to say."""
    if has_checkpoint(run_dir, LAST) or not has_checkpoint(run_dir, BEST):
        return False
    try:
        return load_header(run_dir, BEST).train_config is None
    except ValueError:
        return True


def is_run_folder(path: Path) -> bool:
    """Whether `path` holds a gptlab run: a checkpoint, or the config.json a run writes first."""
    if has_checkpoint(path):
        return True
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"model", "train"} <= set(config)


def check_settings(model_config: ModelConfig, train_config: TrainConfig, world_size: int) -> None:
    """Refuse, by field, settings that do not go together on a launch of `world_size` processes, and a
    `TrainConfig.log` destination whose package is missing: every rank checks alike, before any work."""
    if train_config.batch_size % world_size:
        raise ValueError(
            f"batch_size={train_config.batch_size} is not divisible by the {world_size} "
            f"processes: choose a multiple of {world_size}"
        )
    seq2seq = architecture(model_config) != "decoder"
    if train_config.track_heads and seq2seq:
        raise SettingError("{track_heads} scores a GPT's self-attention heads; it is not offered for seq2seq "
                           "runs", track_heads="TrainConfig.track_heads")
    if train_config.track_heads and train_config.parallel == "fsdp" and world_size > 1:
        raise SettingError("{track_heads} runs the whole model on the main process, which {parallel} fsdp "
                           "shards: use {parallel} ddp", track_heads="TrainConfig.track_heads",
                           parallel="TrainConfig.parallel")
    sinks.check_installed(train_config.log)
    if train_config.seq_warmup and seq2seq:
        raise SettingError("{seq_warmup} grows the windows of text runs; a task's examples have their own "
                           "lengths: leave it at 0 for seq2seq runs", seq_warmup="TrainConfig.seq_warmup")


def start_run(run_dir: Path, data: TrainingData, model_config: ModelConfig, train_config: TrainConfig,
              dist: distributed.Dist, device: torch.device) -> TrainConfig:
    """Start a new run: check the window, decide what depends on this machine, write config.json (rank 0)
    and check the settings; the training config the run trains with."""
    data.check_window(model_config.block_size)
    train_config, machine_record = decide_for_machine(model_config, train_config, dist, device)
    if dist.is_main:
        write_run_config(run_dir, model_config, train_config, data, machine_record)
    check_settings(model_config, train_config, dist.world_size)
    return train_config


def decide_for_machine(model_config: ModelConfig, train_config: TrainConfig, dist: distributed.Dist,
                       device: torch.device) -> tuple[TrainConfig, dict[str, Any]]:
    """A new run's precisions as `machine.decide` chooses them on rank 0 for one rank's micro-batch (every
    rank takes rank 0's answer), the decisions line logged, and config.json's "machine" entry."""
    auto, muon = train_config.precision == "auto", train_config.optimizer == "muon"
    rows = max(1, train_config.batch_size // dist.world_size)  # one rank's micro-batch
    decisions: list[machine.Decision] = []  # made, logged and saved by rank 0 only
    if dist.is_main:
        decisions = machine.decide(device, model_config, rows, precision=train_config.precision,
                                   muon_precision=train_config.muon_precision if muon else None)
    chosen = {decision.name: decision.value for decision in decisions}
    if auto:
        bfloat16 = float(chosen.get("precision") == "bfloat16")
        shared = distributed.all_reduce_sum([bfloat16], device)[0] > 0  # rank 0's answer, on every rank
        train_config = train_config.replace(precision="bfloat16" if shared else "float32")
    if muon:  # rank 0's answer on every rank, so the replicas stay equal
        float32 = float(chosen.get("muon_precision") == "float32")
        shared = distributed.all_reduce_sum([float32], device)[0] > 0
        train_config = train_config.replace(muon_precision="float32" if shared else "bfloat16")
    log.info(machine.describe(decisions, auto))  # rank 0's line: the others log warnings only
    return train_config, machine.record(decisions)


def write_run_config(run_dir: Path, model_config: ModelConfig, train_config: TrainConfig,
                     data: TrainingData, machine_record: dict[str, Any] | None = None) -> None:
    """The resolved settings as readable JSON beside the checkpoints, with what was decided for the
    machine the run started on (`machine_record`, when known)."""
    resolved = {"model": model_config.to_dict(), "train": train_config.to_dict(),
                **({"machine": machine_record} if machine_record else {}), **portable(data.state(), run_dir)}
    atomic_write_text(run_dir / "config.json", json.dumps(resolved, indent=2) + "\n")


def saved_machine(run_dir: Path) -> dict[str, Any] | None:
    """The "machine" entry of a run's config.json, kept when a resumed run rewrites the file."""
    try:
        return json.loads((run_dir / "config.json").read_text(encoding="utf-8")).get("machine")
    except (OSError, ValueError, AttributeError):
        return None


def prepare_for_run(source: str | Path, run_dir: Path, tokenizer: str | Tokenizer, vocab_size: int | None,
                    is_main: bool, progress: bool) -> Path:
    """Prepare text into RUN/data on the main process while the others wait; the prepared folder."""
    if is_main:
        which = f"the {tokenizer}" if isinstance(tokenizer, str) else "the checkpoint's"
        log.info(f"preparing {source} with {which} tokenizer into {run_dir / 'data'}")
        prepare(str(source), run_dir / "data", tokenizer=tokenizer, vocab_size=vocab_size,
                progress=progress and on_terminal())
    distributed.barrier()  # under torchrun the other ranks wait for rank 0's data
    return run_dir / "data"


def point_link(link: Path, run_dir: Path) -> str | None:
    """Point the symlink `link` at `run_dir` (relative, replacing an older link atomically); None when it
    points there, else why it was left alone: a file or folder already there, or no symlinks here."""
    if link.absolute() == run_dir.absolute():
        return None  # the run is at that path itself
    if not link.is_symlink() and link.exists():
        return f"{link} is not a link (a file or folder is there): left as it is"
    target = os.path.relpath(run_dir.absolute(), link.absolute().parent)
    temporary = link.with_name(f".{link.name}.{os.getpid()}.link")
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(target, target_is_directory=True)
        os.replace(temporary, link)  # rename() swaps the link in one step: never a moment without it
    except OSError as err:
        temporary.unlink(missing_ok=True)
        return f"could not point {link} at {run_dir} ({err.strerror or err})"
    return None
