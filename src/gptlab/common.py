"""Shared plumbing for every entry point: device and precision choice, seeding, the decoding layout."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

# Measured on a 2-core AVX512-BF16/AMX CPU (benchmarks/train_throughput.py): bfloat16 autocast
# made a 128-wide model slower and a 384-wide one about 2x faster, so "auto" switches at this width.
CPU_BF16_MIN_WIDTH = 256


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA, then Apple's MPS, then the CPU; other names are checked for availability."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a device name (try cpu, cuda, cuda:0, mps, auto)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available: use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r} was asked for but MPS is not available: use --device cpu")
    return device


def cpu_has_bf16_matmul() -> bool:
    """True when this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_precision(precision: str, device: torch.device, n_embd: int) -> torch.dtype:
    """The autocast dtype for `precision` (auto, float32, bfloat16) on this device and model width."""
    if precision == "float32":
        return torch.float32
    if precision == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and cpu_has_bf16_matmul() and n_embd >= CPU_BF16_MIN_WIDTH:
        return torch.bfloat16
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed-precision context for the forward pass; a no-op in float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for reproducible runs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def decoding_layout(model: torch.nn.Module) -> torch.nn.Module:
    """Store every nn.Linear weight column-major, in place: the same values and shape, transposed strides.

    At batch 1 a decoding step is one matrix-vector product per weight, and PyTorch's CPU kernels read
    an (in x out) contiguous matrix about twice as fast as nn.Linear's (out x in) one once it outgrows
    the caches (GPT-2 small's tied head: 13.3 against 7.4 ms; a whole step: 46.2 against 33.5 ms on a
    2-core EPYC). Logits are unchanged. `load_run` applies it to models loaded for inference on the CPU;
    training keeps the usual layout. Applying it twice changes nothing.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()  # a tied head is converted once
    return model
