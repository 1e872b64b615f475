"""Loading a run for inference, once: `gptlab.load(path) -> LM`, the one way every command and notebook
reads a model to use it.

A run folder or checkpoint file is read once (an adapter run: its adapters, then its base); a Hugging
Face folder (told from a run folder by its `config.json` and the absence of a checkpoint) is converted
in memory by the importer, nothing written. The model is then made ready to run, in this order:
adapters attached (or merged, when int8 would otherwise replace their layers), moved to the device in
eval mode, laid out for batch-1 decoding on the CPU (`layouts`), and its weights held in bfloat16 or
int8 as asked (`quantize`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal, overload

import torch

from gptlab.checkpoint import (
    ADAPTER,
    BEST,
    Checkpoint,
    architecture,
    has_checkpoint,
    load_checkpoint,
    require_architecture,
)
from gptlab.common import resolve_device
from gptlab.config import TaskConfig
from gptlab.inference.layouts import decoding_layout
from gptlab.inference.lm import LM
from gptlab.inference.quantize import inference_weights
from gptlab.lora import merge_lora
from gptlab.model import GPT
from gptlab.seq2seq.model import EncoderDecoder
from gptlab.text.tokenizer import SymbolTokenizer


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model folder (a config.json, no gptlab checkpoint), not a run."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and not has_checkpoint(path)


def read_for_inference(path: str | Path, prefer: str = BEST, progress: bool = False) -> Checkpoint:
    """The checkpoint a run folder, checkpoint file or Hugging Face folder holds, without optimiser slots,
    read once."""
    if is_hf_folder(path):
        from gptlab.interop.huggingface import read_hf  # transformers-free, but a large module

        return read_hf(path, progress)[0]
    return load_checkpoint(path, prefer, optimizer=False)


@overload
def ready_model(checkpoint: Checkpoint, device: torch.device | str = ..., dtype: str = ...,
                quantize: str = ..., expect: Literal["decoder"] = ...) -> GPT: ...
@overload
def ready_model(checkpoint: Checkpoint, device: torch.device | str = ..., dtype: str = ...,
                quantize: str = ..., *, expect: Literal["encoder-decoder"]) -> EncoderDecoder: ...
def ready_model(checkpoint: Checkpoint, device: torch.device | str = "cpu", dtype: str = "float32",
                quantize: str = "none", expect: str = "decoder") -> GPT | EncoderDecoder:
    """The checkpoint's model ready to run: adapters on (merged first under int8, which replaces every
    linear layer, theirs too), on `device` in eval mode, in the decoding layout on the CPU, its weights
    held as `dtype` (float32, bfloat16) and `quantize` (none, int8) say. Another architecture than
    `expect` is a ValueError saying which commands to use."""
    require_architecture(architecture(checkpoint.model_config), checkpoint.source, expect)
    model = checkpoint.build_model()
    if quantize != "none" and ADAPTER in checkpoint.state and isinstance(model, GPT):
        model = merge_lora(model)
    model = model.to(device=device, dtype=torch.float32).eval()
    if next(model.parameters()).device.type == "cpu":  # faster batch-1 decoding, the same logits
        decoding_layout(model)
    return inference_weights(model, dtype, quantize)


def header_of(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint without its tensors (configs, tokenizer, state), as `load_header` reads one, so a
    loaded model does not keep a second copy of its weights alive."""
    return replace(checkpoint, model_state={}, optimizer_state=None, rng={})


def load(path: str | Path, *, device: str | torch.device | None = None, dtype: str | None = None,
         quantize: str | None = None, prefer: str = BEST, progress: bool = False) -> LM:
    """A run (folder or checkpoint file) or Hugging Face folder, ready to generate, chat and inspect.

    `device` (default the CPU; "auto" picks CUDA, then MPS), `dtype` (float32, the default, or
    bfloat16) and `quantize` (none or int8) say where and how the weights are held. The checkpoint is
    read once; the `LM` carries the model, tokenizer, the run's sampling defaults and chat template.
    """
    torch_device = device if isinstance(device, torch.device) else resolve_device(device or "cpu")
    checkpoint = read_for_inference(path, prefer, progress)
    model = ready_model(checkpoint, torch_device, dtype or "float32", quantize or "none")
    return LM(model, checkpoint.load_tokenizer(), header_of(checkpoint), str(path))


def load_seq2seq(path: str | Path, device: torch.device | str = "cpu", dtype: str = "float32",
                 quantize: str = "none") -> tuple[EncoderDecoder, SymbolTokenizer, TaskConfig]:
    """The encoder-decoder (ready to run as `ready_model` makes it), its vocabulary and its task, from a
    seq2seq run, read once."""
    checkpoint = load_checkpoint(path, optimizer=False)
    model = ready_model(checkpoint, device, dtype, quantize, expect="encoder-decoder")
    vocab = checkpoint.load_tokenizer()
    if not isinstance(vocab, SymbolTokenizer):  # every seq2seq run is trained on tasks.vocabulary()
        raise ValueError(f"{path} holds a {vocab.kind} tokenizer, not a seq2seq task's symbols: "
                         "use another run")
    return model, vocab, TaskConfig.from_dict(checkpoint.state["task"])


