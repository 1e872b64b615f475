"""A TopK sparse autoencoder (SAE) over one hook point's activations, and its training step.

A sparse autoencoder rewrites each activation vector x (width D) as a sum of a few of F learned feature
directions (F several times D): the encoder scores every feature, keeps the k largest scores (TopK),
and the decoder adds those features' directions back up. Reading what makes a feature fire is a way to
name the directions the model uses (Bricken et al. 2023, "Towards monosemanticity").

The TopK form (Gao et al. 2024, "Scaling and evaluating sparse autoencoders") fixes the number of active
features, L0, at k, so there is no sparsity penalty to tune; its formulas are SAELens's `topk`
architecture with its default settings (b_dec subtracted from the input, no rescaling), so the weights
export as they are (`sae_export`):

    pre  = (x - b_dec) W_enc + b_enc       scores of every feature             (N, F)
    acts = ReLU of the k largest of pre,   every other feature 0               (N, F)
    x^   = acts W_dec + b_dec              the reconstruction                  (N, D)

Training, as Gao et al.: the loss is the squared error normalised by the batch's variance (so it reads
as the fraction of variance left unexplained), plus 1/32 of the AuxK loss, which lets the D/2
best-scoring dead features (none fired in the last DEAD_TOKENS tokens) reconstruct what the main k
missed, so that features which stopped firing come back. Decoder rows are kept at unit norm, so a
feature's activation is the length it adds along its direction; the encoder starts as the decoder's
transpose and b_dec at the mean of the first activations.

Shape legend: N activation vectors (tokens), D their width (d_in), F features (width).
"""

from __future__ import annotations

import torch
from torch import nn

AUX_COEFFICIENT = 1 / 32  # the AuxK loss's weight (Gao et al. 2024)
DEAD_TOKENS = 200_000  # a feature that has not fired in this many training tokens counts as dead


class SparseAutoencoder(nn.Module):
    """The TopK SAE: `encode` gives each token's feature activations, `decode` their reconstruction."""

    def __init__(self, d_in: int, width: int, k: int, seed: int = 0) -> None:
        super().__init__()
        if not 0 < k <= width:
            raise ValueError(f"k={k} must be between 1 and the width {width}")
        self.d_in, self.width, self.k = d_in, width, k
        generator = torch.Generator().manual_seed(seed)
        directions = nn.functional.normalize(torch.randn(width, d_in, generator=generator), dim=-1)  # (F, D)
        self.W_enc = nn.Parameter(directions.T.clone())  # (D, F)
        self.b_enc = nn.Parameter(torch.zeros(width))  # (F,)
        self.W_dec = nn.Parameter(directions)  # (F, D)
        self.b_dec = nn.Parameter(torch.zeros(d_in))  # (D,)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """Every feature's score (..., F) for activations x (..., D)."""
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations (..., F): the k largest scores through a ReLU, zero elsewhere."""
        return keep_top(self.pre_activations(x), self.k)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """The reconstruction (..., D) of feature activations (..., F)."""
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) encoded and decoded again: what splicing the SAE in puts in x's place."""
        return self.decode(self.encode(x))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Scale every decoder row back to unit length."""
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def keep_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row of scores (..., F) through a ReLU, every other entry zero."""
    top = scores.topk(k, dim=-1)
    return torch.zeros_like(scores).scatter(-1, top.indices, top.values.relu())


def unexplained(x: torch.Tensor, reconstruction: torch.Tensor) -> torch.Tensor:
    """The squared error of a reconstruction of x (N, D) over x's own variance about its mean: 1 - R^2."""
    return (reconstruction - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum().clamp_min(1e-12)


class SAETrainer:
    """Adam on an SAE, with the count of tokens since each feature last fired (for the AuxK loss)."""

    def __init__(self, sae: SparseAutoencoder, lr: float) -> None:
        self.sae = sae
        self.optimizer = torch.optim.Adam(sae.parameters(), lr=lr)
        self.since_fired = torch.zeros(sae.width, dtype=torch.long)  # (F,) tokens since each last fired
        self.steps = 0

    def step(self, x: torch.Tensor) -> float:
        """One Adam step on a batch of activations x (N, D); the batch's fraction of unexplained variance."""
        sae = self.sae
        if self.steps == 0:  # start the decoder's bias at the data's mean
            with torch.no_grad():
                sae.b_dec.copy_(x.mean(0))
        pre = sae.pre_activations(x)  # (N, F)
        acts = keep_top(pre, sae.k)
        reconstruction = sae.decode(acts)
        loss = unexplained(x, reconstruction)
        dead = self.since_fired >= DEAD_TOKENS  # (F,)
        aux_k = min(sae.d_in // 2, int(dead.sum()))
        if aux_k > 0:  # the dead features' best scores reconstruct what the live ones missed
            error = (x - reconstruction).detach()
            aux = keep_top(pre.masked_fill(~dead.to(pre.device), -torch.inf), aux_k) @ sae.W_dec
            loss = loss + AUX_COEFFICIENT * unexplained(error, aux)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        sae.normalize_decoder()
        fired = (acts > 0).any(0).cpu()  # (F,)
        self.since_fired = torch.where(fired, 0, self.since_fired + len(x))
        self.steps += 1
        return float(loss.detach())
