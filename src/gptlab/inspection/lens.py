"""The logit lens: what the model would predict if it stopped after each block (handout §6, §2.2).

The residual stream keeps width D through every block (§6), so the final norm and the vocabulary
head can read it anywhere: at the input rows (`embed`) and after each block (`h.N.resid_post`). Each
reading is a next-token distribution per position; the last one is the model's own output, exactly.
Watching the probability of the token that actually comes next rise from stage to stage shows in
which block a prediction is made. It is a reading, not a cause: the head was trained on the last
stage only, so early stages may speak a different "language" (`patching` tests causes).

Shape legend: S stages (L + 1), T positions, V vocabulary, k top predictions.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.files import atomic_write_text, save_png
from gptlab.inspection.hooks import record
from gptlab.inspection.page import static_text
from gptlab.inspection.tokens import token_label, token_labels
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer

TOP = 5  # predictions kept per stage and position


@dataclass(frozen=True)
class LogitLens:
    """The lens read at every stage of one prompt."""

    prompt: str
    ids: list[int]
    labels: list[str]  # each token's text, made visible
    stages: list[str]  # "embed", "block 0", ..., "block L-1"
    top_ids: torch.Tensor  # (S, T, k) the likeliest next tokens, likeliest first
    top_probs: torch.Tensor  # (S, T, k) their probabilities
    next_probs: torch.Tensor  # (S, T - 1) probability of the token that actually comes next


def stage_points(model: GPT) -> list[str]:
    """The hook points read, in order: the input rows, then every block's output."""
    return ["embed"] + [f"h.{n}.resid_post" for n in range(model.config.n_layer)]


def stage_names(model: GPT) -> list[str]:
    """Short names of `stage_points` for tables and axes."""
    return ["embed"] + [f"block {n}" for n in range(model.config.n_layer)]


@torch.no_grad()
def logit_lens(model: GPT, tokenizer: Tokenizer, prompt: str, ids: Sequence[int], k: int = TOP) -> LogitLens:
    """Run the prompt once, read every stage's residual stream through the final norm and the head."""
    device = next(model.parameters()).device
    idx = torch.tensor([list(ids)], device=device)  # (1, T)
    points = stage_points(model)
    with record(model, points) as values:
        model(idx)
    streams = torch.cat([values[p] for p in points])  # (S, T, D)
    probs = model.head(streams).float().softmax(-1).cpu()  # (S, T, V): final norm, head, any soft cap
    top = probs.topk(min(k, probs.size(-1)), dim=-1)  # (S, T, k)
    following = torch.tensor(list(ids[1:]), dtype=torch.long)  # (T - 1,)
    next_probs = probs[:, :-1].gather(-1, following.view(1, -1, 1).expand(len(points), -1, 1))[..., 0]
    return LogitLens(prompt, list(ids), token_labels(tokenizer, ids), stage_names(model), top.indices,
                     top.values, next_probs)


def lens_table(lens: LogitLens, tokenizer: Tokenizer) -> list[str]:
    """Lines of text: per position, its token, the next one, then each stage's top token and p(next)."""
    width = max(9, *(len(s) for s in lens.stages))
    lines = [f"{'pos':>3} {'token':<7} {'next':<7} " + " ".join(f"{s:>{width}}" for s in lens.stages)]
    for t, label in enumerate(lens.labels):
        following = lens.labels[t + 1] if t + 1 < len(lens.labels) else ""
        cells = []
        for s in range(len(lens.stages)):
            top = token_label(tokenizer, int(lens.top_ids[s, t, 0]))
            p = f" {float(lens.next_probs[s, t]):.2f}" if t + 1 < len(lens.labels) else ""
            cells.append(f"{top[:4] + p:>{width}}")
        lines.append(f"{t:>3} {label:<7} {following:<7} " + " ".join(cells))
    return lines


def save_lens_png(lens: LogitLens, tokenizer: Tokenizer, path: str | Path) -> None:
    """A stages x positions heatmap of p(actual next token), each cell labelled with the stage's top token."""
    from matplotlib.figure import Figure

    S, T = lens.next_probs.size(0), len(lens.labels)
    grid = torch.full((S, T), float("nan"))
    grid[:, :-1] = lens.next_probs  # the last position has no next token in the prompt
    fig = Figure(figsize=(max(4.0, 0.42 * T + 2.0), 0.45 * S + 2.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for s in range(S):
        for t in range(T):
            ax.text(t, s, token_label(tokenizer, int(lens.top_ids[s, t, 0]))[:4], ha="center", va="center",
                    fontsize=7, color="white" if t + 1 == T or grid[s, t] < 0.6 else "black")
    ax.set_yticks(range(S), lens.stages, fontsize=8)
    following = [*lens.labels[1:], ""]
    ticks = [f"{a} \u2192 {b}" if b else a for a, b in zip(lens.labels, following, strict=True)]
    ax.set_xticks(range(T), ticks, fontsize=7, fontfamily="monospace", rotation=90)
    ax.set_xlabel("position: token \u2192 the token that comes next")
    fig.colorbar(image, ax=ax, label="p(the actual next token)")
    fig.suptitle(f"logit lens of {lens.prompt!r} (cells: each stage's top prediction)", fontsize=10)
    save_png(fig, path)


def save_lens_html(lens: LogitLens, tokenizer: Tokenizer, path: str | Path) -> None:
    """One self-contained page: the table coloured by p(next); hover a cell for the stage's top five.

    The page is the package data file static/lens.html (its style inline) with its slots filled here.
    """
    rows = []
    for s, stage in enumerate(lens.stages):
        cells = []
        for t in range(len(lens.labels)):
            tops = ", ".join(f"{token_label(tokenizer, int(i))} {float(p):.3f}"
                             for i, p in zip(lens.top_ids[s, t], lens.top_probs[s, t], strict=True))
            p = float(lens.next_probs[s, t]) if t + 1 < len(lens.labels) else 0.0
            top = html.escape(token_label(tokenizer, int(lens.top_ids[s, t, 0])))
            colour = f"background:rgba(40,110,200,{p:.3f})"
            cells.append(f'<td title="{html.escape(tops)}" style="{colour}">{top}</td>')
        rows.append(f"<tr><th>{html.escape(stage)}</th>{''.join(cells)}</tr>")
    header = "".join(f"<th>{html.escape(label)}</th>" for label in lens.labels)
    slots = {"TITLE": html.escape(f"logit lens: {lens.prompt!r}"), "HEADER": header, "ROWS": "".join(rows)}
    # One pass, so a prompt or token that spells a slot name is never filled in turn.
    page = re.sub("__(TITLE|HEADER|ROWS)__", lambda m: slots[m.group(1)], static_text("lens.html", None))
    atomic_write_text(Path(path), page)
