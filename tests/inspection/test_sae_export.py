"""The SAELens files: gptlab reads back what it writes, refuses what it cannot compute, and SAELens itself
(the `sae` extra, in an environment of its own: see docs/sae.md) loads them into an SAE that gives gptlab's
encodings. gptlab never imports sae_lens; that test skips without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from gptlab.data.tokens import TokenData
from gptlab.inference.loading import load
from gptlab.sae.config import SAEConfig
from gptlab.sae.data import held_out_windows, site_activations
from gptlab.sae.export import CONFIG, WEIGHTS, Provenance, read_saelens, write_saelens
from gptlab.sae.model import SparseAutoencoder
from gptlab.sae.training import train_sae

PROVENANCE = Provenance("h.1.resid_post", "demo", 64, "runs/demo/data")


def perturbed_sae() -> SparseAutoencoder:
    """A small SAE whose biases are not zero, so that every term of the formulas shows."""
    sae = SparseAutoencoder(8, 32, 3, seed=2)
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.1)
        sae.b_dec.normal_()
    return sae


def test_the_files_read_back_as_the_same_sae(tmp_path: Path) -> None:
    sae = perturbed_sae()
    write_saelens(sae, tmp_path, PROVENANCE)
    again, provenance = read_saelens(tmp_path)
    assert provenance == PROVENANCE
    for name, tensor in sae.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    config = json.loads((tmp_path / CONFIG).read_text())
    assert (config["architecture"], config["k"], config["d_in"], config["d_sae"]) == ("topk", 3, 8, 32)
    assert config["metadata"]["hook_name"] == "h.1.resid_post" and config["metadata"]["prepend_bos"] is False


def test_files_gptlab_cannot_compute_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"holds no SAE \(.*cfg\.json is missing\): train one"):
        read_saelens(tmp_path)
    write_saelens(perturbed_sae(), tmp_path, PROVENANCE)
    config = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**config, "normalize_activations": "layer_norm"}))
    with pytest.raises(ValueError, match=r"describes a topk SAE with settings gptlab does not compute"):
        read_saelens(tmp_path)
    (tmp_path / CONFIG).write_text(json.dumps({**config, "d_sae": 16}))
    with pytest.raises(ValueError, match=rf"{WEIGHTS} does not fit"):
        read_saelens(tmp_path)


@pytest.mark.slow
def test_saelens_loads_the_export_with_the_same_encodings(trained_run: Path, tmp_path: Path) -> None:
    sae_lens = pytest.importorskip("sae_lens", reason="SAELens is gptlab's `sae` extra: pip install "
                                   "'gptlab[sae]' (docs/sae.md)")
    site = "h.1.resid_post"
    train_sae(trained_run, SAEConfig(site=site, k=4, expansion=4, tokens=2048, batch_size=256), tmp_path)
    ours, _ = read_saelens(tmp_path)
    theirs = sae_lens.SAE.load_from_disk(str(tmp_path))
    assert type(theirs).__name__ == "TopKSAE" and theirs.cfg.k == 4
    assert theirs.cfg.metadata.hook_name == site
    model = load(trained_run).model
    inputs, _ = held_out_windows(TokenData(trained_run.parent / "data").val, model.config.block_size)
    x = site_activations(model, site, inputs)  # (B, T, D): the same activations for both
    with torch.no_grad():
        codes = theirs.encode(x)
        assert_close(codes, ours.encode(x))
        assert (codes > 0).sum() > 0
        assert_close(theirs.decode(codes), ours.decode(codes))
        assert_close(theirs(x), ours(x))
    perturbed = perturbed_sae()  # nonzero biases: b_dec subtracted before encoding, on both sides
    write_saelens(perturbed, tmp_path / "perturbed", PROVENANCE)
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert_close(sae_lens.SAE.load_from_disk(str(tmp_path / "perturbed")).encode(x), perturbed.encode(x))
