"""Heads over training: detector scores as columns of metrics.csv, and their curves beside the loss.

`gptlab train --track-heads` calls `head_metrics` at every evaluation; the columns are the probe's
repeat loss and one `L{layer}H{head}_{detector}` per head and detector (see `detectors`). `gptlab heads
RUN --history` reads them back and draws each head's scores against steps beside the loss curves, so
the evaluation where an induction head forms, and the drop of the loss on repeated text with it, show.

Shape legend: S evaluations, L layers, H heads.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.config import SettingError
from gptlab.files import save_png
from gptlab.inspection.detectors import DETECTORS, score_heads
from gptlab.model import GPT

REPEAT_LOSS = "repeat_loss"
COLUMN = re.compile(r"L(\d+)H(\d+)_(\w+)")
LABELLED_HEADS = 3  # per detector, the heads named in the legend (highest last score first)


def head_columns(n_layer: int, n_head: int) -> tuple[str, ...]:
    """The metrics.csv columns of --track-heads: the repeat loss, then every head's four scores."""
    return (REPEAT_LOSS, *(f"L{layer}H{head}_{d}" for d in DETECTORS for layer in range(n_layer)
                           for head in range(n_head)))


def head_metrics(model: GPT, seed: int) -> dict[str, float]:
    """One evaluation's values of `head_columns`, measured in eval mode on the detectors' probe."""
    scores = score_heads(model, seed)
    values = {REPEAT_LOSS: scores.repeat_loss}
    for row in scores.rows():
        values |= {f"L{row['layer']}H{row['head']}_{d}": row[d] for d in DETECTORS}
    return values


def head_summary(values: dict[str, float]) -> str:
    """", repeat loss 0.52; best induction L1H3 0.81, ..." for a training log line ("" without values)."""
    if not values:
        return ""
    best = []
    for d in DETECTORS:
        name = max((k for k in values if k.endswith(f"_{d}")), key=values.__getitem__)
        best.append(f"{d.replace('_', '-')} {name.removesuffix(f'_{d}')} {values[name]:.2f}")
    return f"; repeat loss {values[REPEAT_LOSS]:.3f}; best heads: {', '.join(best)}"


@dataclass(frozen=True)
class HeadHistory:
    """Losses and head scores at every evaluation of a run trained with --track-heads."""

    steps: list[int]
    losses: dict[str, list[float]]  # train_loss, val_loss, repeat_loss
    scores: dict[str, torch.Tensor]  # detector -> (S, L, H)

    def rise(self, detector: str = "induction") -> tuple[int, int, float]:
        """(step before, step after, increase) of the largest jump of the best head's score."""
        best = self.scores[detector].flatten(1).max(dim=1).values  # (S,)
        if len(best) < 2:
            return self.steps[0], self.steps[0], 0.0
        jumps = best.diff()  # (S - 1,)
        i = int(jumps.argmax())
        return self.steps[i], self.steps[i + 1], float(jumps[i])


def read_history(run: str | Path) -> HeadHistory:
    """The head scores in a run folder's metrics.csv; a ValueError if it was trained without track_heads."""
    run = Path(run)
    path = (run if run.is_dir() else run.parent) / "metrics.csv"
    if not path.is_file():
        raise SettingError(f"{path} does not exist: {{h}} reads the metrics.csv of a run folder trained "
                           "with gptlab train --track-heads", h="read_history")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    heads = [(int(m[1]), int(m[2]), m[3]) for m in map(COLUMN.fullmatch, rows[0] if rows else ())
             if m and m[3] in DETECTORS]
    if not heads:
        raise SettingError(f"{path} holds no head scores: train with {{t}} to record them at every "
                           "evaluation (gptlab train ... --track-heads)", t="TrainConfig.track_heads")
    n_layer, n_head = max(h[0] for h in heads) + 1, max(h[1] for h in heads) + 1
    scores = {d: torch.tensor([[[float(row[f"L{layer}H{head}_{d}"]) for head in range(n_head)]
                                for layer in range(n_layer)] for row in rows]) for d in DETECTORS}
    losses = {name: [float(row[name]) for row in rows] for name in ("train_loss", "val_loss", REPEAT_LOSS)}
    return HeadHistory([int(row["step"]) for row in rows], losses, scores)


def save_history_png(history: HeadHistory, path: str | Path, title: str) -> None:
    """The losses, then one panel per detector with every head's score against steps.

    The largest jump of the best induction score is marked in every panel.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * (1 + len(DETECTORS)), 3.4), dpi=110, layout="constrained")
    axes = fig.subplots(1, 1 + len(DETECTORS), sharex=True)
    names = {"train_loss": "train", "val_loss": "validation", REPEAT_LOSS: "repeats (2nd half)"}
    for name, label in names.items():
        axes[0].plot(history.steps, history.losses[name], marker="o", markersize=2, label=label)
    axes[0].set_ylabel("loss (nats per token)")
    axes[0].set_title("loss", fontsize=10)
    axes[0].legend(fontsize=7)
    before, after, _ = history.rise("induction")
    for ax, detector in zip(axes[1:], DETECTORS, strict=True):
        scores = history.scores[detector].flatten(1)  # (S, L * H)
        n_head = history.scores[detector].size(2)
        labelled = scores[-1].argsort(descending=True)[:LABELLED_HEADS].tolist()
        for column in range(scores.size(1)):
            layer, head = divmod(column, n_head)
            if column in labelled:
                ax.plot(history.steps, scores[:, column], linewidth=1.6, label=f"L{layer}H{head}")
            else:  # the others in grey, so the heads that found a job stand out
                ax.plot(history.steps, scores[:, column], color="0.75", linewidth=0.8)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(detector.replace("_", "-"), fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes:
        ax.axvspan(before, after, color="tab:red", alpha=0.12)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: heads over training (shaded: the largest rise of the best induction score)",
                 fontsize=10)
    save_png(fig, path)
