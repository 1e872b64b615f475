"""Per-run metrics: CSV logs that survive a kill and a resume, and the loss-curve picture drawn from them.

`metrics.csv` holds a row per evaluation (MetricsLog) and `steps.csv` a row per optimiser step (see
gptlab.training.sinks); `loss.png` draws both: every step's training loss, raw and smoothed, under the
evaluations.
"""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Sequence
from pathlib import Path

from gptlab.files import atomic_write_text


class CsvLog:
    """Appends rows with fixed `columns` (the first is "step") to a CSV file; on resume, forgets the rows
    after the resumed step, which a killed run wrote after its last checkpoint and will write again."""

    def __init__(self, path: Path, columns: Sequence[str], resume_step: int | None = None) -> None:
        assert columns[0] == "step", "rows are kept or forgotten by their step"
        self.path, self.columns = path, tuple(columns)
        rows = []
        if resume_step is not None and path.exists():
            rows = [row for row in self.read() if int(row["step"]) <= resume_step]
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, table.getvalue())  # a kill now never loses the earlier rows

    def append(self, **values: float | str) -> None:
        """Write one row (a missing column is left empty) and close the file, so a kill keeps it."""
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow({k: values.get(k, "") for k in self.columns})

    def read(self) -> list[dict[str, str]]:
        return read_rows(self.path)


class MetricsLog(CsvLog):
    """`metrics.csv`, a row per evaluation: step, the two losses, the data source's own metrics (`extra`),
    lr, throughput, time."""

    def __init__(self, path: Path, extra: tuple[str, ...] = (), resume_step: int | None = None) -> None:
        super().__init__(path, ("step", "train_loss", "val_loss", *extra, "lr", "tokens_per_s", "elapsed_s"),
                         resume_step)


def smoothed(values: Sequence[float], radius: int) -> list[float]:
    """Each value replaced by the mean of the window of `radius` values either side of it, narrowed near
    the ends so that it stays centred: unlike a moving average that only looks back (TensorBoard's), the
    curve does not lag behind a loss that falls fast."""
    sums = [0.0, *itertools.accumulate(values)]  # sums[i]: the sum of the first i values
    last = len(values) - 1
    windows = ((i - r, i + r + 1) for i, r in ((i, min(radius, i, last - i)) for i in range(len(values))))
    return [(sums[end] - sums[start]) / (end - start) for start, end in windows]


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV log; none when the file is missing (a run from before steps.csv existed)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def plot_losses(metrics_csv: Path, png: Path, title: str, steps_csv: Path | None = None) -> None:
    """Draw the losses against step into `png` (headless, matplotlib's Agg backend): the evaluations'
    train and validation points from `metrics_csv`, over every step's training loss from `steps_csv`
    (raw, faint, and smoothed) when there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(metrics_csv)
    steps = [int(r["step"]) for r in rows]
    logged = [r for r in read_rows(steps_csv) if r["loss"]] if steps_csv is not None else []
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if logged:
        x, loss = [int(r["step"]) for r in logged], [float(r["loss"]) for r in logged]
        radius = max(len(loss) // 100, 1)  # windows of about 2% of the run: the noise goes, the bends stay
        ax.plot(x, loss, color="tab:blue", linewidth=0.7, alpha=0.3, label="training loss of each step")
        ax.plot(x, smoothed(loss, radius), color="tab:blue", linewidth=1.5,
                label=f"the same, smoothed (centred mean of {2 * radius + 1} steps)")
    # The evaluations score the same sampled windows each time, so their points compare across steps.
    ax.plot(steps, [float(r["train_loss"]) for r in rows], color="tab:blue", marker="o", markersize=6,
            markerfacecolor="white", markeredgewidth=1.5, linestyle="none" if logged else "-", zorder=3,
            label="train split (evaluation)")
    ax.plot(steps, [float(r["val_loss"]) for r in rows], color="tab:orange", marker="o", markersize=5,
            linewidth=1.5, zorder=3, label="validation split (evaluation)")
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
