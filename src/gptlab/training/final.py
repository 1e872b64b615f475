"""A finished run's one validation figure, what the end of `gptlab train` prints.

The evaluations during training estimate the validation loss on `eval_batches` sampled batches, enough to
choose the best checkpoint; the final figure scores that checkpoint on EVAL_TOKENS tokens in windows
spread evenly over the val split, exactly as `gptlab eval RUN` does by default, so the two print the same
line. It is recorded on the checkpoint's row of metrics.csv (FINAL_COLUMNS) and read back from there when
the same run is reported again: a finished command run a second time does not score a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gptlab.checkpoint import load_header
from gptlab.evaluation.heldout import (
    EVAL_TOKENS,
    RunEvaluation,
    described,
    evaluate_run,
    held_out_text,
    scored_tokens,
)
from gptlab.files import RunLock
from gptlab.training.logs import plot_losses, read_columns, read_rows, write_rows

# The figure, how many tokens it scored, and how they were chosen ("spread": windows spread evenly over the
# split; figures recorded before, from the split's first windows, are not read back but scored again).
FINAL_COLUMNS = ("final_val_loss", "final_val_tokens", "final_val_windows")


def final_evaluation(run_dir: str | Path, progress: bool = False,
                     announce: Callable[[str], None] | None = None) -> RunEvaluation:
    """The run's best checkpoint on EVAL_TOKENS tokens spread over its val split: scored (behind a bar
    with `progress`, after a line to `announce`) and recorded in metrics.csv, or read from there."""
    run_dir = Path(run_dir)
    with RunLock(run_dir):  # no resume of the same run writes metrics.csv meanwhile
        header = load_header(run_dir)
        step = header.state.get("step")
        text = held_out_text(run_dir, "val", header)
        scored = scored_tokens(len(text.tokens), header.model_config.block_size, EVAL_TOKENS)
        metrics = run_dir / "metrics.csv"
        loss = recorded_loss(metrics, step, scored)
        if loss is not None:
            evaluation = described(header, text, EVAL_TOKENS, loss)
        else:
            evaluation = evaluate_run(run_dir, "val", EVAL_TOKENS, progress=progress, announce=announce)
            if step is not None:
                record_loss(metrics, step, evaluation.result.loss, evaluation.result.tokens)
        if (run_dir / "loss.png").is_file():  # drawn again: its mark gives the figure printed, even where
            # a kill cut the last drawing short
            plot_losses(metrics, run_dir / "loss.png", run_dir.name, steps_csv=run_dir / "steps.csv")
        return evaluation


def recorded_loss(metrics: Path, step: int | None, tokens: int) -> float | None:
    """The final figure metrics.csv holds for `step`'s checkpoint over `tokens` tokens, if it holds one."""
    for row in read_rows(metrics):
        if row["step"] == str(step) and row.get("final_val_tokens") == str(tokens) and \
                row.get("final_val_windows") == "spread":
            return float(row["final_val_loss"])
    return None


def record_loss(metrics: Path, step: int, loss: float, tokens: int) -> None:
    """Write the final figure on `step`'s row of metrics.csv (adding FINAL_COLUMNS to a file without them);
    nothing when no row has that step (a metrics.csv removed or replaced)."""
    rows = read_rows(metrics)
    row = next((row for row in rows if row["step"] == str(step)), None)
    if row is None:
        return
    row.update(final_val_loss=repr(loss), final_val_tokens=str(tokens), final_val_windows="spread")
    columns = read_columns(metrics)
    write_rows(metrics, (*columns, *(name for name in FINAL_COLUMNS if name not in columns)), rows)
