"""Reading a Hugging Face model folder as save_pretrained writes it: weights and generation settings.

Weights come as one `model.safetensors`, as shards listed by `model.safetensors.index.json` (how
models from about 1B parameters up ship), or as the older pickled `pytorch_model.bin` (sharded too,
with `pytorch_model.bin.index.json`). `read_tensors` yields them one tensor at a time, shard after
shard, so a converter that uses each tensor as it comes (`shapes.gather_tensors`) never holds
the whole checkpoint twice. Pickles are read with `weights_only=True`: a hostile file runs nothing.

`generation_config.json` holds the model's own sampling settings and end-of-sequence ids; gptlab
keeps those it has fields for (`generation_defaults`, `eos_ids`). The chat template (Jinja source and
the special tokens it names) comes from `chat_template.jinja` or `tokenizer_config.json`
(`chat_template`); `gptlab.adapt.chat` renders it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gptlab.config import SamplingConfig

# The weight files save_pretrained writes, in the order they are looked for: each one alone, or its index.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that are SamplingConfig fields of the same meaning.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


def weight_files(hf_dir: Path) -> list[Path]:
    """The folder's weight files: its single file, or every shard its index names, in index order."""
    for name in WEIGHT_FILES:
        path = hf_dir / name
        if path.is_file():
            return shard_files(path) if name.endswith(".index.json") else [path]
    raise FileNotFoundError(f"{hf_dir} holds no weights ({', '.join(WEIGHT_FILES)}): give a folder written "
                            "by save_pretrained")


def shard_files(index: Path) -> list[Path]:
    """The shard files a `*.index.json` maps tensor names to, each once, checked to lie beside it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))  # first appearance order, no repeats
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a shard index with a weight_map ({err})") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{index} names the shard {name!r}, which is not a file beside it")
        if not (index.parent / name).is_file():
            raise FileNotFoundError(f"{index} names the shard {name}, which is missing: download every shard")
    return [index.parent / name for name in names]


def tensor_count(hf_dir: Path) -> int | None:
    """How many tensors `read_tensors` yields, from the safetensors headers alone; None for a pickled
    folder, whose count is known only once it is read."""
    files = weight_files(hf_dir)
    if any(file.suffix != ".safetensors" for file in files):
        return None
    count = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                count += len(reader.keys())
        except Exception:  # safetensors' own error types: read_tensors names the damaged file
            return None
    return count


def read_tensors(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the folder's weights, one at a time, shard after shard."""
    for file in weight_files(hf_dir):
        yield from file_tensors(file)


def file_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors or pickled weight file, read one at a time where the format allows."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
            return
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and pickle raise their own error types for a damaged file
        raise ValueError(f"cannot read the weights in {file} ({err})") from err
    if not (isinstance(state, dict) and all(isinstance(t, torch.Tensor) for t in state.values())):
        raise ValueError(f"{file} does not hold a state dict of tensors")
    while state:  # hand each tensor over and drop the file's own reference to it
        yield state.popitem()


def generation_config(hf_dir: Path) -> dict[str, Any]:
    """The folder's generation_config.json as a dict (empty when there is none)."""
    path = hf_dir / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return values


def generation_defaults(hf_dir: Path) -> dict[str, Any]:
    """The sampling settings generation_config.json asks for, as SamplingConfig fields (validated).

    Only keys the file gives are kept: `do_sample: false` means greedy (temperature 0), and `top_k: 0`
    is transformers' "no top-k", which is gptlab's default anyway.
    """
    values = generation_config(hf_dir)
    defaults = {key: values[key] for key in SAMPLING_KEYS if values.get(key) is not None}
    if defaults.get("top_k") == 0:
        del defaults["top_k"]
    if values.get("do_sample") is False:
        defaults["temperature"] = 0.0
    try:
        checked = SamplingConfig.from_dict(defaults).to_dict()
    except ValueError as err:
        raise ValueError(f"{hf_dir / GENERATION_CONFIG}: {err}") from None
    return {key: checked[key] for key in defaults}


def token_ids(value: Any) -> list[int]:
    """A config's token id field as a list: it may be one id, a list of ids, or null."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def eos_ids(hf_dir: Path, hf_config: dict[str, Any]) -> list[int]:
    """Every end-of-sequence id config.json and generation_config.json name, config.json's first."""
    found = [*token_ids(hf_config.get("eos_token_id")),
             *token_ids(generation_config(hf_dir).get("eos_token_id"))]
    return list(dict.fromkeys(found))


# The special tokens a chat template may name as variables, as tokenizer_config.json lists them.
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_from_config(tokenizer_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """A `tokenizer_config.json`'s default chat template as {"kind": "jinja", "source", "tokens"}, or None."""
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # several named templates: transformers uses the one named "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    tokens = {name: _token_text(tokenizer_config.get(name)) for name in TOKEN_NAMES}
    return {"kind": "jinja", "source": source,
            "tokens": {name: text for name, text in tokens.items() if text is not None}}


def chat_template(hf_dir: Path) -> dict[str, Any] | None:
    """The folder's chat template: `chat_template.jinja` (newer transformers save it apart) or the one in
    `tokenizer_config.json`, as `chat_template_from_config` gives it; None when it has neither."""
    config_file = hf_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except ValueError as err:
        raise ValueError(f"{config_file} is not JSON ({err})") from None
    if (hf_dir / "chat_template.jinja").is_file():
        config = {**config, "chat_template": (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")}
    return chat_template_from_config(config)
