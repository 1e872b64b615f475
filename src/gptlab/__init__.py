"""gptlab: small Transformer language models, verified against handout #11, and encoder-decoders
assembled from the same parts."""

from gptlab.config import ModelConfig, Seq2SeqConfig
from gptlab.encoder_decoder import EncoderDecoder
from gptlab.model import GPT, parameter_count

__all__ = ["GPT", "EncoderDecoder", "ModelConfig", "Seq2SeqConfig", "parameter_count"]
__version__ = "0.1.0"
