"""Activation patching: which values carry a prediction from one prompt into another (handout §2.2).

Two prompts of the same length differ where it matters: a clean one, after which the model predicts
`target`, and a corrupted one, after which it prefers `foil`. The metric is the logit difference
m = logit(target) - logit(foil) after the last token. Run the corrupted prompt again with one value
taken from the clean run, and measure how much of the gap it closes:

    restored = (m(patched) - m(corrupted)) / (m(clean) - m(corrupted))

0 means the patched value carries none of the difference, 1 all of it. Values patched:
- the residual stream at each (stage, position): the input rows (`embed`) and every block's output
  (`h.N.resid_post`), one position at a time;
- each head's output (`h.N.attn.heads`, per query head, so grouped models too) at every position.

Each patch is one forward pass of the corrupted prompt, so patching the whole stream at any stage
reproduces the clean run's logits and restores 1.0, to rounding (a kernel may sum one row in an order
that depends on the others, so a patched run need not repeat the clean one's arithmetic bit for bit).

Shape legend: S stages (L + 1), T positions, L layers, H heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.config import SettingError
from gptlab.files import save_png
from gptlab.inspection.hooks import hooked, record
from gptlab.inspection.lens import stage_names, stage_points
from gptlab.model import GPT


@dataclass(frozen=True)
class Patching:
    """How much of the clean-minus-corrupted logit difference each patched value restores."""

    target: int
    foil: int
    clean: float  # m on the clean prompt
    corrupted: float  # m on the corrupted prompt
    stages: list[str]  # "embed", "block 0", ...
    residual: torch.Tensor  # (S, T) restored by one (stage, position) of the residual stream
    heads: torch.Tensor  # (L, H) restored by one head's output at every position


def _metric(logits: torch.Tensor, target: int, foil: int) -> float:
    """logit(target) - logit(foil) after the last token of logits (1, T, V)."""
    last = logits[0, -1].float()
    return float(last[target] - last[foil])


def _runner_up(logits: torch.Tensor, target: int) -> int:
    """The likeliest next token after the last position that is not `target`."""
    top2 = logits[0, -1].topk(2).indices.tolist()
    return top2[1] if top2[0] == target else top2[0]


def check_same_length(clean: Sequence[int], corrupt: Sequence[int]) -> None:
    """Patching pairs positions, so the prompts must be as long as each other."""
    if len(clean) != len(corrupt):
        raise SettingError(f"{{c}} is {len(clean)} tokens but {{x}} is {len(corrupt)}: patching pairs "
                           "their positions, so give prompts that tokenize to the same length",
                           c="clean", x="corrupt")


def patch_value(model: GPT, corrupt: torch.Tensor, point: str, clean_value: torch.Tensor,
                where: tuple[slice | int, ...]) -> torch.Tensor:
    """Logits (1, T, V) of the corrupted ids (1, T) with value[where] taken from the clean run at `point`."""

    def patch(value: torch.Tensor, name: str) -> torch.Tensor:
        value = value.clone()
        value[where] = clean_value[where]
        return value

    with hooked(model, {point: patch}):
        return model(corrupt)[0]


@torch.no_grad()
def patch_activations(model: GPT, clean_ids: Sequence[int], corrupt_ids: Sequence[int],
                      target: int | None = None, foil: int | None = None) -> Patching:
    """Patch every residual (stage, position) and every head from the clean run into the corrupted one.

    `target` defaults to the clean run's top prediction; `foil` to the corrupted run's likeliest token
    other than the target.
    """
    check_same_length(clean_ids, corrupt_ids)
    device = next(model.parameters()).device
    clean, corrupt = (torch.tensor([list(ids)], device=device) for ids in (clean_ids, corrupt_ids))  # (1, T)
    stages = stage_points(model)
    heads = [f"h.{n}.attn.heads" for n in range(model.config.n_layer)]
    with record(model, stages + heads) as values:
        clean_logits = model(clean)[0]  # (1, T, V)
    corrupt_logits = model(corrupt)[0]
    target = int(clean_logits[0, -1].argmax()) if target is None else target
    foil = _runner_up(corrupt_logits, target) if foil is None else foil
    if foil == target:
        raise SettingError("{f} is the same token as {t}: the logit difference would be zero; "
                           "choose another foil", f="foil", t="target")
    m_clean, m_corrupt = _metric(clean_logits, target, foil), _metric(corrupt_logits, target, foil)
    if m_clean == m_corrupt:
        raise ValueError("the clean and corrupted prompts give the same logit difference, so there is "
                         "nothing to restore: change the corrupted prompt where the prediction depends on it")

    def restored(logits: torch.Tensor) -> float:
        return (_metric(logits, target, foil) - m_corrupt) / (m_clean - m_corrupt)

    T = clean.size(1)
    residual = torch.tensor([[restored(patch_value(model, corrupt, point, values[point], (slice(None), t)))
                              for t in range(T)] for point in stages])  # (S, T)
    by_head = torch.tensor([[restored(patch_value(model, corrupt, point, values[point],
                                                  (slice(None), slice(None), h)))
                             for h in range(model.config.n_head)] for point in heads])  # (L, H)
    return Patching(target, foil, m_clean, m_corrupt, stage_names(model), residual, by_head)


def save_patching_png(result: Patching, labels: Sequence[str], target_label: str, foil_label: str,
                      path: str | Path) -> None:
    """Two heatmaps of the restored fraction: residual stream (stage x position) and heads (layer x head)."""
    from matplotlib.figure import Figure

    S, T = result.residual.shape
    L, H = result.heads.shape
    fig = Figure(figsize=(max(4.0, 0.42 * T + 2.0) + 0.6 * H + 2.5, max(0.45 * S, 0.45 * L) + 2.2), dpi=100,
                 layout="constrained")
    residual_ax, heads_ax = fig.subplots(1, 2, width_ratios=[max(4.0, 0.42 * T), max(2.0, 0.6 * H)])
    limit = max(1.0, float(result.residual.abs().max()), float(result.heads.abs().max()))
    for ax, grid in ((residual_ax, result.residual), (heads_ax, result.heads)):
        image = ax.imshow(grid.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
        for r, row in enumerate(grid.tolist()):
            for c, value in enumerate(row):
                ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(value) > limit / 2 else "black")
    residual_ax.set_yticks(range(S), result.stages, fontsize=8)
    residual_ax.set_xticks(range(T), labels, fontsize=7, fontfamily="monospace", rotation=90)
    residual_ax.set_xlabel("position (clean prompt's tokens)")
    residual_ax.set_title("residual stream, one position at a time", fontsize=9)
    heads_ax.set_xticks(range(H))
    heads_ax.set_yticks(range(L))
    heads_ax.set_xlabel("head")
    heads_ax.set_ylabel("layer")
    heads_ax.set_title("each head, every position", fontsize=9)
    fig.colorbar(image, ax=[residual_ax, heads_ax], label="share of the logit difference restored")
    fig.suptitle(f"patching clean into corrupted: logit('{target_label}') - logit('{foil_label}'), "
                 f"clean {result.clean:.2f}, corrupted {result.corrupted:.2f}", fontsize=10)
    save_png(fig, path)
