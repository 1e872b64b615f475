"""gptlab's public names: each one the package or a documented module path offers keeps working, and a
name that moved keeps its old path for one release with a DeprecationWarning.

The expected names are written out here, not read from the code: a name that disappears makes this
test fail until it is given a deprecated path (and moved to the deprecated lists below).
"""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import gptlab

# gptlab.__all__: what `from gptlab import ...` promises.
PACKAGE = ["EncoderDecoder", "GPT", "ModelConfig", "Seq2SeqConfig", "parameter_count"]

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
    "gptlab.layouts": ["LAYOUTS", "decoding_layout", "faster_layout"],
    "gptlab.common": ["autocast", "resolve_device", "resolve_precision", "seed_everything"],
}

# Deprecated modules: every name they must still offer, and the module that now holds it.
SHIMS = {
    "gptlab.convert": {
        "gptlab.interop.huggingface": [
            "ADAPTER_DIR", "Conversion", "export_adapter_run", "export_checkpoint", "export_family",
            "export_hf", "from_transformers", "import_hf", "to_transformers",
        ],
        "gptlab.interop.gpt2": [
            "BLOCK_TENSORS", "CONV1D", "FROM_GPT2_ACTIVATION", "GPT2_ACTIVATIONS", "GPT2_DEFAULTS",
            "GPT2_NEEDS", "GPT2_VOCAB", "HEAD", "MASK_BUFFER", "PREFIX", "check_exportable",
            "from_gpt2_state", "gpt2_config", "gpt2_names", "gpt2_problems", "model_config_from_gpt2",
            "to_gpt2_state",
        ],
        "gptlab.interop.hf_tokenizer": [
            "bpe_json_from_ranks", "byte_level_bpe", "byte_to_unicode", "hf_tokenizer_json",
            "read_hf_tokenizer", "read_llama_tokenizer",
        ],
    },
    "gptlab.convert_llama": {
        "gptlab.interop.llama": [
            "DEFAULTS", "EMBED", "FAMILIES", "FINAL_NORM", "HEAD", "LLAMA_NEEDS", "ROTARY_BUFFER",
            "family_of", "from_llama_state", "layer_names", "llama_config", "llama_names", "llama_problems",
            "model_config_from_llama", "rope_theta", "rope_type", "split_sizes", "to_llama_state",
        ],
    },
    "gptlab.hf_folder": {
        "gptlab.interop.hf_folder": [
            "GENERATION_CONFIG", "SAMPLING_KEYS", "TOKEN_NAMES", "WEIGHT_FILES", "chat_template",
            "chat_template_from_config", "eos_ids", "file_tensors", "generation_config",
            "generation_defaults", "read_tensors", "shard_files", "token_ids", "weight_files",
        ],
    },
}
# Single names that moved out of a module that stays (found through the module's __getattr__).
MOVED_NAMES = {
    ("gptlab.common", "faster_layout"): "gptlab.layouts",
    ("gptlab.common", "decoding_layout"): "gptlab.layouts",
    ("gptlab.common", "LAYOUTS"): "gptlab.layouts",
}
SRC = Path(__file__).resolve().parents[1] / "src" / "gptlab"


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


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_a_deprecated_module_warns_once_imported_and_gives_the_new_objects(
    shim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, shim, raising=False)  # import it afresh: its warning runs at import
    with pytest.deprecated_call() as caught:
        old = __import__(shim, fromlist=["*"])  # a plain import statement, as a user's code has it
    assert any(w.filename == __file__ for w in caught), "the warning must point at the importing line"
    expected = {name: target for target, names in SHIMS[shim].items() for name in names}
    assert sorted(old.__all__) == sorted(expected)
    for name, target in expected.items():
        assert getattr(old, name) is getattr(importlib.import_module(target), name), f"{shim}.{name}"


@pytest.mark.parametrize(("old", "name"), sorted(MOVED_NAMES))
def test_a_moved_name_warns_and_is_the_new_object(old: str, name: str) -> None:
    module = importlib.import_module(old)
    with pytest.deprecated_call(match=f"moved to {MOVED_NAMES[old, name]}"):
        found = getattr(module, name)
    assert found is getattr(importlib.import_module(MOVED_NAMES[old, name]), name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018  the fallback must not swallow unknown names


def deprecated_imports(path: Path) -> list[str]:
    """The deprecated modules and names a source file imports (at the top or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name in SHIMS]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [name for name in [node.module, *names] if name in SHIMS]
            found += [f"{node.module}.{a.name}" for a in node.names if (node.module, a.name) in MOVED_NAMES]
    return found


def test_nothing_inside_gptlab_imports_a_deprecated_path() -> None:
    shims = {SRC / f"{name.removeprefix('gptlab.')}.py" for name in SHIMS}
    offenders = {str(path.relative_to(SRC)): names for path in sorted(SRC.rglob("*.py")) if path not in shims
                 for names in [deprecated_imports(path)] if names}
    assert not offenders
