"""Shared plumbing for every entry point: device and precision choice, seeding, whether progress bars
are shown."""

from __future__ import annotations

import contextlib
import importlib
import math
import platform
import random
import subprocess
import sys
from types import ModuleType

import numpy as np
import torch

from gptlab.config import SettingError

# Measured on a 2-core AVX512-BF16/AMX CPU (benchmarks/train_throughput.py): bfloat16 autocast
# made a 128-wide model slower and a 384-wide one about 2x faster, so "auto" switches at this width.
CPU_BF16_MIN_WIDTH = 256


def need(module: str, extra: str, what: str) -> ModuleType:
    """Import the optional package `module`, or raise a ValueError whose one line (the CLI's `gptlab:
    error:` line) names the extra that installs it: "export-gguf needs the gguf package: pip install
    'gptlab[gguf]'"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs the {module.partition('.')[0]} package: "
                         f"pip install 'gptlab[{extra}]'") from None


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
        raise SettingError(f"device={name!r} was asked for but CUDA is not available: use {{d}} cpu",
                           d="device")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SettingError(f"device={name!r} was asked for but MPS is not available: use {{d}} cpu",
                           d="device")
    return device


def on_terminal() -> bool:
    """Whether stdout and stderr are both terminals: a progress bar redraws in place there, but becomes
    thousands of lines in a log file, a pipe or CI's output, where one line per evaluation is printed."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def cpu_name() -> str:
    """The processor's model name (lscpu's "Model name"), for benchmark tables: figures name their CPU."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        return next(names)
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def cpu_has_bf16_matmul() -> bool:
    """True when this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_precision(precision: str, device: torch.device, n_embd: int) -> torch.dtype:
    """The autocast dtype for `precision` (auto, float32, bfloat16) on this device and model width.

    Here "auto" is a fixed width rule, the fallback where nothing was measured: a new run resolves "auto"
    by timing both precisions (gptlab.training.machine) and hands a concrete value on."""
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


def perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged loss prints as inf rather than raising."""
    return math.exp(loss) if loss < 700 else math.inf


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for reproducible runs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
