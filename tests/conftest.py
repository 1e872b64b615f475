"""Shared fixtures: tiny configs and deterministic seeds."""

from __future__ import annotations

import pytest
import torch

from gptlab.config import ModelConfig


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tiny_config(**changes: object) -> ModelConfig:
    """A model small enough to build and run in milliseconds."""
    base = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
    return ModelConfig(**{**base, **changes})
