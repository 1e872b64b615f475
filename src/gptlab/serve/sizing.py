"""How many rows of how many tokens the server can hold: the KV cache's worst case against free memory.

A row of the batch may hold up to `max_context` tokens of keys and values in every layer, so the worst
case is `kv_cache_bytes(config, max_batch, max_context)`; with the weights it must fit in the memory
free before the model was loaded. When the user chose neither the batch nor the context, the server
picks the largest batch (up to DEFAULT_MAX_BATCH) that fits rather than refusing to start; when the
user chose one and it does not fit, the refusal says what to lower, and to what.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.config import ModelConfig, SettingError
from gptlab.kv_cache import kv_cache_bytes

DEFAULT_MAX_BATCH = 64
HEADROOM = 0.8  # of the free memory, for activations, the allocator's slack and the HTTP side
GB = 1e9


@dataclass(frozen=True)
class Plan:
    """The batch and context the server will hold, and what they cost in the worst case (bytes)."""

    max_batch: int
    max_context: int
    cache_bytes: int
    chosen: bool  # whether max_batch was chosen here to fit, rather than given


def available_memory(device: torch.device) -> int | None:
    """Bytes free now: the device's free memory for CUDA, MemAvailable of /proc/meminfo for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None  # nothing to ask (mps): no check
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tied tensor counted once."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def plan_memory(config: ModelConfig, dtype: torch.dtype, weights: int, available: int | None,
                max_batch: int | None = None, max_context: int | None = None) -> Plan:
    """The batch and context to serve with: as given when they fit, the largest batch that fits when
    neither is given; a ValueError saying what to lower when given ones do not fit."""
    context = max_context or config.block_size
    if context > config.block_size:
        raise SettingError(f"{{max_context}} {context} is more than the model's context window "
                           f"({config.block_size}): give at most {config.block_size}",
                           max_context="max_context")
    batch = max_batch or DEFAULT_MAX_BATCH
    if available is None:
        return Plan(batch, context, kv_cache_bytes(config, batch, context, dtype), False)
    budget = int(available * HEADROOM) - weights
    rows_fit = max(0, budget) // kv_cache_bytes(config, 1, context, dtype)
    if max_batch is None and max_context is None and 1 <= rows_fit < batch:
        return Plan(rows_fit, context, kv_cache_bytes(config, rows_fit, context, dtype), True)
    need = kv_cache_bytes(config, batch, context, dtype)
    if need <= budget:
        return Plan(batch, context, need, False)
    tokens_fit = max(0, budget) // kv_cache_bytes(config, batch, 1, dtype)
    fixes = ([f"{{max_batch}} to {rows_fit}"] if rows_fit >= 1 else []) + (
        [f"{{max_context}} to {tokens_fit}"] if tokens_fit >= 2 else [])
    advice = " or ".join(fixes) if fixes else "{max_batch} and {max_context}, or use a smaller {dtype}"
    raise SettingError(f"{{max_batch}} {batch} x {{max_context}} {context} needs {need / GB:.2f} GB of KV "
                       f"cache besides {weights / GB:.2f} GB of weights, but {available / GB:.2f} GB is free "
                       f"({HEADROOM:.0%} usable): lower " + advice,
                       max_batch="max_batch", max_context="max_context", dtype="dtype")
