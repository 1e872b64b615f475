"""A planted-feature toy with a known answer: activations mixed from known sparse features, and how well
an SAE trained on them recovers those features.

Each toy activation is a sum of a few of `features` random unit directions in `d` dimensions, each
present with probability active / features and a non-negative coefficient drawn from [0.5, 1.5): the
sparse, non-negative superposition that sparse autoencoders assume (Sharkey et al. 2022, "Taking
features out of superposition"). Recovery is scored two ways, each a mean over the true features of the
best match among the SAE's: the cosine between the true direction and a decoder row (mean max cosine
similarity), and the correlation between the true coefficient and a feature's activation over the
tokens.

Shape legend: N tokens, D width, G true features, F SAE features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptlab.sae.model import SparseAutoencoder


@dataclass(frozen=True)
class PlantedFeatures:
    """Toy activations and the features they were mixed from."""

    activations: torch.Tensor  # (N, D)
    directions: torch.Tensor  # (G, D), unit rows
    coefficients: torch.Tensor  # (N, G), non-negative and sparse


@dataclass(frozen=True)
class Recovery:
    """How well an SAE found the planted features (1.0: every one exactly)."""

    cosine: float  # mean over true features of the largest cosine with a decoder row
    correlation: float  # mean over true features of the largest correlation with a feature's activation


def planted_features(tokens: int, d: int, features: int, active: float, seed: int = 0) -> PlantedFeatures:
    """`tokens` activations of width `d`, each mixing about `active` of `features` random unit directions."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(features, d, generator=generator), dim=-1)
    present = torch.rand(tokens, features, generator=generator) < active / features  # (N, G)
    coefficients = present * (0.5 + torch.rand(tokens, features, generator=generator))
    return PlantedFeatures(coefficients @ directions, directions, coefficients)


def standardized(values: torch.Tensor) -> torch.Tensor:
    """Columns of values (N, C) at mean 0 and length 1 (a column that never varies stays 0)."""
    centred = values - values.mean(0)
    return centred / centred.norm(dim=0).clamp_min(1e-12)


@torch.no_grad()
def recovery(sae: SparseAutoencoder, toy: PlantedFeatures) -> Recovery:
    """Mean max cosine of the true directions with the decoder's rows, and mean max correlation of the true
    coefficients with the SAE's activations on the toy's tokens."""
    unit_rows = torch.nn.functional.normalize(sae.W_dec, dim=-1)  # (F, D)
    cosines = toy.directions @ unit_rows.T  # (G, F)
    correlations = standardized(toy.coefficients).T @ standardized(sae.encode(toy.activations))  # (G, F)
    return Recovery(float(cosines.max(1).values.mean()), float(correlations.max(1).values.mean()))
