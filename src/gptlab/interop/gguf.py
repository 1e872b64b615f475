"""GGUF export for llama.cpp (and Ollama, LM Studio), and GGUF files read back into gptlab.

A run is written as one of the graphs llama.cpp already knows, with its tokenizer and chat template in
the metadata, so llama.cpp computes what gptlab computes:
- `gpt2`: learned positions, pre-norm LayerNorm, the tanh GELU, a tied head (llama.cpp's gpt2 graph
  has every bias: a model without them is written with zeros, which add nothing);
- `llama`: rotary positions, pre-norm RMSNorm, SwiGLU, no biases, any n_kv_head, tied head or not;
  `qwen2` when only q, k and v have biases (`--qkv-bias`).
Weights go through the Hugging Face maps of `interop.gpt2` and `interop.llama` (each
completeness-checked) and then through `gguf`'s own Hugging Face -> GGUF name table, as llama.cpp's
convert_hf_to_gguf.py names them.
Two facts of llama.cpp's files on top of that: GGUF stores GPT-2's projections as (out, in), as
nn.Linear does, not as GPT-2's Conv1D (in, out); and llama.cpp's llama graph rotates adjacent feature
pairs (2i, 2i + 1) where gptlab and Hugging Face rotate (i, i + hs/2), so the rows of each query and key
head are interleaved on the way out (`interleave_heads`) and back on the way in. Qwen2's graph rotates
halves, so its rows are written as they are.

Whatever llama.cpp cannot compute as gptlab does is refused with one line naming every such setting and
the nearest exportable one (`export_problems`, the tokenizer's `gguf_vocab`, and for the exact GELU, which
the gpt2 graph computes in its tanh form, the measurement of `gguf_gelu`). The tokenizer is written by
`gguf_vocab` (char and byte ones as llama.cpp's rwkv vocabulary). Types: f32 is exact; f16 and q8_0 keep
vectors (norms, biases) in f32, as llama.cpp's converter does, and q8_0 writes a matrix in f16 when its rows
are not a multiple of 32 values (q8_0's block).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.checkpoint import (
    ADAPTER,
    Checkpoint,
    architecture,
    load_checkpoint,
    require_architecture,
    resolve_checkpoint,
)
from gptlab.common import need
from gptlab.config import ModelConfig, SettingError
from gptlab.files import atomic_write, remove_abandoned_temporaries
from gptlab.interop.gguf_gelu import gelu_check
from gptlab.interop.gguf_vocab import GGUFVocab, gguf_vocab, read_vocab, tokenizer_from_vocab, write_vocab
from gptlab.interop.gpt2 import from_gpt2_state, to_gpt2_state
from gptlab.interop.llama import from_llama_state, to_llama_state
from gptlab.interop.shapes import expected_shapes
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer, tokenizer_from_dict

GGUF_TYPES = ("f32", "f16", "q8_0")
SOURCE_KEY = "gptlab.source"  # the checkpoint a file was exported from: only its own export is replaced
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# gptlab's native chat template (gptlab.text.chat_template.NativeTemplate) in Jinja, for llama.cpp's chat
# mode.
NATIVE_JINJA = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# What each graph needs of a gptlab ModelConfig: field -> value. Neither graph has the GPU-speedrun options
# that change the function (zero_init changes only the start, so it exports). gpt2's ffn may also be
# gelu_exact, measured at export (gguf_gelu).
SPEEDRUN_OFF: dict[str, Any] = {"qk_norm": False, "logit_softcap": 0.0, "unet": False, "ngram_embeddings": ()}
GPT2_GRAPH = {"norm": "layernorm", "ffn": "gelu", "tied": True, **SPEEDRUN_OFF}
LLAMA_GRAPH = {"norm": "rmsnorm", "ffn": "swiglu", "bias": False, **SPEEDRUN_OFF}


@dataclass(frozen=True)
class GGUFExport:
    """What export_gguf wrote: the file, llama.cpp's architecture name, its tensors' types, and notes."""

    path: Path
    arch: str
    types: dict[str, str]
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# What llama.cpp can compute


def _setting(name: str, value: Any) -> str:
    """A config value as a SettingError template: `{ffn} gelu`, `{not_bias}` (--no-bias), `{tied}`."""
    if isinstance(value, bool):
        return f"{{{name}}}" if value else f"{{not_{name}}}"
    if isinstance(value, tuple):  # ngram_embeddings (2, 3): `{ngram_embeddings} 2 3`, or none at all
        return f"{{{name}}} {' '.join(map(str, value)) or 'left out'}"
    return f"{{{name}}} {value}"


def _fields(problems: list[str]) -> dict[str, str]:
    """The ModelConfig field behind each `{key}` of export_problems' templates (`not_x`: x switched off)."""
    keys = {key for problem in problems for key in re.findall(r"{(\w+)}", problem)}
    return {key: f"not ModelConfig.{key[4:]}" if key.startswith("not_") else f"ModelConfig.{key}"
            for key in keys}


def export_problems(config: ModelConfig) -> list[str]:
    """Every setting llama.cpp cannot compute as gptlab does, each with the nearest exportable setting, as
    SettingError templates whose `{field}`s name ModelConfig fields (`_fields`)."""
    where = "llama.cpp's graphs"
    if config.positions not in ("learned", "rope"):
        return [f"{{positions}} {config.positions}: llama.cpp has learned positions (its gpt2 graph) "
                "and rotary ones (its llama graph): use {positions} learned or {positions} rope"]
    graph, needs = ("gpt2", GPT2_GRAPH) if config.positions == "learned" else ("llama", LLAMA_GRAPH)
    problems = []
    if config.arrangement != "pre":
        problems.append(f"{{arrangement}} {config.arrangement}: {where} are pre-norm: "
                        "use {arrangement} pre")
    if not config.causal:
        problems.append(f"{{not_causal}}: {where} are causal: use {{causal}}")
    for name, wanted in needs.items():
        value = getattr(config, name)
        measured = graph == "gpt2" and value == "gelu_exact"  # gguf_gelu decides at export
        if value != wanted and not measured:
            problems.append(f"{_setting(name, value)}: llama.cpp's {graph} graph needs "
                            f"{_setting(name, wanted)}")
    if graph == "gpt2" and config.kv_heads != config.n_head:
        problems.append(f"{{n_kv_head}} {config.n_kv_head}: llama.cpp's gpt2 graph gives every head its keys "
                        "and values: leave {n_kv_head} out (or use the llama shape: {positions} rope)")
    return problems


def gguf_arch(config: ModelConfig) -> str:
    """llama.cpp's architecture for a config without export_problems: gpt2, llama or qwen2."""
    if config.positions == "learned":
        return "gpt2"
    return "qwen2" if config.attn_bias else "llama"


def exportable(checkpoint: Checkpoint) -> tuple[GGUFVocab, list[str]]:
    """The run's vocabulary for llama.cpp and notes for the user, or one SettingError naming every setting
    llama.cpp cannot compute as gptlab does (the model's, the tokenizer's, and the exact GELU's when it
    changes the greedy text)."""
    config = checkpoint.model_config
    problems, notes = export_problems(config), []
    try:
        vocab = gguf_vocab(checkpoint.tokenizer, config.vocab_size)
    except ValueError as err:
        problems.append(str(err))
    if config.positions == "learned" and config.ffn == "gelu_exact":
        check = gelu_check(checkpoint)
        if check.agrees:
            notes.append(check.summary())
        else:
            problems.append(f"{check.summary()}: use {{ffn}} gelu")
    if problems:
        raise SettingError(f"llama.cpp cannot run this model as gptlab does: {'; '.join(problems)}",
                           **_fields(problems))
    return vocab, [*notes, *vocab.notes]


# ---------------------------------------------------------------------------------------------
# Tensors


def interleave_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from halves (i, i + hs/2) to adjacent pairs (2i, 2i + 1): llama.cpp's rope order."""
    rows = weight.shape[0]
    # (heads * hs, ...) -> (heads, 2, hs/2, ...) -> (heads, hs/2, 2, ...) -> (heads * hs, ...)
    pairs = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def deinterleave_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of interleave_heads: adjacent pairs back to halves."""
    rows = weight.shape[0]
    # (heads * hs, ...) -> (heads, hs/2, 2, ...) -> (heads, 2, hs/2, ...) -> (heads * hs, ...)
    halves = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def _name_table(arch: str, config: ModelConfig) -> Any:
    gguf = need("gguf", "gguf", "export-gguf")

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.n_layer)


def _rope_heads(hf_name: str, config: ModelConfig) -> int | None:
    """Heads whose rows a llama-graph tensor interleaves: q_proj's n_head, k_proj's n_kv_head, else None."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return config.n_head
    return config.kv_heads if hf_name.endswith("self_attn.k_proj.weight") else None


def to_gguf_tensors(model_state: Mapping[str, torch.Tensor], config: ModelConfig,
                    arch: str) -> dict[str, torch.Tensor]:
    """GGUF tensors (llama.cpp's names, float32) from gptlab's, by way of the Hugging Face names."""
    shapes = expected_shapes(config)
    if arch == "gpt2":
        hf = to_gpt2_state(model_state, config)
        hf = {name: t.t() if name.endswith(CONV1D) else t for name, t in hf.items()}  # back to (out, in)
        hf["lm_head.weight"] = hf["transformer.wte.weight"]  # llama.cpp's converter writes GPT-2's head out
    else:
        hf = to_llama_state(model_state, config, shapes)
    table = _name_table(arch, config)
    out = {}
    for name, tensor in hf.items():
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf has no name for {name} in the {arch} graph"
        heads = _rope_heads(name, config) if arch == "llama" else None
        tensor = tensor.float()
        out[gguf_name] = (interleave_heads(tensor, heads) if heads else tensor).contiguous()
    return out


def from_gguf_tensors(tensors: Mapping[str, torch.Tensor], config: ModelConfig,
                      arch: str) -> dict[str, torch.Tensor]:
    """gptlab tensors from GGUF ones (the inverse of to_gguf_tensors; every tensor used, every one filled)."""
    table = _name_table(arch, config)
    shapes = expected_shapes(config)
    empty = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}  # names only
    if arch == "gpt2":
        hf_names = [*to_gpt2_state(empty, config), "lm_head.weight"]
    else:
        hf_names = list(to_llama_state(empty, config, shapes))
    by_gguf = {table.get_name(name, try_suffixes=(".weight", ".bias")): name for name in hf_names}
    if set(by_gguf) != set(tensors):
        missing, unused = sorted(set(by_gguf) - set(tensors)), sorted(set(tensors) - set(by_gguf))
        raise ValueError(f"the GGUF tensors do not fit its metadata: missing {missing}, unused {unused}")
    hf = {}
    for gguf_name, name in by_gguf.items():
        tensor = tensors[gguf_name]
        heads = _rope_heads(name, config) if arch == "llama" else None
        tensor = deinterleave_heads(tensor, heads) if heads else tensor
        hf[name] = tensor.t() if arch == "gpt2" and name.endswith(CONV1D) else tensor
    if arch == "gpt2":
        head = hf.pop("lm_head.weight")
        if not torch.equal(head, hf["transformer.wte.weight"]):
            raise ValueError("output.weight differs from token_embd.weight: gptlab's GPT-2 ties them")
        return from_gpt2_state(hf.items(), config)[0]
    return from_llama_state(hf.items(), config, shapes)[0]


def _tensor_type(tensor: torch.Tensor, kind: str) -> str:
    """The type a tensor is written in: vectors stay f32; q8_0 needs rows of whole 32-value blocks."""
    if kind == "f32" or tensor.dim() == 1:
        return "f32"
    if kind == "q8_0" and tensor.shape[-1] % 32:
        return "f16"
    return kind


# ---------------------------------------------------------------------------------------------
# Chat template


def chat_template_source(checkpoint: Checkpoint) -> str | None:
    """The run's chat template as Jinja: an import's own, or gptlab's native one where the tokenizer has
    its markers (a chat fine-tune); None for a run that was never taught to chat."""
    from gptlab.text.chat_template import NativeTemplate, missing_tokens

    saved = checkpoint.state.get("chat_template")
    if saved is not None:
        return saved["source"] if saved.get("kind") == "jinja" else NATIVE_JINJA
    tokenizer = tokenizer_from_dict(checkpoint.tokenizer)
    return None if missing_tokens(tokenizer, NativeTemplate()) else NATIVE_JINJA


# ---------------------------------------------------------------------------------------------
# Files


def exported_from(path: Path) -> str | None:
    """The checkpoint a GGUF file was exported from (its SOURCE_KEY), or None for any other file."""
    gguf = need("gguf", "gguf", "reading a GGUF file")

    try:
        return _field(gguf.GGUFReader(str(path)), SOURCE_KEY)
    except Exception:  # not a GGUF file at all: gguf raises what its parser meets
        return None


def export_gguf(run: str | Path, out: str | Path, kind: str = "f32") -> GGUFExport:
    """Write a run's best checkpoint as a GGUF file llama.cpp runs; everything is checked first. An
    existing `out` is replaced only when it is an earlier export of the same checkpoint."""
    gguf = need("gguf", "gguf", "export-gguf")

    if kind not in GGUF_TYPES:
        raise SettingError(f"{{t}} {kind} is not one of: {', '.join(GGUF_TYPES)}", t="kind")
    checkpoint = load_checkpoint(run)
    require_architecture(architecture(checkpoint.model_config), run, "decoder")
    if ADAPTER in checkpoint.state:
        raise ValueError(f"{run} is a LoRA run: merge its adapters into a run first (gptlab merge RUN OUT), "
                         "then export that")
    config = checkpoint.model_config
    vocab, notes = exportable(checkpoint)
    arch = gguf_arch(config)
    tensors = to_gguf_tensors(checkpoint.model_state, config, arch)
    out, source = Path(out), str(resolve_checkpoint(run).resolve())
    if out.exists() and exported_from(out) != source:
        raise SettingError(f"{out} exists and is not an earlier GGUF export of this run: choose another "
                           "{out} (nothing was written)", out="out")
    writer = gguf.GGUFWriter(None, arch)
    _write_metadata(writer, config, arch, kind)
    writer.add_string(SOURCE_KEY, source)
    write_vocab(writer, vocab, arch)
    template = chat_template_source(checkpoint)
    if template is not None:
        writer.add_chat_template(template)
    types = {}
    for name, tensor in tensors.items():
        types[name] = _tensor_type(tensor, kind)
        qtype = gguf.GGMLQuantizationType[types[name].upper()]
        data = gguf.quants.quantize(tensor.numpy(), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if types[name] == "q8_0" else None)

    def write(tmp: Path) -> None:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temporaries(out)
    atomic_write(out, write)
    if template is None:
        notes.append("no chat template: the run was not fine-tuned to chat")
    fallback = sorted(name for name, t in types.items() if kind == "q8_0" and t == "f16")
    if fallback:
        notes.append(f"{len(fallback)} matrices have rows that are not a multiple of 32 and were written in "
                     f"f16 (such as {fallback[0]})")
    return GGUFExport(out, arch, types, notes)


def _write_metadata(writer: Any, config: ModelConfig, arch: str, kind: str) -> None:
    gguf = need("gguf", "gguf", "export-gguf")

    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_name("gptlab model")
    writer.add_file_type(file_types[kind])
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.ffn_hidden)
    writer.add_head_count(config.n_head)
    if arch == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
        return
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.head_size)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_vocab_size(config.vocab_size)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value; a float32 one as the shortest decimal that rounds to it (1e-5, not 9.99999974e-6),
    the value it was written from, so that norm epsilons come back exactly."""
    found = reader.get_field(key)
    if found is None:
        return default
    value = found.contents()
    return float(str(np.float32(value))) if isinstance(value, float) else value


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFVocab]:
    """The config, gptlab tensors (float32) and vocabulary of a GGUF file that export_gguf wrote."""
    gguf = need("gguf", "gguf", "reading a GGUF file")

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ("gpt2", "llama", "qwen2"):
        raise ValueError(f"{path} holds a {arch!r} model: gptlab reads gpt2, llama and qwen2 GGUF files")
    tensors = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                                 dtype=np.float32)) for t in reader.tensors}
    def key(name: str) -> Any:
        return _field(reader, f"{arch}.{name}")

    n_embd = key("embedding_length")
    common = {"vocab_size": tensors["token_embd.weight"].shape[0], "block_size": key("context_length"),
              "n_layer": key("block_count"), "n_head": key("attention.head_count"), "n_embd": n_embd,
              "ffn_mult": key("feed_forward_length") / n_embd}
    if arch == "gpt2":
        config = ModelConfig(**common, norm_eps=key("attention.layer_norm_epsilon"))
    else:
        config = ModelConfig(**common, n_kv_head=key("attention.head_count_kv"),
                             norm_eps=key("attention.layer_norm_rms_epsilon"),
                             rope_base=key("rope.freq_base"), positions="rope", norm="rmsnorm",
                             ffn="swiglu", bias=False, qkv_bias=arch == "qwen2",
                             tied="output.weight" not in tensors)
    vocab = read_vocab(lambda name, default=None: _field(reader, name, default))
    return config, from_gguf_tensors(tensors, config, arch), vocab


def load_gguf(path: str | Path) -> tuple[GPT, Tokenizer]:
    """A gptlab model (eval mode, float32) and tokenizer from a GGUF file that export_gguf wrote."""
    config, tensors, vocab = read_gguf(path)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, f"missing {missing}, unused {unexpected}"
    return model.eval(), tokenizer_from_vocab(vocab)
