"""Hugging Face folders: gptlab runs <-> GPT-2, Llama and Qwen2 folders that `transformers` loads.

The folder-level work for every family: `export_hf` writes a run's best checkpoint (and an adapter run's
PEFT adapter), `import_hf` reads a local folder into a run, `to_transformers` and `from_transformers`
convert models in memory. Which family a run exports as follows from its config (`export_family`):
GPT-2's recipe (`interop.gpt2`) or a Llama's (`interop.llama`: rotary positions, RMSNorm, SwiGLU, no
biases; Qwen2 with q/k/v biases). Tokenizer files come from `interop.hf_tokenizer`; `interop.hf_folder`
reads the weight files, sharded or not. Reading and writing folders needs only safetensors, torch and
tokenizers; `transformers` (the `hf` extra) is imported only by `to_transformers`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm.auto import tqdm

from gptlab.checkpoint import (
    ADAPTER,
    BEST,
    Checkpoint,
    architecture,
    load_checkpoint,
    model_tensors,
    require_architecture,
    save_checkpoint,
)
from gptlab.common import on_terminal
from gptlab.config import SettingError
from gptlab.files import atomic_write, atomic_write_text, fsync, process_alive
from gptlab.interop.families import Conversion, export_family
from gptlab.interop.gpt2 import (
    from_gpt2_state,
    gpt2_config,
    gpt2_names,
    gpt2_tensors,
    model_config_from_gpt2,
    to_gpt2_state,
)
from gptlab.interop.hf_folder import chat_template, generation_defaults, read_tensors, tensor_count
from gptlab.interop.hf_tokenizer import hf_tokenizer_json, read_hf_tokenizer, read_llama_tokenizer
from gptlab.interop.llama import (
    FAMILIES,
    from_llama_state,
    llama_config,
    llama_names,
    llama_tensors,
    model_config_from_llama,
    to_llama_state,
)
from gptlab.interop.shapes import HEAD, expected_shapes
from gptlab.model import GPT
from gptlab.text.tokenizer import EOT, ImportedTokenizer

ADAPTER_DIR = "adapter"  # where export-hf puts an adapter run's PEFT adapter, inside the exported base
# What wrote a folder, so that running the same command again redoes it (and nothing else is replaced):
# {"command", "source", "files"}, under this key in the run's config.json (import-hf) or in
# EXPORT_MARKER, a hidden file beside the exported files that transformers and PEFT never read (export-hf).
SOURCE_KEY = "gptlab-source"
EXPORT_MARKER = f".{SOURCE_KEY}.json"


# ---------------------------------------------------------------------------------------------
# Folders


def _new_folder(out_dir: str | Path, marker: dict[str, Any] | None = None) -> Path:
    """`out_dir` when it is new, empty, or what the same command wrote from the same source before
    (`marker`, redone: `_staged` replaces it whole); any other existing path is refused, untouched."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and \
            not (marker is not None and _written_by(out_dir, marker)):
        raise ValueError(f"{out_dir} exists and is not an empty folder: choose a new output folder")
    return out_dir


def _read_marker(folder: Path) -> Any:
    """The SOURCE_KEY record in `folder`, or None: an export's EXPORT_MARKER, else an import's config.json."""
    for path, key in ((folder / EXPORT_MARKER, None), (folder / "config.json", SOURCE_KEY)):
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(values, dict):
            return values.get(SOURCE_KEY if key is None else key)
    return None


def _written_by(folder: Path, marker: dict[str, Any]) -> bool:
    """Whether `folder` was written by `marker`'s command from its source and holds nothing else."""
    found = _read_marker(folder)
    if not isinstance(found, dict) or any(found.get(k) != marker[k] for k in ("command", "source")):
        return False
    ours = {*map(str, found.get("files", [])), EXPORT_MARKER, ".lock"}  # .lock: a reader's RunLock
    held = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()}
    return held <= ours


def _remove_abandoned(out_dir: Path) -> None:
    """Delete the staging and replaced folders (`_staged`) that killed calls left beside `out_dir`."""
    for path in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*"):
        kind, _, pid = path.name[len(out_dir.name) + 2:].rpartition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not process_alive(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _staged(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling folder of `out_dir` to write into, renamed to `out_dir` once the block ends
    without an error (an existing `out_dir`, which `_new_folder` accepted, is renamed away first and then
    removed); on an error or a kill `out_dir` is left as it was and the temporary folder is removed (by
    the next call after a kill)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        yield tmp
        for path in sorted(tmp.rglob("*"), reverse=True):  # the files' folders: their entries last
            if path.is_dir():
                fsync(path)
        fsync(tmp)
        if out_dir.exists():
            os.replace(out_dir, old)
            try:
                os.replace(tmp, out_dir)
            except OSError:
                os.replace(old, out_dir)
                raise
        else:
            os.replace(tmp, out_dir)
        fsync(out_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _bar(what: str, progress: bool) -> tqdm:
    """A bar of the tensors read or converted, on stderr when `progress` and on a terminal (a GPT-2 small
    takes several seconds each way); its description then names the file being written."""
    return tqdm(desc=what, unit="tensor", disable=not (progress and on_terminal()), leave=False,
                dynamic_ncols=True)


def _counted(pairs: Iterable[tuple[str, torch.Tensor]], bar: tqdm,
             total: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` as they are, each counted on `bar` (of `total`, when known) once its taker is done with it."""
    bar.total = total
    bar.refresh()
    for pair in pairs:
        yield pair
        bar.update(1)


def export_hf(run: str | Path, out_dir: str | Path, adapter_only: bool = False,
              progress: bool = True) -> Conversion:
    """Write a run's best checkpoint as a folder that `transformers` loads: GPT2LMHeadModel, or
    LlamaForCausalLM / Qwen2ForCausalLM for a Llama-shaped model (`export_family`).

    The folder holds tokenizer files with which `AutoTokenizer` encodes exactly as the run's tokenizer (a
    kind that cannot be written so is refused). An adapter run (`gptlab finetune --lora`) adds its PEFT
    adapter (`export_adapter_run`); `adapter_only` writes that adapter alone. Everything is computed
    before the first file is written. With `progress`, a bar on a terminal counts the tensors converted.
    """
    checkpoint = load_checkpoint(run)
    require_architecture(architecture(checkpoint.model_config), run, "decoder")  # both are decoder-only
    if ADAPTER in checkpoint.state:
        return export_adapter_run(checkpoint, out_dir, adapter_only, progress)
    if adapter_only:
        raise SettingError(f"{run} holds no LoRA adapters (it is not a gptlab finetune --lora run): "
                           "export it without {a}", a="adapter_only")
    return export_checkpoint(checkpoint, out_dir, progress)


def export_adapter_run(checkpoint: Checkpoint, out_dir: str | Path, adapter_only: bool = False,
                       progress: bool = True) -> Conversion:
    """An adapter run as its base model in OUT (export_checkpoint) and its adapters as a PEFT adapter in
    OUT/adapter, a folder of its own: transformers would apply an adapter it found beside config.json.
    With `adapter_only`, the adapter alone in OUT, for a base exported before."""
    from gptlab.interop.peft import export_peft_adapter, peft_adapter
    from gptlab.lora import LoraConfig, is_lora_tensor

    model = checkpoint.build_gpt()  # the base run's model with the adapters on it (checkpoint.ADAPTER)
    lora = LoraConfig.from_dict(checkpoint.state[ADAPTER]["config"])
    peft_adapter(model, lora, None)  # refuses an adapter PEFT cannot hold before anything is written
    new_rows = checkpoint.state[ADAPTER].get("new_rows")
    if adapter_only and new_rows:
        raise SettingError(f"{checkpoint.source}'s adapter also trains the rows of {len(new_rows['ids'])} "
                           "tokens the run added to the vocabulary, which its base exported on its own "
                           "lacks: export the whole run (without {a}), or merge it (gptlab merge) and export "
                           "that",
                           a="adapter_only")
    marker = _export_marker(checkpoint, adapter_only)
    out_dir = _new_folder(out_dir, marker)
    if adapter_only:
        with _staged(out_dir) as folder:
            with _writing(out_dir, out_dir):
                written = export_peft_adapter(model, lora, folder)
            _write_export_marker(folder, out_dir, marker, written.files)
        base = checkpoint.state[ADAPTER]["base"]
        note = f"load it onto its base exported on its own: gptlab export-hf {base} HF_DIR"
        return Conversion(out_dir, written.files, [note])
    tensors = {name: t for name, t in model_tensors(model).items() if not is_lora_tensor(name)}
    with _bar("converting", progress) as bar:
        weights, texts = _hf_files(replace(checkpoint, model_state=tensors), bar)
        with _staged(out_dir) as folder:
            _write_hf_files(folder, out_dir, weights, texts, bar)
            with _writing(out_dir / ADAPTER_DIR, out_dir):
                adapter = export_peft_adapter(model, lora, folder / ADAPTER_DIR, str(out_dir.resolve()))
            files = ["model.safetensors", *texts, *(f"{ADAPTER_DIR}/{name}" for name in adapter.files)]
            _write_export_marker(folder, out_dir, marker, files)
    return Conversion(out_dir, files, [])


def export_checkpoint(checkpoint: Checkpoint, out_dir: str | Path, progress: bool = True) -> Conversion:
    """Write one decoder checkpoint's weights, config and tokenizer as a Hugging Face folder (export_hf)."""
    marker = _export_marker(checkpoint, False)
    out_dir = _new_folder(out_dir, marker)
    with _bar("converting", progress) as bar:
        weights, texts = _hf_files(checkpoint, bar)
        with _staged(out_dir) as folder:
            _write_hf_files(folder, out_dir, weights, texts, bar)
            files = ["model.safetensors", *texts]
            _write_export_marker(folder, out_dir, marker, files)
    return Conversion(out_dir, files, [])


def _export_marker(checkpoint: Checkpoint, adapter_only: bool) -> dict[str, Any]:
    """What an export records of itself (SOURCE_KEY): the command and the checkpoint file it read."""
    command = "export-hf --adapter-only" if adapter_only else "export-hf"
    return {"command": command, "source": str(Path(checkpoint.source).resolve())}


def _write_export_marker(folder: Path, out_dir: Path, marker: dict[str, Any], files: list[str]) -> None:
    with _writing(out_dir / EXPORT_MARKER, out_dir):
        atomic_write_text(folder / EXPORT_MARKER,
                          json.dumps({SOURCE_KEY: {**marker, "files": files}}, indent=2) + "\n")


@contextmanager
def _writing(path: Path, out_dir: Path) -> Iterator[None]:
    """Name `path`, where the export puts the file being written, in a failed write: a full disk's error
    names no file, and the file itself was in `_staged`'s temporary folder, which is removed."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        reason = getattr(err, "strerror", None) or str(err).removeprefix("Error while serializing: ")
        raise OSError(f"could not write {path} ({reason}); the export was abandoned and {out_dir} left as "
                      "it was: free some space, then export again") from err


def _hf_files(checkpoint: Checkpoint, bar: tqdm) -> tuple[dict[str, Any], dict[str, str]]:
    """The weights and the text files (name -> text) of a checkpoint's Hugging Face folder, each tensor
    counted on `bar` as it is converted."""
    from tokenizers import Tokenizer as HFTokenizer

    config = checkpoint.model_config
    family = export_family(config)
    tokenizer_json = hf_tokenizer_json(checkpoint.tokenizer)  # refuses a kind it cannot write exactly
    hf_tokenizer = HFTokenizer.from_str(tokenizer_json)
    if checkpoint.tokenizer["kind"] == ImportedTokenizer.kind:  # the imported model's own ids
        eot_id, bos_id = checkpoint.tokenizer.get("eos_id"), checkpoint.tokenizer.get("bos_id")
    else:
        eot_id = hf_tokenizer.token_to_id(EOT)  # None for char and byte, which have no end-of-text token
        bos_id = eot_id if family == "gpt2" else None
    if family == "gpt2":
        pairs, total = gpt2_tensors(checkpoint.model_state, config), len(gpt2_names(config))
        hf_config = gpt2_config(config, eot_id)
    else:
        pairs = llama_tensors(checkpoint.model_state, config, expected_shapes(config))
        total = sum(len(theirs) for theirs in llama_names(config).values())
        hf_config = llama_config(config, bos_id, eot_id)
    tensors = dict(_counted(pairs, bar, total))
    token = {name: None if i is None else hf_tokenizer.id_to_token(i) for name, i in (("eos", eot_id),
                                                                                   ("bos", bos_id))}
    texts = {"config.json": json.dumps(hf_config, indent=2) + "\n", "tokenizer.json": tokenizer_json,
             "tokenizer_config.json": json.dumps(
                 _tokenizer_config(token["eos"], token["bos"], config.block_size), indent=2)}
    return tensors, texts


def _write_hf_files(folder: Path, out_dir: Path, tensors: dict[str, Any], texts: dict[str, str],
                    bar: tqdm) -> None:
    """The weights and text files into the staging `folder` of the export to `out_dir`."""
    bar.set_description("writing model.safetensors")
    with _writing(out_dir / "model.safetensors", out_dir):
        atomic_write(folder / "model.safetensors",
                     lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    for name, text in texts.items():
        with _writing(out_dir / name, out_dir):
            atomic_write_text(folder / name, text)


def _tokenizer_config(eot: str | None, bos: str | None, block_size: int) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer over tokenizer.json, decoding text unchanged."""
    special = {"bos_token": bos, "eos_token": eot, "unk_token": eot} if eot is not None else {}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
            "clean_up_tokenization_spaces": False, **special}


def _hf_config(hf_dir: Path) -> Any:
    """The folder's config.json, read."""
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} holds no config.json: give a folder written by save_pretrained")
    try:
        return json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    except ValueError as err:  # not UTF-8, or not JSON: name the file, which the bare reason does not
        raise ValueError(f"{hf_dir / 'config.json'} is not a JSON file ({err}): copy it again from the "
                         "model's repository") from None


def read_hf(hf_dir: str | Path, progress: bool = True,
            bar: tqdm | None = None) -> tuple[Checkpoint, list[str]]:
    """A local GPT-2, Llama or Qwen2 folder as a checkpoint in memory (its weights, tokenizer, sampling
    defaults and chat template) and notes on what was read; nothing is written (`gptlab.load` reads one
    so). With `progress`, a bar on a terminal counts the tensors read (on `bar`, when given)."""
    hf_dir = Path(hf_dir)
    hf_config = _hf_config(hf_dir)
    family = hf_config.get("model_type", "gpt2") if isinstance(hf_config, dict) else None
    with nullcontext(bar) if bar is not None else _bar("reading", progress) as bar:
        if family == "gpt2":
            config = model_config_from_gpt2(hf_config)
            tokenizer, note = read_hf_tokenizer(hf_dir, config.vocab_size)
            tensors, skipped = from_gpt2_state(_counted(read_tensors(hf_dir), bar, tensor_count(hf_dir)),
                                               config)
        elif family in FAMILIES:
            config = model_config_from_llama(hf_config)
            tokenizer, note = read_llama_tokenizer(hf_dir, hf_config, config.vocab_size)
            tensors, skipped = from_llama_state(_counted(read_tensors(hf_dir), bar, tensor_count(hf_dir)),
                                                config, expected_shapes(config))
        else:
            raise ValueError(f"{hf_dir / 'config.json'} has model_type={family!r}: gptlab imports gpt2, "
                             f"{', '.join(FAMILIES)}")
    generation = generation_defaults(hf_dir)
    # `generation` is what `gptlab sample` uses for the settings its user leaves out
    state: dict[str, Any] = {"step": 0, "imported_from": str(hf_dir), "generation": generation}
    template = chat_template(hf_dir)  # kept as Jinja source; gptlab.adapt.chat renders it
    if template is not None:
        state["chat_template"] = template
    notes = [note]
    if generation:
        shown = ", ".join(f"{key} {value}" for key, value in generation.items())
        notes.append(f"generation_config.json: {shown}, used by `gptlab sample` unless given")
    if skipped:
        what = "causal-mask" if family == "gpt2" else "rotary-frequency"
        notes.append(f"skipped {len(skipped)} {what} buffers (such as {skipped[0]}), which are not weights: "
                     "gptlab builds them from the config")
    return Checkpoint(config, tokenizer, tensors, state=state, source=str(hf_dir)), notes


def import_hf(hf_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Conversion:
    """Read a local GPT-2, Llama or Qwen2 folder into a gptlab run folder (best.safetensors, config.json);
    with `progress`, a bar on a terminal counts the tensors read."""
    hf_dir = Path(hf_dir)
    marker = {"command": "import-hf", "source": str(hf_dir.resolve())}
    out_dir = _new_folder(out_dir, marker)  # refused before anything is read
    with _bar("reading", progress) as bar:
        checkpoint, notes = read_hf(hf_dir, progress, bar)
        resolved = {"model": checkpoint.model_config.to_dict(), "generation": checkpoint.state["generation"],
                    "imported_from": str(hf_dir), SOURCE_KEY: {**marker, "files": [BEST, "config.json"]}}
        bar.set_description(f"writing {BEST}")
        with _staged(out_dir) as folder:
            save_checkpoint(folder / BEST, checkpoint)
            atomic_write_text(folder / "config.json", json.dumps(resolved, indent=2) + "\n")
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
        state = to_llama_state(model_tensors(model), config, expected_shapes(config))
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
        tensors, _ = from_llama_state(hf_model.state_dict().items(), config, expected_shapes(config))
    else:
        config = model_config_from_gpt2(values)
        tensors, _ = from_gpt2_state(hf_model.state_dict().items(), config)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {HEAD}, f"missing {missing}, unexpected {unexpected}"
    return model.eval()
