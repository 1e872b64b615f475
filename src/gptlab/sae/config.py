"""The settings of a sparse autoencoder on a run's activations (`gptlab sae train`), torch-free so that the
command's --help lists them without loading torch. Saved as JSON in the SAE's folder (sae.json) and
compared there: see `sae_training`."""

from __future__ import annotations

from dataclasses import dataclass

from gptlab.config import Config, check_positive, option


@dataclass
class SAEConfig(Config):
    """What an SAE is trained on and how; `width` None means `expansion` times the site's width."""

    site: str = option("h.0.resid_post", "the hook point whose activations are encoded, e.g. h.1.resid_post")
    k: int = option(16, "features active per token (TopK): the SAE's L0")
    width: int | None = option(None, "features in the dictionary")
    expansion: int = option(8, "features per dimension of the site, when width is not given")
    tokens: int = option(1_000_000, "activation vectors (tokens) to train on; a larger value continues a run")
    batch_size: int = option(4096, "activation vectors per step")
    lr: float = option(1e-3, "Adam's learning rate (constant)")
    seed: int = option(0, "seed of the initial weights and of the windows read from the data")

    def validate(self) -> None:
        check_positive("SAEConfig", k=self.k, expansion=self.expansion, tokens=self.tokens,
                       batch_size=self.batch_size, lr=self.lr)
        if self.width is not None and self.width < self.k:
            raise ValueError(f"SAEConfig.width={self.width} is smaller than k={self.k}: give at least k "
                             "features")

    @property
    def steps(self) -> int:
        """Steps of batch_size vectors that cover `tokens`, the last batch whole."""
        return -(-self.tokens // self.batch_size)

    def resolved(self, d_in: int) -> SAEConfig:
        """This config with `width` filled in for a site of width `d_in`."""
        return self.replace(width=self.width or self.expansion * d_in)
