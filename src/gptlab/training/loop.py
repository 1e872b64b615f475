"""Training with teacher forcing (§7.2): every window scores all its next tokens at once.

AdamW with weight decay on matrices only, linear warm-up then a cosine or trapezoidal decay, gradient
clipping and accumulation, bfloat16 autocast where it is faster. A run folder holds `config.json`,
`metrics.csv` (a row per evaluation), `steps.csv` (a row per step), `loss.png`, the dashboards `log`
asks for (gptlab.training.sinks) and two checkpoints (`last`, `best`); the checkpoint carries the optimiser,
the step and every random state, so N steps in one go and N/2 + resume + N/2 give identical weights.
Ctrl-C (or SIGTERM) stops at the next step boundary and saves, abandoning a running evaluation (the
resumed run does it first); a second one aborts at once. A progress bar is drawn only on a terminal;
elsewhere (a log file, CI) the one line per evaluation is the progress.

The loop is the same for both architectures: its data source (`TrainingData`) is a prepared text
folder for the decoder-only model or a built-in task (gptlab.seq2seq.tasks) for the encoder-decoder; a batch
is the model's inputs followed by its targets, and the source adds its own metrics to each evaluation.

Under torchrun every process runs this same loop (see distributed.py): each step draws one global
batch of `batch_size` windows from the shared sampler and each rank trains on its own slice, so the
run computes what one process with the whole batch would (to rounding, and without dropout: each
rank draws its own dropout masks), and only rank 0 logs and writes files.

The run folder, its start-up checks and config.json are gptlab.training.runs; continuing a run is
gptlab.training.resume.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from gptlab.checkpoint import (
    BEST,
    LAST,
    Checkpoint,
    architecture,
    load_checkpoint,
    new_model,
    portable,
    require_architecture,
    save_to_run,
)
from gptlab.common import autocast, on_terminal, resolve_precision, seed_everything
from gptlab.config import ModelConfig, Seq2SeqConfig, SettingError, TaskConfig, TrainConfig
from gptlab.data.tokens import TokenData
from gptlab.inspection.history import head_columns, head_metrics, head_summary
from gptlab.model import GPT
from gptlab.seq2seq.model import EncoderDecoder
from gptlab.seq2seq.tasks import TaskData
from gptlab.training import distributed, sinks
from gptlab.training.curriculum import batch_size_at, block_size_at
from gptlab.training.logs import MetricsLog, plot_losses
from gptlab.training.optim import learning_rate, make_optimizer, set_learning_rate
from gptlab.training.runs import TrainingData, prepare_for_run, run_folder, start_run

log = logging.getLogger("gptlab.training.loop")


class TrainingDiverged(SettingError):
    """The loss became NaN or infinite; the weights of the last checkpoint are kept."""


@dataclass(frozen=True)
class StepResult:
    """What one optimiser step gives the loop: its loss and gradient norm, and whether to stop or save."""

    loss: float  # the mean over every scored target of the step, on all ranks
    grad_norm: float  # the global gradient norm before clipping
    stop: bool
    save: bool


def saves_shards(config: TrainConfig, world_size: int) -> bool:
    """Whether the run saves sharded checkpoints (`checkpoint_format`; auto: under FSDP on several
    processes, where gathering the whole model to one process is the memory ceiling)."""
    if config.checkpoint_format == "auto":
        return config.parallel == "fsdp" and world_size > 1
    return config.checkpoint_format == "sharded"


def rank_rows(batch_size: int, dist: distributed.Dist) -> slice:
    """This rank's equal share of a global batch of `batch_size` windows (a multiple of the world size)."""
    share = batch_size // dist.world_size
    return slice(dist.rank * share, (dist.rank + 1) * share)


def gradient_norm(model: nn.Module) -> torch.Tensor:
    """The global L2 norm of the gradients, as clip_grad_norm_ measures it, leaving them as they are."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


@dataclass(frozen=True)
class TrainResult:
    """What a call to `train` or `resume` achieved."""

    run_dir: Path
    step: int
    best_val_loss: float
    last_val_loss: float
    elapsed_s: float
    tokens_per_s: float
    interrupted: bool
    signal: int | None = None  # the signal that interrupted the run (SIGINT, SIGTERM), if one did

    @property
    def exit_status(self) -> int:
        """What the command exits with: 0 when finished, else 128 + the signal (130 Ctrl-C, 143 SIGTERM)."""
        return 128 + (self.signal or signal.SIGINT) if self.interrupted else 0


@torch.no_grad()
def estimate_losses(model: torch.nn.Module, data: TrainingData, config: TrainConfig, block_size: int,
                    device: torch.device, dtype: torch.dtype,
                    should_stop: Callable[[], bool]) -> dict[str, float] | None:
    """Mean loss on the same `eval_batches` random windows of each split at every evaluation; None when
    `should_stop()` turns true before one of its batches (abandoned)."""
    model.eval()
    generator = torch.Generator().manual_seed(config.seed + 1)  # its own stream: training's is untouched
    losses = {}
    try:
        for split in ("train", "val"):
            total = 0.0
            for _ in range(config.eval_batches):
                if should_stop():
                    return None
                batch = data.get_batch(split, config.batch_size, block_size, generator)
                with autocast(device, dtype):
                    _, loss = model(*(t.to(device) for t in batch))
                total += loss.item()
            losses[split] = total / config.eval_batches
    finally:
        model.train()
    return losses


class StopOnInterrupt:
    """The first Ctrl-C or SIGTERM asks the loop to stop at the next step boundary; a second aborts."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the first signal received
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signal = True, signum

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One training run: the model, optimiser, data stream and counters, restorable from a checkpoint.

    `config` is the model's config and `train_config` the training's. The process group of a torchrun
    launch (`dist`, `device`) is joined by the caller, `train` or `resume`, which also checks first that
    the settings go together there (`runs.check_settings`).
    """

    def __init__(self, run_dir: Path, data: TrainingData, config: ModelConfig, train_config: TrainConfig,
                 dist: distributed.Dist, device: torch.device, checkpoint: Checkpoint | None = None,
                 progress: bool = True, init_from: Checkpoint | None = None,
                 model: GPT | EncoderDecoder | None = None, patience: int = 0) -> None:
        """`checkpoint` resumes a run exactly; `init_from` only supplies starting weights (fine-tuning).

        `model`, when given, is trained instead of a new model of `config` and already holds its starting
        weights (a base with adapters, say): only its parameters that require grad are trained, and only
        they are saved. `patience` > 0 stops once that many evaluations in a row have not improved the
        best validation loss (early stopping).
        """
        self.run_dir, self.data = run_dir, data
        self.config, self.train_config = config, train_config
        self.dist, self.device = dist, device
        self.progress = progress and dist.is_main and on_terminal()  # else the evaluation lines alone
        self.dtype = resolve_precision(train_config.precision, device, config.n_embd)
        self.shard = saves_shards(train_config, dist.world_size)
        seed_everything(train_config.seed)
        if model is None:
            model = new_model(config)
            start = checkpoint or init_from
            if start is not None and not start.lazy:  # a lazy one is loaded shard by shard once wrapped
                start.load_weights(model)
        self.frozen = {name for name, p in model.named_parameters(remove_duplicate=False)
                       if not p.requires_grad}
        self.patience, self.stale = patience, 0  # stale: evaluations since the best one
        self.evaluation_due = False  # an evaluation of this step was abandoned: the resumed run does it
        self.model = distributed.wrap(model.to(device), train_config.parallel, dist, device)
        self.optimizer = make_optimizer(self.model, train_config)
        self.batches = torch.Generator().manual_seed(train_config.seed)  # the data sampler's state
        self.step, self.best_val, self.last_val = 0, math.inf, math.nan
        self.train_time, self.tokens_seen = 0.0, 0
        self.last_saved = time.perf_counter()  # when `last` was last written, for `save_every`
        if checkpoint is not None:
            self._restore(checkpoint)
        self.forward_model = torch.compile(self.model) if train_config.compile else self.model
        self.resumed = checkpoint is not None
        resume_step = self.step if checkpoint else None
        heads = head_columns(config.n_layer, config.n_head) if train_config.track_heads else ()
        self.metrics = (MetricsLog(run_dir / "metrics.csv", (*data.metric_names, *heads), resume_step)
                        if dist.is_main else None)
        configs = {"model": config.to_dict(), "train": train_config.to_dict()}
        self.sinks = sinks.Sinks(run_dir, train_config.log, configs, resume_step) if dist.is_main else None
        log.info(f"{model.num_parameters():,} parameters on {device} in "
                 f"{str(self.dtype).removeprefix('torch.')}, "
                 f"{train_config.batch_size * train_config.grad_accum:,} sequences per step, "
                 f"{dist.world_size} process(es), from step {self.step} to {train_config.max_steps}")

    def _restore(self, checkpoint: Checkpoint) -> None:
        assert checkpoint.optimizer_state is not None, "a training checkpoint carries its optimiser"
        if checkpoint.lazy:  # each rank reads its own shards of a sharded checkpoint
            skip = self.frozen | ({"lm_head.weight"} if self.config.tied else set())
            distributed.load_shards(self.model, self.optimizer, Path(checkpoint.source), skip)
        else:
            slots = checkpoint.optimizer_state
            if slots:  # frozen parameters never have optimiser slots
                slots = {**{name: {} for name in self.frozen}, **slots}
            distributed.load_optimizer_state(self.model, self.optimizer, slots)
        state = checkpoint.state
        self.step, self.best_val = state["step"], state["best_val_loss"]
        self.stale = state.get("stale_evaluations", 0)
        self.evaluation_due = state.get("evaluation_due", False)
        self.last_val = state["last_val_loss"]
        self.train_time, self.tokens_seen = state["train_time_s"], state["tokens_seen"]
        torch.set_rng_state(checkpoint.rng["torch"])
        self.batches.set_state(checkpoint.rng["data"])
        if "cuda" in checkpoint.rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(checkpoint.rng["cuda"], self.device)

    def checkpoint(self) -> Checkpoint:
        """Everything needed to continue; a collective call under FSDP (every rank must make it). A sharded
        run keeps each rank's own shards, unsent."""
        rng = {"torch": torch.get_rng_state(), "data": self.batches.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        state = {"step": self.step, "best_val_loss": self.best_val, "last_val_loss": self.last_val,
                 "train_time_s": self.train_time, "tokens_seen": self.tokens_seen,
                 "stale_evaluations": self.stale, "evaluation_due": self.evaluation_due,
                 **portable(self.data.state(), self.run_dir)}
        # Frozen weights (a base under adapters) are not saved: the data's state says where they are.
        gather = not self.shard
        weights = {name: tensor for name, tensor in distributed.model_state(self.model, gather).items()
                   if name not in self.frozen}
        if self.config.tied:  # stored once, as the embedding
            weights.pop("lm_head.weight", None)
        return Checkpoint(self.config, self.data.tokenizer.to_dict(), weights, self.train_config, state,
                          distributed.optimizer_state(self.model, self.optimizer, gather), rng)

    def save(self, checkpoint: Checkpoint, names: list[str]) -> None:
        """Save `checkpoint` as `names`: sharded by every rank, or as files by the main process."""
        if self.shard or self.dist.is_main:
            save_to_run(self.run_dir, names, checkpoint, self.shard)
        self.last_saved = time.perf_counter()

    def train_step(self, stop_requested: bool, save_due: bool) -> StepResult:
        """One optimiser step over `grad_accum` micro-batches: the mean loss, the gradient norm, whether to
        stop now and whether to save now (decided together on every rank, so that collective saves stay
        in step)."""
        cfg = self.train_config
        set_learning_rate(self.optimizer, self.step, cfg)
        distributed.seed_dropout(cfg.seed, self.dist, self.step)  # ranks but 0 restart their masks' stream
        # The step's loss is the mean over every scored target of its micro-batches, on all ranks.
        # Padded (seq2seq) batches score different numbers of targets per slice, so each slice's mean
        # is weighted by its share of them; DDP's averaging over ranks is undone by the world size.
        # batch_size and block_size, or smaller during --batch-warmup / --seq-warmup: the step decides.
        size = batch_size_at(self.step, cfg, self.dist.world_size)
        window = block_size_at(self.step, cfg, self.config.block_size)
        batches = [self.data.get_batch("train", size, window, self.batches) for _ in range(cfg.grad_accum)]
        rows = rank_rows(size, self.dist)  # this rank's windows of this step's batch
        scored = sum(int((batch[-1] != -1).sum()) for batch in batches)  # over every rank's rows
        self.tokens_seen += scored
        total = 0.0
        for micro, batch in enumerate(batches):
            batch = tuple(t[rows].to(self.device) for t in batch)  # this rank's share
            share = int((batch[-1] != -1).sum()) / scored
            with distributed.gradient_sync(self.model, micro == cfg.grad_accum - 1):
                with autocast(self.device, self.dtype):
                    _, loss = self.forward_model(*batch)
                (loss * (share * self.dist.world_size)).backward()
            total += loss.item() * share
        # One small all-reduce: every rank sees the same mean loss and the same decisions.
        total, stops, saves = distributed.all_reduce_sum([total, float(stop_requested), float(save_due)],
                                                         self.device)
        if not math.isfinite(total):
            raise TrainingDiverged(
                f"the training loss became {total} at step {self.step}; stopped without saving, so "
                f"{self.run_dir / LAST} still holds the last good weights: lower {{lr}} (now {cfg.lr}) "
                "or use {precision} float32", lr="TrainConfig.lr", precision="TrainConfig.precision"
            )
        if cfg.grad_clip > 0:  # it returns the norm it measured before clipping
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        else:
            norm = gradient_norm(self.model)
        # Read before the optimiser's work is queued, so the one wait is for the norm alone.
        grad_norm = (norm.full_tensor() if distributed.is_sharded(norm) else norm).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total, grad_norm, stops > 0, saves > 0)

    def log_step(self, result: StepResult, seconds: float, tokens: int) -> None:
        """Send the step just taken (`self.step`, counted from 1) to the sinks: `tokens` scored targets in
        `seconds`. Its learning rate is the one it used, set for step index self.step - 1."""
        if self.sinks is None:
            return
        self.sinks.log(self.step, {
            "train/loss": result.loss, "train/lr": learning_rate(self.step - 1, self.train_config),
            "train/grad_norm": result.grad_norm, "train/tokens_per_s": tokens / seconds,
            "train/elapsed_s": self.train_time,
        })

    def evaluate_and_save(self, should_stop: Callable[[], bool]) -> bool:
        """Evaluate, append a metrics row, redraw the plot, and save `last` (and `best` if improved); False,
        recording and saving nothing, when `should_stop()` abandoned the evaluation."""
        losses = estimate_losses(self.model, self.data, self.train_config, self.config.block_size,
                                 self.device, self.dtype, should_stop)
        self.evaluation_due = losses is None
        if losses is None:
            return False
        self.last_val = losses["val"]
        # The untrained model at step 0 is never "best": a run stopped before its next evaluation is then
        # read from its last checkpoint, not from random weights.
        improved = self.step > 0 and losses["val"] < self.best_val  # what patience counts
        self.best_val = min(self.best_val, losses["val"]) if self.step > 0 else self.best_val
        self.stale = 0 if improved else self.stale + (self.step > 0)
        saves_best = improved or (self.step > 0 and not self.data.selects_best)
        checkpoint = self.checkpoint()  # on every rank: gathering sharded weights is collective
        if self.metrics is not None:
            self.report(losses)
        self.save(checkpoint, [BEST, LAST] if saves_best else [LAST])
        if self.dist.is_main:
            plot_losses(self.run_dir / "metrics.csv", self.run_dir / "loss.png", title=self.run_dir.name,
                        steps_csv=self.run_dir / "steps.csv")
        return True

    def report(self, losses: dict[str, float]) -> None:
        """The main process's record of an evaluation: metrics.csv, the sinks and the log line."""
        assert self.metrics is not None and self.sinks is not None, "rank 0 holds both"
        self.model.eval()
        model = distributed.unwrap(self.model)
        extra = self.data.metrics(model, losses, self.train_config.seed + 2, self.device)
        # Head scores use their own generator and run in eval mode: training's random streams are
        # untouched, so a run with --track-heads resumes as exactly as one without.
        heads = {}
        if self.train_config.track_heads:
            assert isinstance(model, GPT), "runs.check_settings refuses track_heads for other models"
            heads = head_metrics(model, self.train_config.seed + 3)
        self.model.train()
        self.metrics.append(
            step=self.step, train_loss=losses["train"], val_loss=losses["val"], **extra, **heads,
            lr=learning_rate(self.step, self.train_config), tokens_per_s=self.tokens_per_s(),
            elapsed_s=self.train_time,
        )
        self.sinks.log(self.step, {
            "eval/train_loss": losses["train"], "eval/val_loss": losses["val"],
            **{f"eval/{name}": value for name, value in extra.items() if not isinstance(value, str)},
            **{f"heads/{name}": value for name, value in heads.items()},
        })
        # Both losses are estimates on eval_batches sampled batches, and the line says so: the figure of
        # record is gptlab.training.final's, at the end.
        batches = self.train_config.eval_batches
        shown = "".join(f", {name.removeprefix('val_').replace('_', ' ')} {value:.4g}"
                        for name, value in extra.items() if value != "")
        log.info(f"step {self.step}/{self.train_config.max_steps}: train loss {losses['train']:.4f}, "
                 f"val loss {losses['val']:.4f} (estimate, {batches} batch{'es' * (batches > 1)}{shown}), "
                 f"{self.tokens_per_s():,.0f} tokens/s, {self.train_time:.0f} s{head_summary(heads)}")

    def save_last(self) -> None:
        """Save `last` without evaluating: when interrupted, and every `save_every` seconds of training."""
        self.save(self.checkpoint(), [LAST])  # on every rank: gathering sharded weights is collective

    def save_due(self) -> bool:
        """Whether `save_every` seconds have passed since the last save (rank 0's clock decides)."""
        every = self.train_config.save_every
        return self.dist.is_main and every > 0 and time.perf_counter() - self.last_saved >= every

    def tokens_per_s(self) -> float:
        return self.tokens_seen / self.train_time if self.train_time else 0.0

    def out_of_patience(self) -> bool:
        """Whether early stopping is on and the last `patience` evaluations did not improve the best."""
        return 0 < self.patience <= self.stale

    def run(self, stop_at: int | None = None) -> TrainResult:
        """Train until `max_steps` (or `stop_at`), evaluating and saving every `eval_interval` steps; the
        sinks are closed however the run ends."""
        try:
            return self._run(stop_at)
        finally:
            if self.sinks is not None:
                self.sinks.close()

    def _run(self, stop_at: int | None) -> TrainResult:
        max_steps = self.train_config.max_steps
        end = min(stop_at, max_steps) if stop_at is not None else max_steps
        stopping = False
        with StopOnInterrupt() as stop, tqdm(total=max_steps, initial=self.step, unit="step",
                                             disable=not self.progress, dynamic_ncols=True) as bar:
            def should_stop() -> bool:  # asked between evaluation batches, the same answer on every rank
                return distributed.all_reduce_sum([float(stop.requested)], self.device)[0] > 0

            if self.evaluation_due or self.step == 0 and not self.resumed and (
                    self.train_config.eval_interval < max_steps or end == 0):
                # The evaluation an interruption abandoned, or the untrained baseline, so the curve starts
                # at step 0; a run that evaluates only at its end (a timed recipe) has no curve to start
                # and skips it, unless it stops right here. A run resumed from its step-0 checkpoint
                # logged it already.
                stopping = not self.evaluate_and_save(should_stop)
            while self.step < end and not stopping and not self.out_of_patience():
                started, tokens = time.perf_counter(), self.tokens_seen
                result = self.train_step(stop.requested, self.save_due())
                seconds = time.perf_counter() - started
                self.train_time += seconds
                self.step += 1
                stopping, save_now = result.stop, result.save
                self.log_step(result, seconds, self.tokens_seen - tokens)
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{self.tokens_per_s():,.0f}")
                if self.step % self.train_config.eval_interval == 0 or self.step == end:
                    # A stop asked for during the step (or the evaluation) abandons it: it stays due.
                    stopping = not self.evaluate_and_save(should_stop)
                    if self.out_of_patience():
                        log.info(f"early stop: {self.stale} evaluations without a better validation loss "
                                 f"(best {self.best_val:.4f}, in {self.run_dir / BEST})")
                elif save_now and not stopping:
                    self.save_last()
            if stopping:
                due = " (its evaluation abandoned: resuming does it first)" if self.evaluation_due else ""
                log.info(f"interrupted: saving step {self.step} to {self.run_dir / LAST}{due}")
                self.save_last()
        return TrainResult(self.run_dir, self.step, self.best_val, self.last_val, self.train_time,
                           self.tokens_per_s(), stopping, stop.signal if stopping else None)


def train(run_dir: str | Path, data: str | Path, model_config: ModelConfig, train_config: TrainConfig, *,
          tokenizer: str = "char", vocab_size: int | None = None, stop_at: int | None = None,
          progress: bool = True, init_from: str | Path | None = None) -> TrainResult:
    """Start a new run in `run_dir` on `data`; vocab_size is taken from the data's tokenizer.

    `data` is a prepared folder, or text (a built-in corpus, a file, a folder, a glob) that is first
    prepared into RUN/data with `tokenizer` (and `vocab_size` for bpe). With `init_from` (a run folder
    or checkpoint) the model, its starting weights and the tokenizer come from that checkpoint:
    fine-tuning. Under torchrun every process calls this; rank 0 prepares the data and writes files.
    """
    run_dir = Path(run_dir)
    start: Checkpoint | None = None
    if init_from is not None:
        start = load_checkpoint(init_from)
        require_architecture(architecture(start.model_config), init_from, "decoder")
        model_config = start.model_config
    with run_folder(run_dir, new=True), distributed.session(train_config.device) as (dist, device):
        if not (Path(data) / "meta.json").is_file():
            text_tokenizer = start.load_tokenizer() if start else tokenizer
            data = prepare_for_run(data, run_dir, text_tokenizer, vocab_size, dist.is_main, progress)
        token_data = TokenData(data)
        if start is not None and token_data.tokenizer.to_dict() != start.tokenizer:
            raise ValueError(f"{data} was prepared with another tokenizer than {init_from}'s: give the text "
                             "itself as the data, and it is prepared with the checkpoint's tokenizer")
        model_config = model_config.replace(vocab_size=token_data.tokenizer.vocab_size)
        train_config = start_run(run_dir, token_data, model_config, train_config, dist, device)
        trainer = Trainer(run_dir, token_data, model_config, train_config, dist, device, progress=progress,
                          init_from=start)
        return trainer.run(stop_at)


def train_seq2seq(run_dir: str | Path, task_config: TaskConfig, model_config: Seq2SeqConfig,
                  train_config: TrainConfig, *, stop_at: int | None = None,
                  progress: bool = True) -> TrainResult:
    """Start a new encoder-decoder run in `run_dir` on a built-in task; the vocabulary is the task's."""
    run_dir = Path(run_dir)
    if train_config.parallel == "fsdp":
        raise SettingError("{parallel} fsdp is not offered for seq2seq runs (exact-match decoding needs the "
                           "whole model on each process): use {parallel} ddp",
                           parallel="TrainConfig.parallel")
    data = TaskData(task_config)
    model_config = model_config.replace(vocab_size=data.tokenizer.vocab_size, pad_id=0)
    with run_folder(run_dir, new=True), distributed.session(train_config.device) as (dist, device):
        train_config = start_run(run_dir, data, model_config, train_config, dist, device)
        trainer = Trainer(run_dir, data, model_config, train_config, dist, device, progress=progress)
        return trainer.run(stop_at)
