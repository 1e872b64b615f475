"""The report of a comparison: each cell's losses as mean ± sd over seeds, each cell against the baseline
with Welch's t-test (scipy) and a plain sentence, and the validation curves with a band per cell.

Written as OUT/report.md, OUT/report.html (self-contained: the picture is embedded) and OUT/curves.png.
The compared figure is each run's last checkpoint scored on the validation split (`final.json`);
the best of the sampled estimates made during training is shown beside it.
"""

from __future__ import annotations

import base64
import csv
import html
import math
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from gptlab.checkpoint import LAST, has_checkpoint, load_header
from gptlab.experiments.grid import Cell, Run
from gptlab.experiments.runner import FINAL_TOKENS, final_loss
from gptlab.files import atomic_write_text

SIGNIFICANCE = 0.05


@dataclass(frozen=True)
class RunRecord:
    """One finished run's figures and its validation curve (one point per evaluation)."""

    seed: int
    final_val: float
    best_val: float
    seconds: float
    tokens_per_s: float
    steps: tuple[int, ...]
    val: tuple[float, ...]
    elapsed: tuple[float, ...]


@dataclass(frozen=True)
class CellSummary:
    """A cell's finished runs, and its parameter count."""

    cell: Cell
    runs: tuple[RunRecord, ...]
    parameters: int

    @property
    def n(self) -> int:
        return len(self.runs)

    def values(self, name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in self.runs], dtype=float)

    def mean_sd(self, name: str) -> tuple[float, float]:
        """Mean and sample standard deviation (ddof 1; nan with one seed)."""
        values = self.values(name)
        return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else math.nan


@dataclass(frozen=True)
class Difference:
    """A cell's mean final validation loss minus the baseline's, its standard error and Welch's p-value."""

    cell: str
    baseline: str
    delta: float
    stderr: float
    p: float
    n: int
    n_baseline: int

    def sentence(self) -> str:
        """The finding in words, with its noise: "... better than ... by 0.041 ± 0.012 nats, p = 0.003"."""
        if not self.delta:
            return f"{self.cell} and {self.baseline} reach the same loss."
        n, n_base = self.n, self.n_baseline
        seeds = f"{n} seeds each" if n == n_base else f"{n} and {n_base} seeds"
        than = f"{self.cell} is {'better' if self.delta < 0 else 'worse'} than {self.baseline} by"
        if min(n, n_base) < 2:
            return (f"{than} {abs(self.delta):.3f} nats with {seeds}: one "
                    "seed cannot tell a difference from noise (use --seeds 3 or more).")
        if math.isnan(self.p):
            return (f"{than} {abs(self.delta):.3f} nats, {seeds}, with no "
                    "variation between seeds: no test is possible.")
        verdict = (f"significant at the {SIGNIFICANCE:.0%} level" if self.p < SIGNIFICANCE
                   else "not significant: within the noise between seeds")
        return (f"{than} {abs(self.delta):.3f} ± {self.stderr:.3f} nats, "
                f"p = {self.p:.2g}, {seeds} ({verdict}).")


def read_run(run: Run) -> RunRecord | None:
    """A run's figures, or None while it has not finished and been scored."""
    final = final_loss(run.folder)
    metrics = run.folder / "metrics.csv"
    if final is None or not metrics.is_file():
        return None
    with metrics.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    val = tuple(float(r["val_loss"]) for r in rows)
    return RunRecord(run.seed, final, min(val), float(rows[-1]["elapsed_s"]), float(rows[-1]["tokens_per_s"]),
                     tuple(int(r["step"]) for r in rows), val, tuple(float(r["elapsed_s"]) for r in rows))


def summarise(runs: list[Run]) -> list[CellSummary]:
    """Every cell with its finished runs, in the grid's order."""
    from gptlab.config import parameter_count

    summaries = []
    for cell in dict.fromkeys(r.cell for r in runs):
        records = tuple(record for r in runs if r.cell == cell and (record := read_run(r)) is not None)
        done = [r for r in runs if r.cell == cell and has_checkpoint(r.folder, LAST)]
        config = load_header(done[0].folder, prefer=LAST).model_config if done else cell.model_config
        summaries.append(CellSummary(cell, records, parameter_count(config)["total"]))
    return summaries


def differences(summaries: list[CellSummary], baseline: Cell) -> list[Difference]:
    """Each other cell against the baseline on the final validation loss (Welch's unequal-variance t-test)."""
    from scipy import stats

    base = next(s for s in summaries if s.cell == baseline)
    found = []
    for summary in summaries:
        if summary.cell == baseline or not summary.n or not base.n:
            continue
        a, b = summary.values("final_val"), base.values("final_val")
        delta = float(a.mean() - b.mean())
        if min(len(a), len(b)) > 1:
            stderr = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
            p = float(stats.ttest_ind(a, b, equal_var=False).pvalue) if stderr > 0 else math.nan
        else:
            stderr, p = math.nan, math.nan
        found.append(Difference(summary.cell.name, baseline.name, delta, stderr, p, len(a), len(b)))
    return found


def _pm(mean: float, sd: float, digits: int = 4, sign: str = "") -> str:
    """`mean ± sd`, or the mean alone where sd is undefined (one seed)."""
    shown = f"{mean:{sign}.{digits}f}"
    return shown if math.isnan(sd) else f"{shown} ± {sd:.{digits}f}"


def table_rows(summaries: list[CellSummary], found: list[Difference]) -> list[list[str]]:
    """The report's table: a header row, then one row per cell."""
    by_cell = {d.cell: d for d in found}
    rows = [["cell", "seeds", "final val loss", "best val loss (sampled)", "Δ vs baseline", "p (Welch)",
             "train time (s)", "tokens/s", "parameters"]]
    for s in summaries:
        if not s.n:
            rows.append([s.cell.name, "0", "not finished", "", "", "", "", "", f"{s.parameters:,}"])
            continue
        d = by_cell.get(s.cell.name)
        delta = "baseline" if d is None else _pm(d.delta, d.stderr, sign="+")
        p = "" if d is None or math.isnan(d.p) else f"{d.p:.2g}"
        rows.append([s.cell.name, str(s.n), _pm(*s.mean_sd("final_val")), _pm(*s.mean_sd("best_val")),
                     delta, p,
                     _pm(*s.mean_sd("seconds"), digits=1), f"{s.mean_sd('tokens_per_s')[0]:,.0f}",
                     f"{s.parameters:,}"])
    return rows


def plot_curves(summaries: list[CellSummary], png: Path) -> None:
    """Validation loss against steps and against seconds: each cell's mean over seeds, a band of ± one sd."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110, sharey=True)
    colours = plt.get_cmap("tab10" if len(summaries) <= 10 else "tab20")
    for i, s in enumerate(x for x in summaries if x.n):
        length = min(len(r.steps) for r in s.runs)  # the evaluations every seed reached
        val = np.array([r.val[:length] for r in s.runs])  # (seeds, evaluations)
        mean, sd = val.mean(0), val.std(0, ddof=1) if s.n > 1 else np.zeros(length)
        steps = np.array(s.runs[0].steps[:length])
        seconds = np.array([r.elapsed[:length] for r in s.runs]).mean(0)
        for ax, x in ((axes[0], steps), (axes[1], seconds)):
            ax.plot(x, mean, color=colours(i), label=f"{s.cell.name} ({s.n} seeds)", linewidth=1.6)
            ax.fill_between(x, mean - sd, mean + sd, color=colours(i), alpha=0.18, linewidth=0)
    finals = [v for s in summaries for v in s.values("final_val")]
    if finals:  # the interesting end of the curves, not the untrained start
        tails = [v for s in summaries for r in s.runs for v in r.val[len(r.val) // 3:]]
        low, high = min(*finals, *tails), max(tails)
        axes[0].set_ylim(low - 0.05 * (high - low + 0.1), high + 0.05 * (high - low + 0.1))
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds")
    axes[0].set_ylabel("validation loss (nats per token)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("validation loss: mean over seeds, band ± one standard deviation")
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(png)


def markdown(title: str, context: list[str], rows: list[list[str]], found: list[Difference],
             notes: list[str]) -> str:
    """The report as Markdown."""
    lines = [f"# {title}", "", *[f"- {c}" for c in context], "", "| " + " | ".join(rows[0]) + " |",
             "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines += ["", "## Against the baseline", "", *[f"- {d.sentence()}" for d in found]]
    lines += ["", *notes, "", "![validation curves](curves.png)", ""]
    return "\n".join(lines)


def page(title: str, context: list[str], rows: list[list[str]], found: list[Difference], notes: list[str],
         png: Path) -> str:
    """The report as one HTML page, its picture embedded, from the package's template."""
    source = resources.files("gptlab.experiments").joinpath("report.html").read_text("utf-8")
    template = string.Template(source)
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    picture = base64.b64encode(png.read_bytes()).decode("ascii")
    return template.substitute(
        title=e(title), context="".join(f"<li>{e(c)}</li>" for c in context),
        table=f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>",
        findings="".join(f"<li>{e(d.sentence())}</li>" for d in found),
        notes="".join(f"<p>{e(n)}</p>" for n in notes), picture=picture)


def write_report(out: Path, runs: list[Run], baseline: Cell, context: list[str]) -> list[CellSummary]:
    """Write report.md, report.html and curves.png into `out` from the runs finished so far."""
    summaries = summarise(runs)
    found = differences(summaries, baseline)
    rows = table_rows(summaries, found)
    notes = [f"Final val loss: each run's last checkpoint scored on the first {FINAL_TOKENS:,} tokens of "
             "the validation split (the same for every run); best val loss: the lowest of the sampled "
             "estimates made during training. Δ: a cell's mean final loss minus the baseline's, ± its "
             f"standard error; p: Welch's t-test (unequal variances). With k comparisons, about k × "
             f"{SIGNIFICANCE} of them fall under p = {SIGNIFICANCE} by chance alone."]
    title = f"Comparison in {out.name}"
    plot_curves(summaries, out / "curves.png")
    atomic_write_text(out / "report.md", markdown(title, context, rows, found, notes))
    atomic_write_text(out / "report.html", page(title, context, rows, found, notes, out / "curves.png"))
    return summaries
