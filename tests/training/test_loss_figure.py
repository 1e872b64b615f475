"""loss.png readable at a glance (issue 42): the y-axis cut to the later losses, not squashed by step 0's,
the best validation point marked with its value, and the legend off the curves."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gptlab.training.logs import loss_figure, loss_limits, plot_losses

plt = pytest.importorskip("matplotlib.pyplot")


def loss_at(step: int) -> float:
    """A demo-like curve: 4.5 at step 0, settling near 1.5."""
    return 1.5 + 3.0 * math.exp(-step / 40)


def write_run(folder: Path) -> None:
    """metrics.csv (an evaluation every 50 steps, the best at step 350) and steps.csv of a 400-step run."""
    val = {s: loss_at(s) + 0.05 + (0.0 if s <= 350 else 0.02) for s in range(0, 401, 50)}
    val[350] = 1.52
    rows = "".join(f"{s},{loss_at(s)},{val[s]},0,0,0\n" for s in range(0, 401, 50))
    (folder / "metrics.csv").write_text("step,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n" + rows)
    noisy = "".join(f"{s},{loss_at(s) + 0.03 * (-1) ** s},0,0,0,0\n" for s in range(1, 401))
    (folder / "steps.csv").write_text("step,loss,lr,grad_norm,tokens_per_s,elapsed_s\n" + noisy)


def test_the_picture_shows_the_later_losses_the_best_point_and_the_legend_below(tmp_path: Path) -> None:
    write_run(tmp_path)
    fig = loss_figure(tmp_path / "metrics.csv", "run", tmp_path / "steps.csv")
    try:
        (ax,) = fig.axes
        bottom, top = ax.get_ylim()
        assert 1.4 < bottom < 1.47 and 1.6 < top < 2.0  # not 4.5: the later half fills the height
        texts = [t.get_text() for t in ax.texts]
        (best,) = [t for t in ax.texts if t.get_text().startswith("best val")]
        assert best.get_text() == "best val 1.5200 (step 350)" and tuple(best.xy) == (350, 1.52)
        assert any(t.startswith(f"cut at {top:.2f}") and "up to 4.55" in t for t in texts)  # step 0's val
        assert ax.get_legend() is None and len(fig.legends) == 1
        fig.canvas.draw()
        assert fig.legends[0].get_window_extent().y1 <= ax.get_window_extent().y0  # under the axes
    finally:
        plt.close(fig)


def test_the_limits_keep_a_rising_validation_loss_and_a_diverged_run_still_plots(tmp_path: Path) -> None:
    bottom, top = loss_limits([(1, 4.0), (2, 2.0), (3, 2.1), (4, 2.0)], [(0, 4.5), (4, 2.6)])
    assert bottom < 2.0 and 2.6 < top < 4.0  # the late evaluation stays inside; step 0 does not
    (tmp_path / "metrics.csv").write_text("step,train_loss,val_loss,lr,tokens_per_s,elapsed_s\n"
                                          "0,4.5,4.6,0,0,0\n10,nan,nan,0,0,0\n")
    plot_losses(tmp_path / "metrics.csv", tmp_path / "loss.png", "diverged")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
