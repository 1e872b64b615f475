"""Hugging Face interop: gptlab runs <-> GPT-2, Llama and Qwen2 folders that `transformers` loads.

This module holds GPT-2's map and the folder-level work for every family; the Llama family's configs
and name map are in `convert_llama`. Which family a run exports as follows from its config: GPT-2's
recipe below, or a Llama's (rotary positions, RMSNorm, SwiGLU, no biases; Qwen2 with q/k/v biases).

gptlab's GPT with learned positions, pre-norm LayerNorm, the tanh GELU, biases and a tied head is
GPT-2 (§5-§7 of the handout), and its modules carry GPT-2's checkpoint names, so the conversion is
an explicit name map that is the identity, plus two facts about GPT-2's files:
- GPT-2's projections are `Conv1D` layers that store their weight as (in, out); `nn.Linear` stores
  (out, in). The four projection weights of every block are transposed on the way in and out.
- Older GPT-2 checkpoints carry the causal mask as non-parameter buffers (`h.N.attn.bias`,
  `h.N.attn.masked_bias`) and may lack the `transformer.` prefix. Those buffers are skipped by name
  (gptlab builds its mask from the config); every other tensor must be used.
Every conversion checks completeness: each source tensor used, each target filled, each shape
asserted. Reading and writing folders (hf_folder.py reads the weight files, sharded or not) needs
only safetensors, torch and tokenizers; `transformers` (the `hf` extra) is imported only by
`to_transformers`.

Deliberate choices:
- The feed-forward width travels as GPT-2's `n_inner`, so any `ffn_mult` exports. The erf GELU
  (`gelu_exact`) exports as GPT-2's `activation_function: "gelu"`, and a model without biases (or
  without some) exports with zero biases: both give the same logits in transformers.
- gptlab has no attention-weight dropout: exports set `attn_pdrop=0`; imports take `resid_pdrop`.
- Tokenizers: `bpe` exports its own tokenizers JSON; `gpt2` rebuilds GPT-2's vocabulary and merges
  from tiktoken's ranks; `char` and `byte` have no Hugging Face equivalent and are not exported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gptlab.checkpoint import (
    ADAPTER,
    BEST,
    Checkpoint,
    architecture,
    check_tensors,
    gather_tensors,
    load_checkpoint,
    model_tensors,
    require_architecture,
    save_checkpoint,
)
from gptlab.config import ModelConfig
from gptlab.convert_llama import (
    FAMILIES,
    family_of,
    from_llama_state,
    llama_config,
    llama_problems,
    model_config_from_llama,
    to_llama_state,
)
from gptlab.files import atomic_write, atomic_write_text
from gptlab.hf_folder import (
    chat_template,
    eos_ids,
    generation_config,
    generation_defaults,
    read_tensors,
    token_ids,
)
from gptlab.model import GPT
from gptlab.tokenizer import EOT, ImportedTokenizer, tokenizer_from_dict

PREFIX, HEAD = "transformer.", "lm_head.weight"
ADAPTER_DIR = "adapter"  # where export-hf puts an adapter run's PEFT adapter, inside the exported base
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
    "qk_norm": False, "logit_softcap": 0.0, "unet": False,
}
# gptlab's GELUs as GPT-2's config names them: the tanh form is `gelu_new`, the erf form `gelu`.
GPT2_ACTIVATIONS = {"gelu": "gelu_new", "gelu_exact": "gelu"}
# What an imported `activation_function` is in gptlab: both tanh forms differ from `gelu` only in rounding.
FROM_GPT2_ACTIVATION = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}


@dataclass(frozen=True)
class Conversion:
    """What export_hf or import_hf wrote, and anything the user should know about it."""

    out_dir: Path
    files: list[str]
    notes: list[str] = field(default_factory=list)


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


def export_family(config: ModelConfig) -> str:
    """`gpt2`, `llama` or `qwen2`: the Hugging Face family this config is; one ValueError lists, for GPT-2
    and for the Llama family, every field that does not fit."""
    gpt2, llama = gpt2_problems(config), llama_problems(config)
    if not gpt2:
        return "gpt2"
    if not llama:
        return family_of(config)
    raise ValueError(f"this model is neither a GPT-2 ({'; '.join(gpt2)}) nor a Llama ({'; '.join(llama)})")


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
    get = {**GPT2_DEFAULTS, **hf}.get
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


def _expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Shapes of the gptlab tensors a model of this config stores (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    state = model.state_dict()
    if config.tied:
        state.pop(HEAD)  # the embedding holds it
    return {name: tensor.shape for name, tensor in state.items()}


def _is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D)


def to_gpt2_state(model_state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 tensors from gptlab's (tied head left out), Conv1D weights as (in, out).

    GPT-2 has every bias; one the model leaves out (bias=False, qkv_bias=False) is written as zeros,
    which compute exactly what no bias does.
    """
    shapes = _expected_shapes(config)
    names = gpt2_names(config)
    absent = set(names) - set(shapes)
    assert set(shapes) <= set(names), f"the name map misses {sorted(set(shapes) - set(names))}"
    assert all(name.endswith(".bias") for name in absent), f"only biases may be absent, not {sorted(absent)}"
    check_tensors(model_state, shapes)
    out = {}
    for ours, theirs in names.items():
        if ours in absent:  # as wide as its layer's output: rows of the (out, in) weight, or the norm's
            weight = model_state[ours.removesuffix("bias") + "weight"]
            out[theirs] = torch.zeros(weight.shape[0], dtype=weight.dtype)
            continue
        tensor = model_state[ours]
        out[theirs] = (tensor.t() if _is_conv1d(ours) else tensor).contiguous()
    return out


def from_gpt2_state(
    hf_tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """gptlab tensors (float32) from GPT-2's (name, tensor) pairs, and the mask buffers that were skipped.

    Every other source tensor must be used and every target filled with the expected shape; each
    tensor is converted as soon as it is read (`gather_tensors`), so shards are read one at a time.
    """
    shapes = _expected_shapes(config)

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


# ---------------------------------------------------------------------------------------------
# Tokenizers


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (vocab.json's alphabet).

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 take the
    characters from U+0100 upwards, in byte order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def byte_level_bpe(vocab: Mapping[str, int], merges: list[tuple[str, str]]) -> str:
    """Tokenizers JSON of a byte-level BPE set up like gptlab's bpe kind (GPT-2's split, no prefix space)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    hf = HFTokenizer(models.BPE(dict(vocab), merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    if EOT in vocab:
        hf.add_special_tokens([EOT])
    return hf.to_str()


def bpe_json_from_ranks(ranks: Mapping[bytes, int], special: Mapping[str, int]) -> str:
    """A byte-level BPE (tokenizers JSON) from tiktoken's form: token bytes -> id, merged in id order.

    tiktoken keeps no merge list: the merge that made a token is found by running BPE on the
    token's own bytes with only lower-ranked tokens, which leaves exactly two parts.
    """
    spell = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    merges = [tuple(map(text, _last_merge(token, ranks))) for token in by_rank if len(token) > 1]
    vocab = {**{text(token): rank for token, rank in ranks.items()}, **special}
    return byte_level_bpe(vocab, merges)  # type: ignore[arg-type]


def _last_merge(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins last when it encodes `token` with only lower-ranked tokens."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        # the lowest-ranked adjacent pair, leftmost first, as tiktoken's encoder chooses
        pairs = enumerate(zip(parts, parts[1:], strict=False))
        rank, i = min((ranks.get(a + b, limit), i) for i, (a, b) in pairs)
        if rank >= limit:
            raise ValueError(f"token {token!r} is not made of lower-ranked tokens: not a BPE vocabulary")
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def hf_tokenizer_json(tokenizer: Mapping[str, Any]) -> str | None:
    """Tokenizers JSON that encodes like a saved gptlab tokenizer; None for char and byte."""
    if tokenizer["kind"] in ("bpe", ImportedTokenizer.kind):
        return tokenizer["json"]
    if tokenizer["kind"] == "gpt2":
        # tokenizer.py's loader, for its error message that says how to get tiktoken's files
        from gptlab.tokenizer import load_gpt2_encoding

        encoding = load_gpt2_encoding()
        eot = encoding.eot_token
        ranks = {encoding.decode_single_token_bytes(i): i for i in range(encoding.n_vocab) if i != eot}
        return bpe_json_from_ranks(ranks, {EOT: eot})
    return None


def read_hf_tokenizer(hf_dir: Path, vocab_size: int) -> tuple[dict[str, Any], str]:
    """A gptlab tokenizer dict from a GPT-2 folder's tokenizer files, and a note on what was used."""
    from tokenizers import Tokenizer as HFTokenizer

    if (hf_dir / "tokenizer.json").is_file():
        source = "tokenizer.json"
        tokenizer_json = HFTokenizer.from_file(str(hf_dir / source)).to_str()
    elif (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
        lines = (hf_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
        if any(len(merge) != 2 for merge in merges):
            raise ValueError(f"{hf_dir / 'merges.txt'} is not a merges file: every line must be two tokens")
        tokenizer_json, source = byte_level_bpe(vocab, merges), "vocab.json and merges.txt"  # type: ignore[arg-type]
    elif vocab_size == GPT2_VOCAB:
        return {"kind": "gpt2"}, "no tokenizer files: using GPT-2's own encoding through tiktoken (gpt2 kind)"
    else:
        raise ValueError(
            f"{hf_dir} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt) and its "
            f"vocabulary of {vocab_size} is not GPT-2's {GPT2_VOCAB}: add the tokenizer files to the folder"
        )
    tokenizer = tokenizer_from_dict({"kind": "bpe", "json": tokenizer_json})
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer in {hf_dir} has {tokenizer.vocab_size} ids but the model only "
                         f"{vocab_size}: the tokenizer files belong to another model")
    return tokenizer.to_dict(), f"tokenizer from {source}: {tokenizer.vocab_size} ids (bpe kind)"


def _tokenizer_config(eot: str | None, bos: str | None, block_size: int) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer over tokenizer.json, decoding text unchanged."""
    special = {"bos_token": bos, "eos_token": eot, "unk_token": eot} if eot is not None else {}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
            "clean_up_tokenization_spaces": False, **special}


def read_llama_tokenizer(hf_dir: Path, hf_config: Mapping[str, Any],
                         vocab_size: int) -> tuple[dict[str, Any], str]:
    """An imported model's tokenizer.json as an `hf` tokenizer, with the ids its config.json gives; every
    end-of-sequence id it or generation_config.json lists ends a generation (Llama 3 lists three)."""
    if not (hf_dir / "tokenizer.json").is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json: save the tokenizer beside the model "
                         "(tokenizer.save_pretrained) and import again")
    ends = eos_ids(hf_dir, dict(hf_config))
    bos = token_ids(hf_config.get("bos_token_id")) or token_ids(generation_config(hf_dir).get("bos_token_id"))
    tokenizer = ImportedTokenizer((hf_dir / "tokenizer.json").read_text(encoding="utf-8"),
                                  ends[0] if ends else None, bos[0] if bos else None, ends[1:])
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer in {hf_dir} has {tokenizer.vocab_size} ids but the model only "
                         f"{vocab_size}: the tokenizer files belong to another model")
    said = "no end-of-sequence id" if not ends else f"end of sequence {', '.join(map(str, ends))}"
    return tokenizer.to_dict(), f"tokenizer from tokenizer.json: {tokenizer.vocab_size} ids, {said} (hf kind)"


# ---------------------------------------------------------------------------------------------
# Folders


def _new_folder(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty folder: choose a new output folder")
    return out_dir


def export_hf(run: str | Path, out_dir: str | Path, adapter_only: bool = False) -> Conversion:
    """Write a run's best checkpoint as a folder that `transformers` loads: GPT2LMHeadModel, or
    LlamaForCausalLM / Qwen2ForCausalLM for a Llama-shaped model (`export_family`).

    With a bpe, gpt2 or hf tokenizer the folder also holds tokenizer files for `AutoTokenizer`. An adapter
    run (`gptlab finetune --lora`) adds its PEFT adapter (`export_adapter_run`); `adapter_only` writes
    that adapter alone. Everything is computed before the first file is written.
    """
    checkpoint = load_checkpoint(run)
    require_architecture(architecture(checkpoint.model_config), run, "decoder")  # both are decoder-only
    if ADAPTER in checkpoint.state:
        return export_adapter_run(checkpoint, out_dir, adapter_only)
    if adapter_only:
        raise ValueError(f"{run} holds no LoRA adapters (it is not a gptlab finetune --lora run): export it "
                         "without --adapter-only")
    return export_checkpoint(checkpoint, out_dir)


def export_adapter_run(checkpoint: Checkpoint, out_dir: str | Path, adapter_only: bool = False) -> Conversion:
    """An adapter run as its base model in OUT (export_checkpoint) and its adapters as a PEFT adapter in
    OUT/adapter, a folder of its own: transformers would apply an adapter it found beside config.json.
    With `adapter_only`, the adapter alone in OUT, for a base exported before."""
    from gptlab.adapt.lora import LoraConfig, export_peft_adapter, is_lora_tensor, peft_adapter

    model = checkpoint.build_model()  # the base run's model with the adapters on it (checkpoint.ADAPTER)
    lora = LoraConfig.from_dict(checkpoint.state[ADAPTER]["config"])
    peft_adapter(model, lora, None)  # refuses an adapter PEFT cannot hold before anything is written
    out_dir = _new_folder(out_dir)
    if adapter_only:
        written = export_peft_adapter(model, lora, out_dir)
        base = checkpoint.state[ADAPTER]["base"]
        note = f"load it onto its base exported on its own: gptlab export-hf {base} HF_DIR"
        return Conversion(out_dir, written.files, [note])
    tensors = {name: t for name, t in model_tensors(model).items() if not is_lora_tensor(name)}
    exported = export_checkpoint(replace(checkpoint, model_state=tensors), out_dir)
    adapter = export_peft_adapter(model, lora, out_dir / ADAPTER_DIR, str(out_dir.resolve()))
    return Conversion(out_dir, [*exported.files, *(f"{ADAPTER_DIR}/{name}" for name in adapter.files)],
                      exported.notes)


def export_checkpoint(checkpoint: Checkpoint, out_dir: str | Path) -> Conversion:
    """Write one decoder checkpoint's weights, config and tokenizer as a Hugging Face folder (export_hf)."""
    from tokenizers import Tokenizer as HFTokenizer

    config = checkpoint.model_config
    family = export_family(config)
    out_dir = _new_folder(out_dir)
    tokenizer_json = hf_tokenizer_json(checkpoint.tokenizer)
    hf_tokenizer = HFTokenizer.from_str(tokenizer_json) if tokenizer_json else None
    if checkpoint.tokenizer["kind"] == ImportedTokenizer.kind:  # the imported model's own ids
        eot_id, bos_id = checkpoint.tokenizer.get("eos_id"), checkpoint.tokenizer.get("bos_id")
    else:
        eot_id = hf_tokenizer.token_to_id(EOT) if hf_tokenizer else None
        bos_id = eot_id if family == "gpt2" else None
    if family == "gpt2":
        tensors = to_gpt2_state(checkpoint.model_state, config)
        hf_config = gpt2_config(config, eot_id)
    else:
        tensors = to_llama_state(checkpoint.model_state, config, _expected_shapes(config))
        hf_config = llama_config(config, bos_id, eot_id)
    texts = {"config.json": json.dumps(hf_config, indent=2) + "\n"}
    notes = []
    if hf_tokenizer is None:
        notes.append(f"the {checkpoint.tokenizer['kind']} tokenizer has no Hugging Face equivalent: "
                     "only the weights are exported")
    else:
        token = {name: None if i is None else hf_tokenizer.id_to_token(i) for name, i in (("eos", eot_id),
                                                                                       ("bos", bos_id))}
        texts["tokenizer.json"] = tokenizer_json  # type: ignore[assignment]
        texts["tokenizer_config.json"] = json.dumps(
            _tokenizer_config(token["eos"], token["bos"], config.block_size), indent=2)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "model.safetensors",
                 lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    for name, text in texts.items():
        atomic_write_text(out_dir / name, text)
    return Conversion(out_dir, ["model.safetensors", *texts], notes)


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Conversion:
    """Read a local GPT-2, Llama or Qwen2 folder into a gptlab run folder (best.safetensors, config.json)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} holds no config.json: give a folder written by save_pretrained")
    hf_config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    family = hf_config.get("model_type", "gpt2") if isinstance(hf_config, dict) else None
    if family == "gpt2":
        config = model_config_from_gpt2(hf_config)
        tokenizer, note = read_hf_tokenizer(hf_dir, config.vocab_size)
        generation = generation_defaults(hf_dir)
        tensors, skipped = from_gpt2_state(read_tensors(hf_dir), config)
    elif family in FAMILIES:
        config = model_config_from_llama(hf_config)
        tokenizer, note = read_llama_tokenizer(hf_dir, hf_config, config.vocab_size)
        generation = generation_defaults(hf_dir)
        tensors, skipped = from_llama_state(read_tensors(hf_dir), config, _expected_shapes(config))
    else:
        raise ValueError(f"{hf_dir / 'config.json'} has model_type={family!r}: gptlab imports gpt2, "
                         f"{', '.join(FAMILIES)}")
    out_dir = _new_folder(out_dir)
    # `generation` is what `gptlab sample` uses for the settings its user leaves out (generation_defaults)
    state = {"step": 0, "imported_from": str(hf_dir), "generation": generation}
    template = chat_template(hf_dir)  # kept as Jinja source; gptlab.adapt.chat renders it
    if template is not None:
        state["chat_template"] = template
    save_checkpoint(out_dir / BEST, Checkpoint(config, tokenizer, tensors, state=state))
    resolved = {"model": config.to_dict(), "generation": generation, "imported_from": str(hf_dir)}
    atomic_write_text(out_dir / "config.json", json.dumps(resolved, indent=2) + "\n")
    notes = [note]
    if generation:
        shown = ", ".join(f"{key} {value}" for key, value in generation.items())
        notes.append(f"generation_config.json: {shown}, used by `gptlab sample` unless given")
    if skipped:
        what = "causal-mask" if family == "gpt2" else "rotary-frequency"
        notes.append(f"skipped {len(skipped)} {what} buffers (such as {skipped[0]}), which are not weights: "
                     "gptlab builds them from the config")
    return Conversion(out_dir, [BEST, "config.json"], notes)


# ---------------------------------------------------------------------------------------------
# In memory, for tests and benchmarks that run both libraries side by side


def to_transformers(model: GPT) -> Any:
    """A `transformers` model in eval mode with this model's weights (needs the hf extra): GPT2LMHeadModel,
    LlamaForCausalLM or Qwen2ForCausalLM, as `export_family` decides."""
    try:
        import transformers
    except ImportError:
        raise ValueError("to_transformers needs transformers: pip install 'gptlab[hf]'") from None
    config = model.config
    family = export_family(config)
    if family == "gpt2":
        values = gpt2_config(config)
        state = to_gpt2_state(model_tensors(model), config)
    else:
        values = llama_config(config, None, None)
        state = to_llama_state(model_tensors(model), config, _expected_shapes(config))
    architecture = values.pop("architectures")[0]
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    hf = getattr(transformers, architecture)(hf_config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {HEAD}, f"missing {missing}, unexpected {unexpected}"
    return hf.to(next(model.parameters()).device).eval()


def from_transformers(hf_model: Any) -> GPT:
    """A gptlab GPT in eval mode with the weights of a `transformers` GPT-2, Llama or Qwen2 model."""
    values = hf_model.config.to_dict()
    if values.get("model_type") in FAMILIES:
        config = model_config_from_llama(values)
        tensors, _ = from_llama_state(hf_model.state_dict().items(), config, _expected_shapes(config))
    else:
        config = model_config_from_gpt2(values)
        tensors, _ = from_gpt2_state(hf_model.state_dict().items(), config)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {HEAD}, f"missing {missing}, unexpected {unexpected}"
    return model.eval()
