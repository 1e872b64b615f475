"""Deprecated: reading Hugging Face folders moved to `gptlab.interop.hf_folder`.

This module re-exports its former public names for one release and warns on import; nothing inside
gptlab imports it.
"""

from __future__ import annotations

import warnings

from gptlab.interop.hf_folder import (
    GENERATION_CONFIG,
    SAMPLING_KEYS,
    TOKEN_NAMES,
    WEIGHT_FILES,
    chat_template,
    chat_template_from_config,
    eos_ids,
    file_tensors,
    generation_config,
    generation_defaults,
    read_tensors,
    shard_files,
    token_ids,
    weight_files,
)

__all__ = [
    "GENERATION_CONFIG", "SAMPLING_KEYS", "TOKEN_NAMES", "WEIGHT_FILES", "chat_template",
    "chat_template_from_config", "eos_ids", "file_tensors", "generation_config", "generation_defaults",
    "read_tensors", "shard_files", "token_ids", "weight_files",
]

warnings.warn("gptlab.hf_folder is deprecated and will be removed in the next release: import from "
              "gptlab.interop.hf_folder", DeprecationWarning, stacklevel=2)
