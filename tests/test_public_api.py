"""gptlab's public names: each one the package or a documented module path offers keeps working.

The expected names are written out here, not read from the code: a name that disappears makes this
test fail. From now on a name is retired as the README says: a release's deprecation warning first.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import gptlab

# gptlab.__all__: what `from gptlab import ...` promises.
PACKAGE = ["EncoderDecoder", "GPT", "LM", "ModelConfig", "Seq2SeqConfig", "check", "load", "parameter_count"]

# Documented module paths and their main names, each importable without a warning.
MODULES = {
    "gptlab.interop.huggingface": [
        "ADAPTER_DIR", "Conversion", "export_adapter_run", "export_checkpoint", "export_family", "export_hf",
        "from_transformers", "import_hf", "to_transformers",
    ],
    "gptlab.interop.gpt2": [
        "GPT2_VOCAB", "PREFIX", "check_exportable", "from_gpt2_state", "gpt2_config", "gpt2_names",
        "gpt2_problems", "model_config_from_gpt2", "to_gpt2_state",
    ],
    "gptlab.interop.llama": [
        "FAMILIES", "family_of", "from_llama_state", "llama_config", "llama_names", "llama_problems",
        "model_config_from_llama", "split_sizes", "to_llama_state",
    ],
    "gptlab.interop.hf_tokenizer": [
        "bpe_json_from_ranks", "byte_level_bpe", "byte_to_unicode", "hf_tokenizer_json", "read_hf_tokenizer",
        "read_llama_tokenizer",
    ],
    "gptlab.interop.hf_folder": [
        "chat_template", "chat_template_from_config", "eos_ids", "generation_config", "generation_defaults",
        "read_tensors", "token_ids", "weight_files",
    ],
    "gptlab.interop.shapes": ["HEAD", "expected_shapes"],
    "gptlab.interop.gguf": ["export_gguf", "load_gguf", "read_gguf"],
    "gptlab.inference.layouts": ["LAYOUTS", "decoding_layout", "faster_layout"],
    "gptlab.interop.families": ["Conversion", "export_family"],
    "gptlab.interop.peft": ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_peft_adapter", "peft_adapter"],
    "gptlab.lora": ["LoraConfig", "LoraLinear", "add_lora", "lora_layers", "merge_lora"],
    "gptlab.common": ["autocast", "resolve_device", "resolve_precision", "seed_everything"],
    "gptlab.inference.loading": ["is_hf_folder", "load", "load_seq2seq", "read_for_inference", "ready_model"],
    "gptlab.inference.lm": ["LM"],
    "gptlab.inference.conversation": ["Conversation"],
    "gptlab.inference.quantize": ["Int8Linear", "inference_weights", "quantize", "quantize_int8"],
    "gptlab.settings": ["Config", "SettingError", "option"],
    "gptlab.config": ["Config", "SettingError", "ModelConfig", "SamplingConfig", "SAMPLE_DEFAULTS"],
}

# Names that moved in this release: the old path still works, with a DeprecationWarning naming the new home.
MOVED = {
    ("gptlab.checkpoint", "load_run"): "gptlab.inference.loading",
    ("gptlab.checkpoint", "load_for_inference"): "gptlab.inference.loading",
    ("gptlab.checkpoint", "inference_model"): "gptlab.inference.loading",
    ("gptlab.checkpoint", "load_seq2seq"): "gptlab.inference.loading",
    ("gptlab.checkpoint", "generation_defaults"): "gptlab.inference.loading",
    ("gptlab.quantize", "inference_weights"): "gptlab.inference.quantize",
    ("gptlab.layouts", "decoding_layout"): "gptlab.inference.layouts",
}

def test_the_package_exports_its_public_names() -> None:
    assert sorted(gptlab.__all__) == PACKAGE
    for name in PACKAGE:
        assert getattr(gptlab, name) is not None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_documented_module_paths_offer_their_names_without_a_warning(module: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        imported = importlib.import_module(module)
        missing = [name for name in MODULES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}: keep them, or deprecate them and list them here as moved"


@pytest.mark.parametrize(("module", "name"), sorted(MOVED))
def test_moved_names_still_work_with_a_warning_naming_their_new_home(module: str, name: str) -> None:
    if module in ("gptlab.quantize", "gptlab.layouts"):  # a moved module warns when it is imported
        sys.modules.pop(module, None)
    with pytest.warns(DeprecationWarning, match=MOVED[module, name].replace(".", r"\.")):
        found = getattr(importlib.import_module(module), name)
    assert callable(found)


def test_no_caller_in_the_library_uses_a_moved_name() -> None:
    """Every inference caller loads through gptlab.load: the moved names are only defined and forwarded."""
    src = Path(gptlab.__file__).parent
    homes = {src / "checkpoint.py", src / "inference" / "deprecated.py", src / "__init__.py"}
    moved = re.compile(r"\b(load_run|load_for_inference|inference_model)\b|checkpoint import[^\n]*"
                       r"\b(generation_defaults|load_seq2seq)\b|gptlab\.(quantize|layouts)\b")
    users = [f"{path.relative_to(src)}:{n}" for path in sorted(src.rglob("*.py")) if path not in homes
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if moved.search(line)]
    assert users == []
