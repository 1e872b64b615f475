"""gptlab: small decoder-only Transformer language models, verified against handout #11."""

from gptlab.config import ModelConfig
from gptlab.model import GPT, parameter_count

__all__ = ["GPT", "ModelConfig", "parameter_count"]
__version__ = "0.1.0"
