"""An adapter run's LoRA layers as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors).

- PEFT export maps gptlab's modules to the exported ones with the same name maps `export-hf` uses. The
fused c_attn of a Llama becomes q/k/v adapters that each carry a copy of A and their rows of B: PEFT
then computes B_q A x, B_k A x, B_v A x, exactly the rows of B A x. GPT-2 keeps the fused c_attn; its
Conv1D layers store W as (in, out), but PEFT's A and B there are plain (r, in) and (out, r) layers.
- Rows of new tokens (chat markers a `finetune --lora` run added) become PEFT's `trainable_token_indices`
(peft 0.15 and later; tested with 0.21): they load onto the base `export-hf` writes of the run, whose
vocabulary has those ids, but not onto its base exported on its own, which lacks them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gptlab.config import ModelConfig
from gptlab.files import atomic_write, atomic_write_text
from gptlab.interop.families import Conversion, export_family
from gptlab.interop.gpt2 import gpt2_names
from gptlab.interop.llama import llama_names, split_sizes
from gptlab.lora import LoraConfig, lora_layers, token_row_layers
from gptlab.model import GPT

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped transformers model


# ---------------------------------------------------------------------------------------------
# PEFT export: the adapters of the model `export-hf` writes


def exported_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """gptlab weight name -> the exported weights it becomes (`export-hf`'s name map for this family)."""
    if export_family(config) == "gpt2":
        return {ours: (theirs,) for ours, theirs in gpt2_names(config).items()}
    return llama_names(config)


def trainable_tokens(model: GPT) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """New tokens' rows (`gptlab.lora.add_trainable_tokens`) as PEFT's trainable tokens: the
    `trainable_token_indices` (exported module -> ids) and the rows, which PEFT writes over the exported
    base's rows of those ids (a tied head follows the embedding there too); both empty without them."""
    names = exported_names(model.config)
    indices, tensors = {}, {}
    for name, layer in token_row_layers(model).items():
        if layer.token_rows is None:  # a tied head: its rows are the embedding's
            continue
        (theirs,) = (weight.removesuffix(".weight") for weight in names[name + ".weight"])
        indices[theirs] = layer.ids.tolist()
        tensors[f"{PEFT_PREFIX}{theirs}.token_adapter.trainable_tokens_delta"] = \
            layer.token_rows.detach().clone().contiguous()  # (N, D): the rows themselves, not a difference
    return indices, tensors


def peft_modules(model: GPT) -> dict[str, list[tuple[str, slice]]]:
    """gptlab LoRA module -> the exported modules it becomes, each with its rows of gptlab's output.

    One module per adapter, except a Llama-family c_attn: q_proj, k_proj and v_proj, by rows.
    """
    config = model.config
    names = exported_names(config)
    out: dict[str, list[tuple[str, slice]]] = {}
    for name, layer in lora_layers(model).items():
        # Every linear layer of an exportable model is in the map (a tied head is refused by add_lora).
        theirs = names.get(name + ".weight")
        assert theirs is not None, f"{name} is missing from the {export_family(config)} name map"
        sizes = [layer.out_features] if len(theirs) == 1 else split_sizes(config, theirs)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        out[name] = [(t.removesuffix(".weight"), slice(s, s + n))
                     for t, s, n in zip(theirs, starts, sizes, strict=True)]
    return out


def peft_adapter(model: GPT, config: LoraConfig,
                 base_model_name_or_path: str | None) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """The adapter_config.json values and the adapter tensors, named as PEFT saves them."""
    modules = peft_modules(model)
    layers = lora_layers(model)
    wrong = sorted(name for name, layer in layers.items()
                   if (layer.r, layer.scaling) != (config.r, config.scaling))
    if wrong:
        raise ValueError(f"the LoRA layers {', '.join(wrong)} were built with another r or alpha than "
                         f"r={config.r}, alpha={config.alpha}: export with the config they were added with")
    indices, tensors = trainable_tokens(model)
    for name, parts in modules.items():
        a, b = layers[name].lora_A.weight.detach(), layers[name].lora_B.weight.detach()  # (r, in), (out, r)
        for theirs, rows in parts:  # a copy of A for each, and its own rows of B
            tensors[f"{PEFT_PREFIX}{theirs}.lora_A.weight"] = a.clone().contiguous()
            tensors[f"{PEFT_PREFIX}{theirs}.lora_B.weight"] = b[rows].clone().contiguous()
    values: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        # Full module names: PEFT takes a name equal to a target (or ending in "." + target), so each
        # names exactly one module, where a bare "c_proj" would catch both projections.
        "target_modules": sorted(theirs for parts in modules.values() for theirs, _ in parts),
        "fan_in_fan_out": export_family(model.config) == "gpt2",  # GPT-2's Conv1D weights are (in, out)
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    if indices:  # only then: a peft older than the field refuses a config that names it
        values["trainable_token_indices"] = indices
    return values, tensors


def export_peft_adapter(model: GPT, config: LoraConfig, out_dir: str | Path,
                        base_model_name_or_path: str | None = None) -> Conversion:
    """Write adapter_config.json and adapter_model.safetensors that `peft.PeftModel.from_pretrained` loads
    onto the model `export-hf` writes of this model's base; refuses to replace existing adapter files."""
    out_dir = Path(out_dir)
    values, tensors = peft_adapter(model, config, base_model_name_or_path)
    existing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (out_dir / name).exists()]
    if existing:
        raise ValueError(f"{out_dir} already holds {', '.join(existing)}: choose another folder or "
                         "remove them")
    atomic_write(out_dir / ADAPTER_WEIGHTS,
                 lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    atomic_write_text(out_dir / ADAPTER_CONFIG, json.dumps(values, indent=2) + "\n")
    return Conversion(out_dir, [ADAPTER_WEIGHTS, ADAPTER_CONFIG])
