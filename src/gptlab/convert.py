"""Deprecated: the Hugging Face conversion moved to `gptlab.interop` (huggingface, gpt2, hf_tokenizer).

This module re-exports its former public names for one release and warns on import; nothing inside
gptlab imports it. Import from `gptlab.interop.huggingface` (export_hf, import_hf, to_transformers,
from_transformers), `gptlab.interop.gpt2` (GPT-2's config and name map) or `gptlab.interop.hf_tokenizer`.
"""

from __future__ import annotations

import warnings

from gptlab.interop.gpt2 import (
    BLOCK_TENSORS,
    CONV1D,
    FROM_GPT2_ACTIVATION,
    GPT2_ACTIVATIONS,
    GPT2_DEFAULTS,
    GPT2_NEEDS,
    GPT2_VOCAB,
    HEAD,
    MASK_BUFFER,
    PREFIX,
    check_exportable,
    from_gpt2_state,
    gpt2_config,
    gpt2_names,
    gpt2_problems,
    model_config_from_gpt2,
    to_gpt2_state,
)
from gptlab.interop.hf_tokenizer import (
    bpe_json_from_ranks,
    byte_level_bpe,
    byte_to_unicode,
    hf_tokenizer_json,
    read_hf_tokenizer,
    read_llama_tokenizer,
)
from gptlab.interop.huggingface import (
    ADAPTER_DIR,
    Conversion,
    export_adapter_run,
    export_checkpoint,
    export_family,
    export_hf,
    from_transformers,
    import_hf,
    to_transformers,
)

__all__ = [
    "ADAPTER_DIR", "BLOCK_TENSORS", "CONV1D", "FROM_GPT2_ACTIVATION", "GPT2_ACTIVATIONS", "GPT2_DEFAULTS",
    "GPT2_NEEDS", "GPT2_VOCAB", "HEAD", "MASK_BUFFER", "PREFIX", "Conversion", "bpe_json_from_ranks",
    "byte_level_bpe", "byte_to_unicode", "check_exportable", "export_adapter_run", "export_checkpoint",
    "export_family", "export_hf", "from_gpt2_state", "from_transformers", "gpt2_config", "gpt2_names",
    "gpt2_problems", "hf_tokenizer_json", "import_hf", "model_config_from_gpt2", "read_hf_tokenizer",
    "read_llama_tokenizer", "to_gpt2_state", "to_transformers",
]

warnings.warn("gptlab.convert is deprecated and will be removed in the next release: import from "
              "gptlab.interop.huggingface, gptlab.interop.gpt2 or gptlab.interop.hf_tokenizer",
              DeprecationWarning, stacklevel=2)
