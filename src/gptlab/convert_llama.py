"""Deprecated: the Llama family's configs and name map moved to `gptlab.interop.llama`.

This module re-exports its former public names for one release and warns on import; nothing inside
gptlab imports it.
"""

from __future__ import annotations

import warnings

from gptlab.interop.llama import (
    DEFAULTS,
    EMBED,
    FAMILIES,
    FINAL_NORM,
    HEAD,
    LLAMA_NEEDS,
    ROTARY_BUFFER,
    family_of,
    from_llama_state,
    layer_names,
    llama_config,
    llama_names,
    llama_problems,
    model_config_from_llama,
    rope_theta,
    rope_type,
    split_sizes,
    to_llama_state,
)

__all__ = [
    "DEFAULTS", "EMBED", "FAMILIES", "FINAL_NORM", "HEAD", "LLAMA_NEEDS", "ROTARY_BUFFER", "family_of",
    "from_llama_state", "layer_names", "llama_config", "llama_names", "llama_problems",
    "model_config_from_llama", "rope_theta", "rope_type", "split_sizes", "to_llama_state",
]

warnings.warn("gptlab.convert_llama is deprecated and will be removed in the next release: import from "
              "gptlab.interop.llama", DeprecationWarning, stacklevel=2)
