"""Causal tests of a prediction (handout §2.2): remove a head, or change the input, and measure.

"Changing or removing the relevant input and observing the prediction is more informative than
inspecting a weight alone." Two such tests, on one prompt and the prediction after its last token:
- `ablate_heads`: remove each head in turn and report the change in log-probability of a target next
  token. A head is removed by replacing its slice of W_O's input (the `h.N.attn.heads` hook point)
  with zeros (zero ablation) or with its own mean over the prompt's positions (mean ablation, which
  keeps the head's average contribution and removes only what depends on the position's context).
- `intervene`: replace or drop input tokens and compare the next-token distribution before and after.

Shape legend: B batch, T positions, H heads, hs head size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptlab.config import SettingError
from gptlab.files import save_png
from gptlab.inspection.hooks import hooked, record
from gptlab.inspection.tokens import resolve_position
from gptlab.model import GPT

ABLATIONS = ("zero", "mean")


@dataclass(frozen=True)
class HeadEffect:
    """Change in log p(target) when one head is removed, for each kind of ablation (nats)."""

    layer: int
    head: int
    zero: float
    mean: float


@dataclass(frozen=True)
class Ablation:
    """Every head's effect on the target's log-probability after the prompt's last token."""

    target: int
    logprob: float  # log p(target) of the intact model
    effects: list[HeadEffect]  # layer by layer, head by head

    def ranked(self, by: str = "zero") -> list[HeadEffect]:
        """The effects sorted by one ablation's change, the largest drop in log p(target) first."""
        return sorted(self.effects, key=lambda e: getattr(e, by))

    def grid(self, by: str) -> torch.Tensor:
        """One ablation's changes as an (n_layer, n_head) tensor."""
        n_layer = max(e.layer for e in self.effects) + 1
        return torch.tensor([getattr(e, by) for e in self.effects]).view(n_layer, -1)


def _logprobs(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (V,) of the token after the last one of idx (1, T)."""
    return model(idx)[0][0, -1].float().log_softmax(-1)


def _without_head(model: GPT, idx: torch.Tensor, layer: int, head: int,
                  replacement: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (V,) after the prompt with one head's output replaced by `replacement` (1, 1, hs)."""

    def ablate(value: torch.Tensor, name: str) -> torch.Tensor:  # (B, T, H, hs)
        value = value.clone()
        value[:, :, head] = replacement  # the same row at every position
        return value

    with hooked(model, {f"h.{layer}.attn.heads": ablate}):
        return _logprobs(model, idx)


@torch.no_grad()
def ablate_heads(model: GPT, ids: Sequence[int], target: int | None = None) -> Ablation:
    """Zero- and mean-ablate every head in turn; target defaults to the model's own top prediction."""
    idx = torch.tensor([list(ids)], device=next(model.parameters()).device)  # (1, T)
    names = [f"h.{n}.attn.heads" for n in range(model.config.n_layer)]
    with record(model, names) as clean:
        base = _logprobs(model, idx)
    target = int(base.argmax()) if target is None else target
    effects = []
    for layer, name in enumerate(names):
        for head in range(model.config.n_head):
            average = clean[name][:, :, head].mean(dim=1, keepdim=True)  # over the positions: (1, 1, hs)
            changes = [float(_without_head(model, idx, layer, head, r)[target] - base[target])
                       for r in (torch.zeros_like(average), average)]
            effects.append(HeadEffect(layer, head, *changes))
    return Ablation(target, float(base[target]), effects)


def draw_head_grid(ax: Any, grid: torch.Tensor, title: str, cmap: str, limits: tuple[float, float],
                   number: str, dark: Callable[[float], bool]) -> Any:
    """One layer x head heatmap on `ax`, each value written in its cell (white where `dark` says so)."""
    n_layer, n_head = grid.shape
    image = ax.imshow(grid.numpy(), cmap=cmap, vmin=limits[0], vmax=limits[1])
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(n_head))
    ax.set_yticks(range(n_layer))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if n_layer * n_head <= 256:  # numbers stay legible up to GPT-2 small's 12 x 12
        for layer, row in enumerate(grid.tolist()):
            for head, value in enumerate(row):
                ax.text(head, layer, format(value, number), ha="center", va="center", fontsize=6,
                        color="white" if dark(value) else "black")
    return image


def save_ablation_png(ablation: Ablation, target_label: str, path: str | Path) -> None:
    """Layer x head heatmaps of the change in log p(target), for zero and mean ablation, values written in."""
    from matplotlib.figure import Figure

    grids = {by: ablation.grid(by) for by in ABLATIONS}
    n_layer, n_head = grids["zero"].shape
    limit = max(1e-6, max(float(g.abs().max()) for g in grids.values()))  # one symmetric colour scale
    fig = Figure(figsize=(2 * (0.6 * n_head + 1.2) + 1.2, 0.5 * n_layer + 1.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False)[0]
    for ax, (by, grid) in zip(axes, grids.items(), strict=True):
        image = draw_head_grid(ax, grid, f"{by} ablation", "RdBu", (-limit, limit), "+.2f",
                               lambda value: abs(value) > limit / 2)  # the ends of RdBu are dark
    fig.colorbar(image, ax=axes, label="change in log p (nats)")
    fig.suptitle(f"removing one head: change in log p({target_label!r}), intact {ablation.logprob:.3f}",
                 fontsize=10)
    save_png(fig, path)


@dataclass(frozen=True)
class Intervention:
    """The next-token distribution after the prompt's last token, before and after editing the prompt."""

    before: list[int]
    after: list[int]
    probs_before: torch.Tensor  # (V,)
    probs_after: torch.Tensor  # (V,)

    def top(self, k: int) -> list[tuple[int, float, float]]:
        """(token, p before, p after) for the k most likely tokens before and after, likeliest first."""
        k = min(k, self.probs_before.numel())
        tokens = dict.fromkeys(self.probs_before.topk(k).indices.tolist()
                               + self.probs_after.topk(k).indices.tolist())  # both tops, in order, once
        rows = [(t, float(self.probs_before[t]), float(self.probs_after[t])) for t in tokens]
        return sorted(rows, key=lambda row: -max(row[1], row[2]))


def edit_tokens(ids: Sequence[int], replace: Sequence[tuple[int, int]] = (),
                drop: Sequence[int] = ()) -> list[int]:
    """The prompt with tokens replaced ((position, token) pairs) and dropped; positions may be negative."""
    n = len(ids)
    replaced = {}
    for position, token in replace:
        position = resolve_position(position, n, "replace")
        if position in replaced:
            raise SettingError(f"{{r}} names position {position} twice: give each position once", r="replace")
        replaced[position] = token
    dropped = {resolve_position(position, n, "drop") for position in drop}
    if dropped & set(replaced):
        raise ValueError(f"position {min(dropped & set(replaced))} is both replaced and dropped: choose one")
    if len(dropped) == n:
        raise SettingError("{d} removes every token of the prompt: keep at least one", d="drop")
    return [replaced.get(i, token) for i, token in enumerate(ids) if i not in dropped]


@torch.no_grad()
def intervene(model: GPT, ids: Sequence[int], replace: Sequence[tuple[int, int]] = (),
              drop: Sequence[int] = ()) -> Intervention:
    """Compare the next-token distribution of the prompt with that of the edited prompt."""
    after = edit_tokens(ids, replace, drop)
    device = next(model.parameters()).device
    before_probs, after_probs = (_logprobs(model, torch.tensor([list(row)], device=device)).exp().cpu()
                                 for row in (ids, after))
    return Intervention(list(ids), after, before_probs, after_probs)
