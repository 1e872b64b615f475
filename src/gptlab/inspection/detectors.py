"""Head detectors: score every head for four jobs on token sequences made up here (handout §2.2).

A head's job is read from its attention weights on a probe where each job has one right key:
repeated random tokens, n random tokens followed by the same n again (no token twice within a half).

| detector          | queries i           | right key | why it is right                             |
|-------------------|---------------------|-----------|---------------------------------------------|
| `previous_token`  | every i >= 1        | i - 1     | the token just before                       |
| `duplicate_token` | second half, i >= n | i - n     | the earlier copy of the current token       |
| `induction`       | second half, i >= n | i - n + 1 | the token after that copy: what comes next  |
| `first_token`     | every i >= 1        | 0         | the first position (a "resting" head)       |

A score is that key's mean weight, so it lies in [0, 1] and 1 means the head does the job on every
query. The probe is random, so no score can come from memorised text. Weights being routing only,
`repeat_ablation` adds the causal test: zero each head and measure the loss on the second half, which
only an induction circuit can predict.

Shape legend: B sequences, T = 2n positions, L layers, H heads, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.config import DETECTORS
from gptlab.files import save_png
from gptlab.inspection.hooks import HookFn, hooked, record
from gptlab.inspection.interventions import draw_head_grid
from gptlab.model import GPT, next_token_loss

REPEAT_LENGTH = 32  # tokens per half, or block_size // 2 when the window is shorter
SEQUENCES = 16  # probe sequences per measurement


@dataclass(frozen=True)
class HeadScores:
    """Every head's detector scores and the loss on the probe's repeats (one measurement)."""

    scores: dict[str, torch.Tensor]  # detector -> (L, H), each score in [0, 1]
    repeat_loss: float  # mean loss on the second halves, from their second token on (nats)
    length: int  # n, tokens per half of the probe

    def rows(self) -> list[dict[str, float | int]]:
        """One dict per head, layer by layer: `layer`, `head` and one field per detector."""
        n_layer, n_head = self.scores[DETECTORS[0]].shape
        return [{"layer": layer, "head": head, **{d: float(self.scores[d][layer, head]) for d in DETECTORS}}
                for layer in range(n_layer) for head in range(n_head)]


def probe_length(model: GPT) -> int:
    """n, the probe's half length: REPEAT_LENGTH, at most half the window and at most the vocabulary
    (so that no token repeats within a half); a ValueError if that is below 2."""
    n = min(REPEAT_LENGTH, model.config.block_size // 2, model.config.vocab_size)
    if n < 2:
        raise ValueError(f"block_size={model.config.block_size}, vocab_size={model.config.vocab_size} is too "
                         "small for the head detectors: they need two copies of at least 2 distinct tokens")
    return n


def repeated_tokens(vocab_size: int, length: int, sequences: int, seed: int) -> torch.Tensor:
    """(B, 2n) ids: n distinct random tokens, then the same n again (n <= V).

    Drawn from a private generator, so measuring never moves a random stream that training uses.
    """
    generator = torch.Generator().manual_seed(seed)
    halves = torch.stack([torch.randperm(vocab_size, generator=generator)[:length] for _ in range(sequences)])
    return halves.repeat(1, 2)  # (B, 2n)


def detector_scores(weights: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """Each detector's mean weight, (H,), from one layer's weights (B, H, T, T) on the probe of half n."""
    n = length

    def mean_diagonal(offset: int, first_query: int) -> torch.Tensor:
        # weights[:, :, i, i - offset] for queries i >= first_query, averaged over queries and sequences
        diagonal = weights.diagonal(offset=-offset, dim1=-2, dim2=-1)  # (B, H, T - offset): i = offset + k
        return diagonal[..., first_query - offset:].mean(dim=(0, 2))

    return {
        "previous_token": mean_diagonal(1, 1),
        "duplicate_token": mean_diagonal(n, n),
        "induction": mean_diagonal(n - 1, n),
        "first_token": weights[:, :, 1:, 0].mean(dim=(0, 2)),
    }


def repeat_targets(idx: torch.Tensor, length: int) -> torch.Tensor:
    """Targets (B, T) scoring only the second half's tokens after its first (the ones induction predicts)."""
    targets = torch.full_like(idx, -1)
    targets[:, length:-1] = idx[:, length + 1:]  # position i predicts token i + 1, for i in n .. 2n - 2
    return targets


@torch.no_grad()
def score_heads(model: GPT, seed: int = 0, sequences: int = SEQUENCES) -> HeadScores:
    """Run the probe once, recording every layer's weights beside the fast kernel, and score each head."""
    n = probe_length(model)
    device = next(model.parameters()).device
    idx = repeated_tokens(model.config.vocab_size, n, sequences, seed).to(device)  # (B, 2n)
    names = [f"h.{layer}.attn.weights" for layer in range(model.config.n_layer)]
    with record(model, names) as weights:
        logits, _ = model(idx)  # (B, 2n, V)
    per_layer = [detector_scores(weights[name].float(), n) for name in names]
    scores = {d: torch.stack([layer[d] for layer in per_layer]).cpu() for d in DETECTORS}  # (L, H) each
    return HeadScores(scores, float(next_token_loss(logits, repeat_targets(idx, n))), n)


@torch.no_grad()
def repeat_ablation(model: GPT, seed: int = 0, sequences: int = SEQUENCES) -> torch.Tensor:
    """Change in the probe's repeat loss (nats) when each head's output is zeroed, as (L, H).

    A head is zeroed at the `h.N.attn.heads` hook point, its slice of W_O's input, at every position.
    """
    n = probe_length(model)
    device = next(model.parameters()).device
    idx = repeated_tokens(model.config.vocab_size, n, sequences, seed).to(device)  # (B, 2n)
    targets = repeat_targets(idx, n)
    base = float(model(idx, targets)[1])
    changes = torch.zeros(model.config.n_layer, model.config.n_head)
    for layer in range(model.config.n_layer):
        for head in range(model.config.n_head):
            with hooked(model, {f"h.{layer}.attn.heads": zero_head(head)}):
                changes[layer, head] = float(model(idx, targets)[1]) - base
    return changes


def zero_head(head: int) -> HookFn:
    """A hook for `h.N.attn.heads` (B, T, H, hs) that zeroes one head's output at every position."""
    return lambda value, name: value.index_fill(2, torch.tensor([head], device=value.device), 0.0)


def save_scores_png(scores: HeadScores, path: str | Path, title: str) -> None:
    """One layer x head heatmap per detector, scores written in, on one 0..1 colour scale."""
    from matplotlib.figure import Figure

    n_layer, n_head = scores.scores[DETECTORS[0]].shape
    fig = Figure(figsize=(len(DETECTORS) * (0.55 * n_head + 1.0) + 1.0, 0.45 * n_layer + 1.6), dpi=100,
                 layout="constrained")
    axes = fig.subplots(1, len(DETECTORS), squeeze=False)[0]
    for ax, detector in zip(axes, DETECTORS, strict=True):
        image = draw_head_grid(ax, scores.scores[detector], detector.replace("_", "-"), "viridis", (0.0, 1.0),
                               ".2f", lambda value: value <= 0.6)  # viridis is dark below about 0.6
    fig.colorbar(image, ax=axes, label="mean attention on the right key")
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)
