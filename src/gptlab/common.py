"""Shared plumbing for every entry point: device and precision choice, seeding, the decoding layout,
whether progress bars are shown."""

from __future__ import annotations

import contextlib
import platform
import random
import subprocess
import sys
import time

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
    by timing both precisions (gptlab.machine) and hands a concrete value on."""
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


LAYOUTS = ("measure", "column", "row")
LAYOUT_SAMPLE_BYTES = 64 * 2**20  # weights timed when measuring: enough to stream from memory, not cache


def faster_layout(model: torch.nn.Module, rounds: int = 3) -> str:
    """"column" or "row": the storage in which batch-1 products over this model's nn.Linear weights run
    faster on this CPU, timed now (the best of `rounds` alternating passes over up to 64 MB of them).

    Which layout a matrix-vector product reads faster differs between CPUs and between days on one
    shared machine (column-major won by 2x on a 2-core EPYC; on a 2-core Xeon the two were within 15%,
    either way round), so it is measured rather than fixed.
    """
    weights, seen, total = [], set(), 0
    for module in model.modules():
        fresh = isinstance(module, torch.nn.Linear) and module.weight.data_ptr() not in seen
        if fresh and total < LAYOUT_SAMPLE_BYTES:
            seen.add(module.weight.data_ptr())
            weights.append(module.weight.detach())
            total += module.weight.numel() * module.weight.element_size()
    if not weights:
        return "row"
    rows = [w.contiguous() for w in weights]
    columns = [w.t().contiguous().t() for w in weights]
    inputs = {w.size(1): torch.ones(1, w.size(1), dtype=w.dtype, device=w.device) for w in weights}

    def seconds(layout: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for w in layout:
            torch.nn.functional.linear(inputs[w.size(1)], w)
        return time.perf_counter() - start

    best = {"row": float("inf"), "column": float("inf")}
    for _ in range(rounds):
        best["row"] = min(best["row"], seconds(rows))
        best["column"] = min(best["column"], seconds(columns))
    return min(best, key=best.__getitem__)


def decoding_layout(model: torch.nn.Module, layout: str = "measure") -> torch.nn.Module:
    """Store every nn.Linear weight in the layout batch-1 decoding reads fastest, in place: the same
    values and shape, only the strides change ("column": (in, out) contiguous; "row": nn.Linear's own).

    At batch 1 a decoding step is one matrix-vector product per weight, read from memory once the
    weights outgrow the caches. "measure" times both on this CPU (`faster_layout`). Logits are
    unchanged. `load_run` applies it to models loaded for inference on the CPU; training keeps the
    usual layout. Applying it twice changes nothing.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "measure":
        layout = faster_layout(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # a tied head is converted once
            weight = module.weight.data
            module.weight.data = weight.t().contiguous().t() if layout == "column" else weight.contiguous()
    return model
