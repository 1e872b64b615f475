"""Per-run metrics: a CSV row per evaluation and the loss-curve picture drawn from it."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from gptlab.files import atomic_write_text


class MetricsLog:
    """Appends evaluation rows to `metrics.csv`; on resume, forgets rows after the resumed step.

    Columns: step, the two losses, the data source's own metrics (`extra`), lr, throughput, time.
    """

    def __init__(self, path: Path, extra: tuple[str, ...] = (), resume_step: int | None = None) -> None:
        self.path = path
        self.columns = ("step", "train_loss", "val_loss", *extra, "lr", "tokens_per_s", "elapsed_s")
        rows = []
        if resume_step is not None and path.exists():
            rows = [row for row in self.read() if int(row["step"]) <= resume_step]
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, table.getvalue())  # a kill now never loses the earlier rows

    def append(self, **values: float) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow({k: values.get(k, "") for k in self.columns})

    def read(self) -> list[dict[str, str]]:
        with self.path.open(newline="") as f:
            return list(csv.DictReader(f))


def perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged loss prints as inf rather than raising."""
    return math.exp(loss) if loss < 700 else math.inf


def plot_losses(metrics_csv: Path, png: Path, title: str) -> None:
    """Draw train and validation loss against step into `png` (headless, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with metrics_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for column, label in (("train_loss", "train"), ("val_loss", "validation")):
        ax.plot(steps, [float(r[column]) for r in rows], marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(png)
