"""gptlab: small Transformer language models, verified against handout #11, and encoder-decoders
assembled from the same parts.

The public names below are imported when first used, so `import gptlab` (and every `gptlab --help`)
does not wait for torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gptlab.config import ModelConfig, Seq2SeqConfig, parameter_count
    from gptlab.handout.learner.notebook import check
    from gptlab.model import GPT
    from gptlab.seq2seq.model import EncoderDecoder

__all__ = ["GPT", "EncoderDecoder", "ModelConfig", "Seq2SeqConfig", "check", "parameter_count"]
__version__ = "0.1.0"
# Each public name and the module that defines it.
_HOMES = {"GPT": "gptlab.model", "parameter_count": "gptlab.config", "EncoderDecoder": "gptlab.seq2seq.model",
          "ModelConfig": "gptlab.config", "Seq2SeqConfig": "gptlab.config",
          "check": "gptlab.handout.learner.notebook"}  # gptlab.check(attention=..., model=...) in a notebook


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
