"""Per-run metrics: CSV logs that survive a kill and a resume, and the loss-curve picture drawn from them.

`metrics.csv` holds a row per evaluation (MetricsLog) and `steps.csv` a row per optimiser step (see
gptlab.training.sinks); `loss.png` draws both: every step's training loss, raw and smoothed, under the
evaluations, the y-axis cut to the later losses and the best validation point marked.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gptlab.files import atomic_write, atomic_write_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Point = tuple[int, float]  # (step, loss)


class CsvLog:
    """Appends rows with fixed `columns` (the first is "step") to a CSV file; on resume, forgets the rows
    after the resumed step, which a killed run wrote after its last checkpoint and will write again, and
    keeps the columns added to the file since (a finished run's final figure, gptlab.training.final)."""

    def __init__(self, path: Path, columns: Sequence[str], resume_step: int | None = None) -> None:
        assert columns[0] == "step", "rows are kept or forgotten by their step"
        self.path, self.columns = path, tuple(columns)
        rows = []
        if resume_step is not None and path.exists():
            rows = [row for row in self.read() if int(row["step"]) <= resume_step]
            self.columns += tuple(name for name in read_columns(path) if name not in self.columns)
        write_rows(path, self.columns, rows)  # a kill now never loses the earlier rows

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


def read_columns(path: Path) -> tuple[str, ...]:
    """The column names of a CSV log (its header line)."""
    with path.open(newline="") as f:
        return tuple(next(csv.reader(f), ()))


def write_rows(path: Path, columns: Sequence[str], rows: Sequence[dict[str, str]]) -> None:
    """Replace a CSV log with `rows` under `columns` (a missing value left empty), crash-safely."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, table.getvalue())


def loss_limits(noisy: Sequence[Point], evaluated: Sequence[Point]) -> tuple[float, float]:
    """The y-range of (step, loss) points: the lowest loss to the later half's highest (the 95th percentile
    of the `noisy` per-step ones), with as much room above; the steep start goes off the top."""
    half = max(step for step, _ in (*noisy, *evaluated)) / 2
    late_noisy = sorted(loss for step, loss in noisy if step >= half)
    late = [loss for step, loss in evaluated if step >= half]
    if late_noisy:
        late.append(late_noisy[int(0.95 * (len(late_noisy) - 1))])
    low, high = min(loss for _, loss in (*noisy, *evaluated)), max(late)
    span = max(high - low, 0.05)
    return low - 0.1 * span, high + span


def plot_losses(metrics_csv: Path, png: Path, title: str, steps_csv: Path | None = None) -> None:
    """Draw the losses against step into `png` (headless, matplotlib's Agg backend); see loss_figure."""
    import matplotlib.pyplot as plt

    fig = loss_figure(metrics_csv, title, steps_csv)
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png"))  # a kill leaves a name the run cleans up
    plt.close(fig)


def loss_figure(metrics_csv: Path, title: str, steps_csv: Path | None = None) -> Figure:
    """The evaluations' train and validation points from `metrics_csv`, over every step's training loss
    from `steps_csv` (raw, faint, and smoothed) when there is one; the best validation point marked, the
    y-axis cut to the later losses (loss_limits) and the legend under the axes. Where the end of training
    scored that checkpoint on more of the val split (final_val_loss), the mark gives that figure too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(metrics_csv)
    steps = [int(r["step"]) for r in rows]
    val = [float(r["val_loss"]) for r in rows]
    logged = [r for r in read_rows(steps_csv) if r["loss"]] if steps_csv is not None else []
    x, loss = [int(r["step"]) for r in logged], [float(r["loss"]) for r in logged]
    fig, ax = plt.subplots(figsize=(7, 4.6), dpi=110, layout="constrained")
    if logged:
        radius = max(len(loss) // 100, 1)  # windows of about 2% of the run: the noise goes, the bends stay
        ax.plot(x, loss, color="tab:blue", linewidth=0.7, alpha=0.3, label="training loss of each step")
        ax.plot(x, smoothed(loss, radius), color="tab:blue", linewidth=1.5,
                label=f"the same, smoothed (centred mean of {2 * radius + 1} steps)")
    # The evaluations score the same sampled windows each time, so their points compare across steps.
    train_points = [float(r["train_loss"]) for r in rows]
    ax.plot(steps, train_points, color="tab:blue", marker="o", markersize=6, markerfacecolor="white",
            markeredgewidth=1.5, linestyle="none" if logged else "-", zorder=3,
            label="train split (evaluation)")
    ax.plot(steps, val, color="tab:orange", marker="o", markersize=5, linewidth=1.5, zorder=3,
            label="validation split (evaluation)")
    frame(ax, list(zip(x, loss, strict=True)),
          [*zip(steps, train_points, strict=True), *zip(steps, val, strict=True)])
    scored = [i for i, v in enumerate(val) if math.isfinite(v)]
    if scored:
        best = min(scored, key=val.__getitem__)
        label = f"best val {val[best]:.4f} (step {steps[best]:,})"
        if rows[best].get("final_val_loss"):  # the figure the end of training printed for this checkpoint
            label = (f"best val {val[best]:.4f} on sampled batches (step {steps[best]:,});\n"
                     f"{float(rows[best]['final_val_loss']):.4f} on {int(rows[best]['final_val_tokens']):,} "
                     "val tokens, as printed")
        ax.annotate(label, (steps[best], val[best]),
                    xytext=(-12, 28), textcoords="offset points", ha="right", fontsize="small",
                    arrowprops={"arrowstyle": "->", "color": "tab:orange"}, zorder=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
    return fig


def frame(ax: Axes, noisy: list[Point], evaluated: list[Point]) -> None:
    """Set the y-range of loss_limits over the finite losses, saying in a corner how high the ones cut off
    at the top went."""
    noisy = [point for point in noisy if math.isfinite(point[1])]
    evaluated = [point for point in evaluated if math.isfinite(point[1])]
    if not noisy and not evaluated:
        return
    bottom, top = loss_limits(noisy, evaluated)
    ax.set_ylim(bottom, top)
    highest = max(loss for _, loss in (*noisy, *evaluated))
    if highest > top:
        ax.text(0.99, 0.97, f"cut at {top:.2f}: the first losses, up to {highest:.2f}, are off the top",
                transform=ax.transAxes, ha="right", va="top", fontsize="small", color="dimgray")
