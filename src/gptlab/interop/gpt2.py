"""GPT-2 as Hugging Face stores it: its config.json and its tensor names, to and from gptlab's.

gptlab's GPT with learned positions, pre-norm LayerNorm, the tanh GELU, biases and a tied head is
GPT-2 (§5-§7 of the handout), and its modules carry GPT-2's checkpoint names, so the conversion is
an explicit name map that is the identity, plus two facts about GPT-2's files:
- GPT-2's projections are `Conv1D` layers that store their weight as (in, out); `nn.Linear` stores
  (out, in). The four projection weights of every block are transposed on the way in and out.
- Older GPT-2 checkpoints carry the causal mask as non-parameter buffers (`h.N.attn.bias`,
  `h.N.attn.masked_bias`) and may lack the `transformer.` prefix. Those buffers are skipped by name
  (gptlab builds its mask from the config); every other tensor must be used.
Every conversion checks completeness: each source tensor used, each target filled, each shape
asserted. Whole folders are read and written by `gptlab.interop.huggingface`.

Deliberate choices:
- The feed-forward width travels as GPT-2's `n_inner`, so any `ffn_mult` exports. The erf GELU
  (`gelu_exact`) exports as GPT-2's `activation_function: "gelu"`, and a model without biases (or
  without some) exports with zero biases: both give the same logits in transformers.
- gptlab has no attention-weight dropout: exports set `attn_pdrop=0`; imports take `resid_pdrop`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from gptlab.config import ModelConfig
from gptlab.interop.shapes import HEAD, check_tensors, expected_shapes, gather_tensors

PREFIX = "transformer."
BLOCK_TENSORS = (
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
    "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
    "mlp.c_proj.weight", "mlp.c_proj.bias",
)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MASK_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")
GPT2_VOCAB = 50257
# GPT2Config's defaults, for config.json files that leave a field out.
GPT2_DEFAULTS: dict[str, Any] = {
    "model_type": "gpt2", "vocab_size": GPT2_VOCAB, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
    "n_head": 12, "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False, "tie_word_embeddings": True,
}
# What GPT-2 needs of a gptlab ModelConfig (ffn_mult is free: it becomes n_inner; biases are free: a
# model without them exports zeros, which add nothing; so is zero_init, which changes only the start).
GPT2_NEEDS: dict[str, Any] = {
    "positions": "learned", "norm": "layernorm", "arrangement": "pre", "tied": True, "causal": True,
    "qk_norm": False, "logit_softcap": 0.0, "unet": False, "ngram_embeddings": (),
}
# gptlab's GELUs as GPT-2's config names them: the tanh form is `gelu_new`, the erf form `gelu`.
GPT2_ACTIVATIONS = {"gelu": "gelu_new", "gelu_exact": "gelu"}
# What an imported `activation_function` is in gptlab: both tanh forms differ from `gelu` only in rounding.
FROM_GPT2_ACTIVATION = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}


# ---------------------------------------------------------------------------------------------
# Configs


def gpt2_problems(config: ModelConfig) -> list[str]:
    """Every field GPT-2 cannot represent, with what GPT-2 needs."""
    problems = [
        f"{name}={getattr(config, name)!r} (GPT-2 needs {need!r})"
        for name, need in GPT2_NEEDS.items()
        if getattr(config, name) != need
    ]
    if config.ffn not in GPT2_ACTIVATIONS:
        problems.append(f"ffn={config.ffn!r} (GPT-2 needs one of {', '.join(map(repr, GPT2_ACTIVATIONS))})")
    if config.kv_heads != config.n_head:
        problems.append(f"n_kv_head={config.n_kv_head} (GPT-2 needs None: a key/value head per head)")
    return problems


def check_exportable(config: ModelConfig) -> None:
    """Raise one ValueError listing every field GPT-2 cannot represent, with what GPT-2 needs."""
    problems = gpt2_problems(config)
    if problems:
        raise ValueError(f"this model cannot be exported as GPT-2: {'; '.join(problems)}")


def gpt2_config(config: ModelConfig, eot_id: int | None = None) -> dict[str, Any]:
    """The config.json of GPT-2 with this shape (the caller checks exportability first)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None if config.ffn_hidden == 4 * config.n_embd else config.ffn_hidden,
        "activation_function": GPT2_ACTIVATIONS[config.ffn],
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": config.norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
    }


def model_config_from_gpt2(hf: Mapping[str, Any]) -> ModelConfig:
    """The gptlab ModelConfig of a GPT-2 config.json dict; one ValueError lists what does not fit."""
    get: Callable[..., Any] = {**GPT2_DEFAULTS, **hf}.get  # JSON values: checked by ModelConfig
    needs = {"model_type": "gpt2", "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "add_cross_attention": False, "tie_word_embeddings": True}
    problems = [f"{k}={get(k)!r} (gptlab needs {v!r})" for k, v in needs.items() if get(k) != v]
    if get("activation_function") not in FROM_GPT2_ACTIVATION:
        problems.append(f"activation_function={get('activation_function')!r} "
                        f"(gptlab needs one of {', '.join(FROM_GPT2_ACTIVATION)})")
    if problems:
        raise ValueError(f"this GPT-2 config cannot be loaded into gptlab: {'; '.join(problems)}")
    n_embd = get("n_embd")
    n_inner = get("n_inner") or 4 * n_embd
    config = ModelConfig(
        vocab_size=get("vocab_size"), block_size=get("n_positions"), n_layer=get("n_layer"),
        n_head=get("n_head"), n_embd=n_embd, ffn_mult=n_inner / n_embd, dropout=get("resid_pdrop"),
        norm_eps=get("layer_norm_epsilon"), ffn=FROM_GPT2_ACTIVATION[get("activation_function")],
    )
    if config.ffn_hidden != n_inner:
        raise ValueError(f"n_inner={n_inner} is not a width gptlab can express as ffn_mult * n_embd={n_embd}")
    return config


# ---------------------------------------------------------------------------------------------
# Tensors


def gpt2_names(config: ModelConfig) -> dict[str, str]:
    """gptlab tensor name -> GPT-2 checkpoint name, for every tensor GPT-2 stores (the tied head is not one;
    a gptlab model without biases lacks those names)."""
    names = [f"{PREFIX}wte.weight", f"{PREFIX}wpe.weight"]
    names += [f"{PREFIX}h.{i}.{part}" for i in range(config.n_layer) for part in BLOCK_TENSORS]
    names += [f"{PREFIX}ln_f.weight", f"{PREFIX}ln_f.bias"]
    # gptlab named its modules after GPT-2's checkpoint, so the map is the identity by construction.
    return {name: name for name in names}


def _is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D)


def to_gpt2_state(model_state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 tensors from gptlab's (tied head left out), Conv1D weights as (in, out).

    GPT-2 has every bias; one the model leaves out (bias=False, qkv_bias=False) is written as zeros,
    which compute exactly what no bias does.
    """
    return dict(gpt2_tensors(model_state, config))


def gpt2_tensors(model_state: Mapping[str, torch.Tensor],
                 config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_gpt2_state`'s (name, tensor) pairs one at a time, len(gpt2_names(config)) of them, all checked
    before the first: a caller can count them as they come."""
    shapes = expected_shapes(config)
    names = gpt2_names(config)
    absent = set(names) - set(shapes)
    assert set(shapes) <= set(names), f"the name map misses {sorted(set(shapes) - set(names))}"
    assert all(name.endswith(".bias") for name in absent), f"only biases may be absent, not {sorted(absent)}"
    check_tensors(model_state, shapes)
    for ours, theirs in names.items():
        if ours in absent:  # as wide as its layer's output: rows of the (out, in) weight, or the norm's
            weight = model_state[ours.removesuffix("bias") + "weight"]
            yield theirs, torch.zeros(weight.shape[0], dtype=weight.dtype)
            continue
        tensor = model_state[ours]
        yield theirs, (tensor.t() if _is_conv1d(ours) else tensor).contiguous()


def from_gpt2_state(
    hf_tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """gptlab tensors (float32) from GPT-2's (name, tensor) pairs, and the mask buffers that were skipped.

    Every other source tensor must be used and every target filled with the expected shape; each
    tensor is converted as soon as it is read (`gather_tensors`), so shards are read one at a time.
    """
    shapes = expected_shapes(config)

    def build(ours: str, parts: list[torch.Tensor]) -> torch.Tensor:
        tensor = parts[0].float()
        tensor = (tensor.t() if _is_conv1d(ours) else tensor).contiguous()
        if tensor.shape != shapes[ours]:
            raise ValueError(f"{ours} has shape {tuple(parts[0].shape)}, not what config.json says")
        return tensor

    # GPT2Model checkpoints (the original release) name tensors without the `transformer.` prefix.
    named = ((k if k.startswith(PREFIX) or k == HEAD else PREFIX + k, v) for k, v in hf_tensors)
    sources = {ours: (theirs,) for ours, theirs in gpt2_names(config).items()}
    out, others, missing = gather_tensors(named, sources, build)
    skipped = sorted(k for k in others if MASK_BUFFER.match(k))
    unused = sorted(set(others) - set(skipped) - {HEAD})
    if missing or unused:
        raise ValueError(f"the GPT-2 weights do not fit config.json: missing {missing}, unused {unused}")
    head = others.get(HEAD)
    if head is not None and not torch.equal(head.float(), out[f"{PREFIX}wte.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: gptlab's GPT-2 ties them")
    return out, skipped
