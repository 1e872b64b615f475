"""The TopK sparse autoencoder: its encoding against a naive one, its training step, and the planted-feature
toy, whose features an SAE must find."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from gptlab.sae.config import SAEConfig
from gptlab.sae.model import DEAD_TOKENS, SAETrainer, SparseAutoencoder, keep_top
from gptlab.sae.toy import planted_features, recovery

pytestmark = pytest.mark.usefixtures("one_thread")


def naive_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Row by row: the k largest scores, each kept only when positive; every other entry zero."""
    out = torch.zeros_like(scores)
    for row, values in enumerate(scores.tolist()):
        for column in sorted(range(len(values)), key=lambda c: -values[c])[:k]:
            out[row, column] = max(values[column], 0.0)
    return out


def test_encode_keeps_the_k_largest_scores_through_a_relu() -> None:
    sae = SparseAutoencoder(6, 20, 3, seed=1)
    with torch.no_grad():
        sae.b_enc.normal_()
        sae.b_dec.normal_()
    x = torch.randn(9, 6)
    scores = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    assert_close(sae.encode(x), naive_topk(scores, 3))
    assert_close(sae(x), naive_topk(scores, 3) @ sae.W_dec + sae.b_dec)
    assert ((sae.encode(x) > 0).sum(-1) <= 3).all()
    assert_close(keep_top(-scores.abs(), 2), torch.zeros_like(scores))  # no positive score: nothing fires


def test_training_explains_more_variance_and_keeps_decoder_rows_unit() -> None:
    toy = planted_features(40 * 128, 8, 12, 2.0, seed=3)
    trainer = SAETrainer(SparseAutoencoder(8, 24, 2, seed=0), lr=5e-3)
    losses = [trainer.step(batch) for batch in toy.activations.split(128)]
    assert losses[-1] < 0.6 * losses[0]
    assert_close(trainer.sae.W_dec.norm(dim=-1), torch.ones(24))
    assert trainer.steps == 40 and int(trainer.since_fired.max()) < DEAD_TOKENS
    first = SAETrainer(SparseAutoencoder(8, 24, 2, seed=0), lr=5e-3)
    first.step(toy.activations[:128])  # b_dec starts at the batch's mean, then takes one Adam step (<= lr)
    assert_close(first.sae.b_dec.detach(), toy.activations[:128].mean(0), atol=5.01e-3, rtol=0)


def test_dead_features_learn_through_the_auxiliary_loss() -> None:
    x = planted_features(6, 8, 12, 2.0, seed=4).activations  # few tokens: few features fire

    def changed_columns(dead: bool) -> int:
        trainer = SAETrainer(SparseAutoencoder(8, 24, 2, seed=0), lr=1e-2)
        trainer.steps = 1  # past the first step, which sets b_dec
        if dead:
            trainer.since_fired[:] = DEAD_TOKENS
        before = trainer.sae.W_enc.detach().clone()
        trainer.step(x)
        return int((trainer.sae.W_enc.detach() != before).any(0).sum())

    fired = int((SparseAutoencoder(8, 24, 2, seed=0).encode(x) > 0).any(0).sum())
    assert changed_columns(dead=False) == fired < 24  # only features that fired learn...
    assert changed_columns(dead=True) > fired  # ...unless the dead ones' best scores stand in too


def test_config_fills_in_the_width_and_counts_whole_steps() -> None:
    assert SAEConfig(expansion=4).resolved(16).width == 64
    assert SAEConfig(width=100).resolved(16).width == 100
    assert SAEConfig(tokens=1000, batch_size=256).steps == 4
    with pytest.raises(ValueError, match=r"^SAEConfig\.k=0 must be positive$"):
        SAEConfig(k=0)
    with pytest.raises(ValueError, match=r"^SAEConfig\.width=4 is smaller than k=8"):
        SAEConfig(width=4, k=8)


@pytest.mark.slow
def test_planted_features_are_recovered() -> None:
    # 48 features in 32 dimensions (superposition), about 2 active per token; twice as many SAE features.
    toy = planted_features(300 * 256 + 8192, 32, 48, 2.0, seed=1)
    trainer = SAETrainer(SparseAutoencoder(32, 96, 3, seed=0), lr=5e-3)
    for batch in toy.activations[:-8192].split(256):
        trainer.step(batch)
    held_out = type(toy)(toy.activations[-8192:], toy.directions, toy.coefficients[-8192:])
    found = recovery(trainer.sae, held_out)
    assert found.cosine >= 0.9 and found.correlation >= 0.9, found
