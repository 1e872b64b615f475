"""How good an SAE is, on held-out windows: how sparse (L0), how faithful as a reconstruction (explained
variance), and how much of the model's behaviour survives when the SAE replaces the site (spliced loss).

- L0: the mean number of features active per token (at most k for a TopK SAE).
- Explained variance: 1 - sum |x - x^|^2 / sum |x - mean x|^2 over every held-out token: the fraction of
  the activations' variance the reconstruction keeps (1: all of it).
- Spliced loss: the model's next-token loss (nats) with the site's value replaced by the SAE's
  reconstruction, beside the clean loss and the loss with the site zero-ablated (its value set to 0). The
  share of the ablation's damage the SAE repairs, (zero - spliced) / (zero - clean), is the "loss
  recovered" SAELens and others report (1: as good as clean). Reconstruction errors compound through the
  later layers, so this is the figure that says whether the features carry what the model uses. It is
  undefined (None) where ablating the site raises the loss by under UNDEFINED_GAP of it (an untrained
  model, a site the model does not use): a share of next to nothing would be noise, 113 % or -96 %.
- Dead features: the share of features that never fire on the held-out tokens.

Shape legend: B windows, T positions, D the site's width, F features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gptlab.inspection.hooks import HookFn, hooked
from gptlab.model import GPT
from gptlab.sae.model import SparseAutoencoder

# The least rise of the loss, as a share of max(1, clean loss), that zero-ablating the site must cause for
# "loss recovered" to mean anything: below 1 % the gap is of the size of the loss's own sampling noise on a
# few thousand held-out tokens, and an untrained model's is 1e-4 of it.
UNDEFINED_GAP = 0.01

@dataclass(frozen=True)
class SAEMetrics:
    """An SAE's figures on held-out tokens."""

    tokens: int  # held-out tokens measured
    l0: float  # mean features active per token
    explained_variance: float  # fraction of the site's variance the reconstruction keeps
    loss_clean: float  # the model's own next-token loss, nats
    loss_spliced: float  # with the SAE's reconstruction in place of the site's value
    loss_zero: float  # with the site's value set to zero
    dead: float  # share of features never active on these tokens

    @property
    def loss_recovered(self) -> float | None:
        """(zero - spliced) / (zero - clean): the share of the ablation's damage the SAE repairs; None where
        ablating the site barely changes the loss (UNDEFINED_GAP), which leaves no damage to share."""
        gap = self.loss_zero - self.loss_clean
        if gap <= UNDEFINED_GAP * max(1.0, self.loss_clean):
            return None
        return (self.loss_zero - self.loss_spliced) / gap

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_recovered": self.loss_recovered}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SAEMetrics:
        return cls(**{k: v for k, v in values.items() if k != "loss_recovered"})


@torch.no_grad()
def mean_loss(model: GPT, inputs: torch.Tensor, targets: torch.Tensor, hooks: Mapping[str, HookFn],
              batch: int = 64) -> float:
    """The model's mean next-token loss over windows (B, T) with `hooks` in place."""
    device = next(model.parameters()).device
    total = 0.0
    with hooked(model, hooks):
        for start in range(0, len(inputs), batch):
            x, y = inputs[start : start + batch].to(device), targets[start : start + batch].to(device)
            _, loss = model(x, y)
            total += float(loss) * x.numel()
    return total / inputs.numel()


@torch.no_grad()
def reconstruction(sae: SparseAutoencoder, x: torch.Tensor, chunk: int = 4096) -> tuple[float, float, float]:
    """L0, explained variance and the share of dead features of the SAE on activations x (N, D)."""
    active, error, fired = 0.0, 0.0, torch.zeros(sae.width, dtype=torch.bool, device=x.device)  # (F,)
    for start in range(0, len(x), chunk):
        part = x[start : start + chunk]
        acts = sae.encode(part)  # (n, F)
        active += float((acts > 0).sum())
        error += float((sae.decode(acts) - part).pow(2).sum())
        fired |= (acts > 0).any(0)
    variance = float((x - x.mean(0)).pow(2).sum())
    return active / len(x), 1 - error / max(variance, 1e-12), float((~fired).float().mean())


@torch.no_grad()
def evaluate_sae(model: GPT, sae: SparseAutoencoder, site: str, inputs: torch.Tensor, targets: torch.Tensor,
                 x: torch.Tensor) -> SAEMetrics:
    """L0, explained variance, dead features and the clean, spliced and zero-ablated losses on windows
    `inputs` (B, T) with next tokens `targets` (B, T), whose activations at `site` are x (B*T, D) (as
    `sae_data.site_activations` reads them); the SAE is on the model's device."""
    l0, explained, dead = reconstruction(sae, x)

    def splice(value: torch.Tensor, name: str) -> torch.Tensor:
        return sae(value.float()).to(value.dtype)

    def zero(value: torch.Tensor, name: str) -> torch.Tensor:
        return torch.zeros_like(value)

    clean, spliced, zeroed = (mean_loss(model, inputs, targets, hooks) for hooks in ({}, {site: splice},
                                                                                      {site: zero}))
    return SAEMetrics(tokens=len(x), l0=l0, explained_variance=explained, loss_clean=clean,
                      loss_spliced=spliced, loss_zero=zeroed, dead=dead)
