"""The loading functions `gptlab.checkpoint` had before `gptlab.load`, kept for one release: each is
`gptlab.inference.loading` under its old signature, reached through `gptlab.checkpoint`'s deprecation
warning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gptlab.checkpoint import BEST, Checkpoint, load_header
from gptlab.inference.loading import load_seq2seq, read_for_inference, ready_model
from gptlab.model import GPT
from gptlab.seq2seq.model import EncoderDecoder
from gptlab.text.tokenizer import Tokenizer

__all__ = ["generation_defaults", "inference_model", "load_for_inference", "load_run", "load_seq2seq"]


def inference_model(checkpoint: Checkpoint, path: str | Path, device: torch.device | str = "cpu",
                    expect: str = "decoder", dtype: torch.dtype = torch.float32) -> GPT | EncoderDecoder:
    """`ready_model` with the weights cast to a torch dtype."""
    return ready_model(checkpoint, device, str(dtype).removeprefix("torch."), expect=expect)  # type: ignore[call-overload]


def load_run(path: str | Path, device: torch.device | str = "cpu", prefer: str = BEST,
             expect: str = "decoder",
             dtype: torch.dtype = torch.float32) -> tuple[GPT | EncoderDecoder, Tokenizer]:
    """The model and tokenizer of a run, as `gptlab.load` makes them."""
    checkpoint = read_for_inference(path, prefer)
    return inference_model(checkpoint, path, device, expect, dtype), checkpoint.load_tokenizer()


def load_for_inference(run: str | Path, device: torch.device | str = "cpu", dtype: str = "float32",
                       quantize: str = "none") -> tuple[GPT | EncoderDecoder, Tokenizer]:
    """The model and tokenizer of a run, its weights held as `dtype` and `quantize` say."""
    checkpoint = read_for_inference(run)
    return ready_model(checkpoint, device, dtype, quantize), checkpoint.load_tokenizer()


def generation_defaults(run_path: str | Path) -> dict[str, Any]:
    """The run's sampling defaults (`LM.defaults`)."""
    return dict(load_header(run_path).state.get("generation", {}))
