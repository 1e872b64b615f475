"""The tensors a gptlab GPT stores, by name and shape: what every conversion's name map is checked
against (each target filled, each shape asserted), for Hugging Face folders and GGUF files alike."""

from __future__ import annotations

import torch

from gptlab.config import ModelConfig
from gptlab.model import GPT

HEAD = "lm_head.weight"  # the output head; a tied model stores it once, as the token embedding


def expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Shapes of the gptlab tensors a model of this config stores (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    state = model.state_dict()
    if config.tied:
        state.pop(HEAD)  # the embedding holds it
    return {name: tensor.shape for name, tensor in state.items()}
