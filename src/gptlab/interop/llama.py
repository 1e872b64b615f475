"""Hugging Face interop for the Llama family: `LlamaForCausalLM` and `Qwen2ForCausalLM` configs and tensors.

gptlab's GPT with rotary positions, pre-norm RMSNorm, the SwiGLU feed-forward network and no biases is
a Llama (SmolLM2, TinyLlama); with biases on q, k and v only (`qkv_bias`) it is a Qwen2. Both may
group their key/value heads (`n_kv_head`). The conversion is an explicit name map plus three facts:
- q_proj, k_proj and v_proj are stacked, in that order, into the fused c_attn (§4.2); their rows
  keep their order, so query head h is rows h*hs .. (h+1)*hs - 1 in both.
- gate_proj is c_gate, up_proj is c_fc (the features multiplied by the gate), down_proj is c_proj.
- Both rotate the feature pairs (i, i + hs/2) of each head ("rotate half") with the frequencies
  base^(-2i/hs), as gptlab's Rotary does, so no weight is permuted.
Whatever the converter cannot represent (rope scaling other than 'default', sliding windows, experts,
other activations, biases elsewhere) is refused with one error that lists every such field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from gptlab.config import ModelConfig
from gptlab.interop.shapes import check_tensors, gather_tensors

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# What a Llama needs of a gptlab ModelConfig (n_kv_head, rope_base, tying, widths and zero_init, which
# changes only the start, are free).
LLAMA_NEEDS: dict[str, Any] = {
    "positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "arrangement": "pre", "bias": False,
    "causal": True, "qk_norm": False, "logit_softcap": 0.0, "unet": False, "ngram_embeddings": (),
}
# Defaults of transformers' LlamaConfig and Qwen2Config, for config.json files that leave a field out.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "hidden_act": "silu", "use_sliding_window": False},
}
# Non-weight buffers that older checkpoints carry: gptlab derives them from the config.
ROTARY_BUFFER = "rotary_emb.inv_freq"


def layer_names(config: ModelConfig, i: int) -> dict[str, tuple[str, ...]]:
    """gptlab tensor name -> the Hugging Face tensors it is stacked from (dim 0), for block i."""
    ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
    attn = theirs + "self_attn."
    names = {
        ours + "ln_1.weight": (theirs + "input_layernorm.weight",),
        ours + "attn.c_attn.weight": tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
        ours + "attn.c_proj.weight": (attn + "o_proj.weight",),
        ours + "ln_2.weight": (theirs + "post_attention_layernorm.weight",),
        ours + "mlp.c_gate.weight": (theirs + "mlp.gate_proj.weight",),
        ours + "mlp.c_fc.weight": (theirs + "mlp.up_proj.weight",),
        ours + "mlp.c_proj.weight": (theirs + "mlp.down_proj.weight",),
    }
    if config.attn_bias:
        names[ours + "attn.c_attn.bias"] = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
    return names


def llama_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """gptlab tensor name -> Hugging Face names, for every stored tensor (a tied head is not one)."""
    names: dict[str, tuple[str, ...]] = {"transformer.wte.weight": (EMBED,)}
    for i in range(config.n_layer):
        names |= layer_names(config, i)
    names["transformer.ln_f.weight"] = (FINAL_NORM,)
    if not config.tied:
        names["lm_head.weight"] = (HEAD,)
    return names


def split_sizes(config: ModelConfig, hf_names: tuple[str, ...]) -> list[int]:
    """Rows of each source of a stacked tensor: q has H heads, k and v n_kv_head each."""
    if len(hf_names) == 1:
        return [-1]
    hs = config.head_size
    return [config.n_head * hs, config.kv_heads * hs, config.kv_heads * hs]


# ---------------------------------------------------------------------------------------------
# Configs


def family_of(config: ModelConfig) -> str:
    """`qwen2` when only q, k and v have biases, else `llama` (the caller checks exportability)."""
    return "qwen2" if config.attn_bias else "llama"


def llama_problems(config: ModelConfig) -> list[str]:
    """Every field that keeps this config from being a Llama or Qwen2, with what is needed."""
    return [f"{name}={getattr(config, name)!r} (a Llama needs {need!r})"
            for name, need in LLAMA_NEEDS.items() if getattr(config, name) != need]


def llama_config(config: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The config.json of the Llama (or Qwen2) with this shape, in the form save_pretrained writes."""
    family = family_of(config)
    values: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_scaling": None,
        "tie_word_embeddings": config.tied,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if family == "llama":
        values |= {"attention_bias": False, "mlp_bias": False}
    else:
        values |= {"use_sliding_window": False, "sliding_window": None}
    return values


def rope_theta(hf: Mapping[str, Any]) -> tuple[float, list[str]]:
    """RoPE's base, from `rope_theta` (transformers 4) or `rope_parameters` (5), and anything unsupported.

    A `rope_scaling` of type "default" is plain RoPE, written out: it is accepted and changes nothing.
    """
    parameters = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    problems = []
    if scaling and rope_type(scaling) != "default":
        problems.append(f"rope_scaling={scaling!r} (rope type {rope_type(scaling)!r}: gptlab has plain RoPE "
                        "only, so rope_scaling must be null or of type 'default')")
    if parameters.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type={parameters['rope_type']!r} (gptlab needs 'default')")
    theta = hf.get("rope_theta", parameters.get("rope_theta", 10000.0))
    return float(theta), problems


def rope_type(scaling: Any) -> Any:
    """The kind of a rope_scaling dict: `rope_type` (newer configs) or `type` (older ones)."""
    return scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling


def model_config_from_llama(hf: Mapping[str, Any]) -> ModelConfig:
    """The gptlab ModelConfig of a Llama or Qwen2 config.json; one ValueError lists every field that does
    not fit."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type={family!r} is not in the Llama family gptlab reads "
                         f"({', '.join(FAMILIES)})")
    get: Callable[..., Any] = {**DEFAULTS[family], **hf}.get  # JSON values: checked by ModelConfig
    theta, problems = rope_theta(hf)
    needs = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "use_sliding_window": False}
    problems += [f"{k}={get(k)!r} (gptlab needs {v!r})" for k, v in needs.items() if get(k, v) != v]
    experts = [k for k in ("num_experts", "num_local_experts", "moe_intermediate_size") if get(k)]
    problems += [f"{k}={get(k)!r} (mixture-of-experts layers are not supported)" for k in experts]
    n_embd, n_head = get("hidden_size"), get("num_attention_heads")
    if get("head_dim") not in (None, n_embd // n_head):
        problems.append(f"head_dim={get('head_dim')} (gptlab needs hidden_size / num_attention_heads = "
                        f"{n_embd // n_head})")
    if problems:
        raise ValueError(f"this {family} config cannot be loaded into gptlab: {'; '.join(problems)}")
    config = ModelConfig(
        vocab_size=get("vocab_size"), block_size=get("max_position_embeddings"),
        n_layer=get("num_hidden_layers"),
        n_head=n_head, n_kv_head=get("num_key_value_heads") or n_head, n_embd=n_embd,
        ffn_mult=get("intermediate_size") / n_embd, norm="rmsnorm", ffn="swiglu", positions="rope",
        tied=bool(get("tie_word_embeddings")), bias=False, qkv_bias=True if family == "qwen2" else None,
        norm_eps=get("rms_norm_eps"), rope_base=theta,
    )
    if config.ffn_hidden != get("intermediate_size"):
        raise ValueError(f"intermediate_size={get('intermediate_size')} is not a width gptlab can express as "
                         f"ffn_mult * hidden_size={n_embd}")
    return config


# ---------------------------------------------------------------------------------------------
# Tensors


def to_llama_state(model_state: Mapping[str, torch.Tensor], config: ModelConfig,
                   shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from gptlab's (a tied head left out); `shapes` are the gptlab shapes expected."""
    return dict(llama_tensors(model_state, config, shapes))


def llama_tensors(model_state: Mapping[str, torch.Tensor], config: ModelConfig,
                  shapes: Mapping[str, torch.Size]) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_llama_state`'s (name, tensor) pairs one at a time, one per Hugging Face name of
    llama_names(config), all checked before the first: a caller can count them as they come."""
    names = llama_names(config)
    assert set(names) == set(shapes), f"the name map misses {sorted(set(shapes) - set(names))}"
    check_tensors(model_state, shapes)
    for ours, theirs in names.items():
        tensor = model_state[ours]
        parts = tensor.split(split_sizes(config, theirs)) if len(theirs) > 1 else [tensor]
        for name, part in zip(theirs, parts, strict=True):
            yield name, part.contiguous()


def from_llama_state(hf_tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                     shapes: Mapping[str, torch.Size]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """gptlab tensors (float32) from a Llama's or Qwen2's (name, tensor) pairs, and the rotary buffers that
    were skipped; `shapes` are the gptlab shapes expected.

    Every other source tensor must be used and every target filled with the expected shape; a tied
    model's file may repeat the embedding as lm_head.weight, which must then equal it. Each target is
    built as soon as its parts are read (`gather_tensors`), so a sharded checkpoint is read shard by shard.
    """
    names = llama_names(config)

    def build(ours: str, parts: list[torch.Tensor]) -> torch.Tensor:
        theirs = names[ours]
        for name, part, rows in zip(theirs, parts, split_sizes(config, theirs), strict=True):
            if rows != -1 and part.size(0) != rows:
                raise ValueError(f"{name} has shape {tuple(part.shape)}, not what config.json says")
        # (rows of q, k and v stacked, or one tensor) as float32; a float32 source is taken, not copied
        tensor = torch.cat([part.float() for part in parts]) if len(parts) > 1 else parts[0].float()
        if tensor.shape != shapes[ours]:
            raise ValueError(f"{theirs[0]} has shape {tuple(parts[0].shape)}, not what config.json says")
        return tensor

    out, others, missing = gather_tensors(hf_tensors, names, build)
    skipped = sorted(k for k in others if k.endswith(ROTARY_BUFFER))
    tied_copy = config.tied and HEAD in others
    unused = sorted(set(others) - set(skipped) - ({HEAD} if tied_copy else set()))
    if missing or unused:
        raise ValueError(f"the weights do not fit config.json: missing {missing}, unused {unused}")
    if tied_copy and not torch.equal(others[HEAD].float(), out["transformer.wte.weight"]):
        raise ValueError("lm_head.weight differs from model.embed_tokens.weight but config.json says "
                         "tie_word_embeddings=true")
    return out, skipped
