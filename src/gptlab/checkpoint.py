"""Checkpoints: one safetensors file holding everything a run needs, written atomically.

A checkpoint file holds tensors under three prefixes (`model.NAME`, `optim.PARAM/SLOT`, `rng.NAME`)
and JSON in the safetensors header: the model and train configs, the tokenizer, and the training
state (step, best validation loss, ...). Nothing needs pickle to load. Weights and optimiser slots
are full tensors keyed by parameter name, so the file is the same whatever the world size. A run folder holds
`last.safetensors` (for --resume) and `best.safetensors` (lowest validation loss, for sampling).

Writes go to a temporary file that is fsynced and then renamed over the old one, so a crash or kill
at any moment leaves the previous checkpoint intact. Runs sharded over processes (torchrun with FSDP)
save sharded checkpoints instead (gptlab.sharded: a folder of shards and a pointer file); every reader
here takes either kind. A model ready to run (adapters, device, dtype, int8, layout) is
`gptlab.inference.loading`'s job: `gptlab.load`.
"""

from __future__ import annotations

import base64
import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from gptlab import sharded
from gptlab.config import ModelConfig, Seq2SeqConfig, SettingError, TrainConfig
from gptlab.files import RunLock, atomic_write, file_sha256, remove_stale_temporaries
from gptlab.model import GPT
from gptlab.seq2seq.model import EncoderDecoder
from gptlab.text.tokenizer import DamagedTokenizerError, Tokenizer, tokenizer_from_dict

FORMAT = "gptlab-checkpoint-1"
# The state key of an adapter run (`gptlab finetune --lora`): {"base": its base run's checkpoint file,
# "base_sha256": that file's SHA-256 when the run started (runs from before it was recorded have none),
# "config": the LoraConfig, and "new_rows" when the run added tokens: {"ids", "mean_of"}, see
# gptlab.adapt.finetune}. Such a checkpoint holds only the adapter tensors (with those tokens' rows).
ADAPTER = "lora"
LAST, BEST = "last.safetensors", "best.safetensors"
# The architectures a checkpoint may hold: its config class and model class, by the name it is saved under.
ARCHITECTURES: dict[str, tuple[type[ModelConfig], Callable[..., GPT | EncoderDecoder]]] = {
    "decoder": (ModelConfig, GPT), "encoder-decoder": (Seq2SeqConfig, EncoderDecoder)}


def architecture(config: ModelConfig) -> str:
    """The name under which a checkpoint records which model `config` builds."""
    return "encoder-decoder" if isinstance(config, Seq2SeqConfig) else "decoder"


def new_model(config: ModelConfig) -> GPT | EncoderDecoder:
    """A freshly initialised model of the architecture `config` describes."""
    return ARCHITECTURES[architecture(config)][1](config)


@dataclass
class Checkpoint:
    """The contents of one checkpoint file."""

    model_config: ModelConfig
    tokenizer: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    train_config: TrainConfig | None = None
    state: dict[str, Any] = field(default_factory=dict)  # step, best_val_loss, ... (JSON)
    optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None  # parameter name -> slot -> tensor
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str = "the checkpoint"  # the file (or sharded pointer or folder) it was read from

    @property
    def lazy(self) -> bool:
        """Whether the tensors are shapes only (meta tensors), to be loaded shard by shard into a
        sharded run (`load_checkpoint(..., lazy=True)` of a sharded checkpoint)."""
        return any(t.is_meta for t in self.model_state.values())

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer saved in the header, or one line naming this file when it is damaged."""
        try:
            return tokenizer_from_dict(self.tokenizer)
        except DamagedTokenizerError as err:
            raise ValueError(f"{self.source}: its saved tokenizer is damaged ({err}); use another "
                             "checkpoint of the run") from None

    def build_model(self) -> GPT | EncoderDecoder:
        """The model with these weights (tied heads restored from the embedding); for an adapter run, its
        base run's model with these LoRA adapters on it."""
        if ADAPTER in self.state:
            return adapted_model(self)
        return self.load_weights(new_model(self.model_config))

    def build_gpt(self) -> GPT:
        """`build_model` for callers that need a decoder-only model; another architecture is a ValueError."""
        model = self.build_model()
        if not isinstance(model, GPT):
            raise ValueError(f"{self.source} holds {HOLDS[architecture(self.model_config)]}")
        return model

    def load_weights(self, model: GPT | EncoderDecoder) -> GPT | EncoderDecoder:
        """Copy these weights into `model`, which must have this checkpoint's architecture; return it."""
        try:
            missing, unexpected = model.load_state_dict(self.model_state, strict=False)
        except RuntimeError as err:  # a tensor of another shape than the config in the header says
            mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), err)
            raise ValueError(f"{self.source} is damaged: its weights do not fit the model config in its "
                             f"header ({mismatch}); use another checkpoint of the run") from None
        allowed_missing = ["lm_head.weight"] if self.model_config.tied else []
        if unexpected or sorted(missing) != allowed_missing:
            raise ValueError(f"{self.source} is damaged: its weights do not fit the model config in its "
                             f"header (missing {missing}, unexpected {unexpected}); use another checkpoint")
        return model


def adapted_model(checkpoint: Checkpoint) -> GPT:
    """The base run's model (`checkpoint.state[ADAPTER]["base"]`) with the checkpoint's LoRA adapters;
    a base whose file changed since the adapters were trained on it (its recorded SHA-256) is refused."""
    # gptlab.adapt builds on this module (lora -> interop.huggingface -> checkpoint): imported when used,
    # not above.
    from gptlab.lora import LoraConfig, add_lora, add_trainable_tokens, grow_embeddings, load_lora_state

    saved = checkpoint.state[ADAPTER]
    base_file = Path(saved["base"])
    if not base_file.is_file():
        raise ValueError(f"{checkpoint.source} holds LoRA adapters for the base model {base_file}, which is "
                         "not there: put the base run back, or merge the adapters (gptlab merge) while it is")
    if "base_sha256" in saved and file_sha256(base_file) != saved["base_sha256"]:
        raise ValueError(f"{checkpoint.source}'s LoRA adapters were trained on {base_file}, which has "
                         "changed since (its content hash differs): restore that base, or fine-tune again "
                         "from the base as it is now")
    base = load_checkpoint(base_file)
    new_rows = saved.get("new_rows")  # chat markers added by the run: the base grows their rows first
    vocab_size = base.model_config.vocab_size if new_rows is None else checkpoint.model_config.vocab_size
    if base.model_config.replace(vocab_size=vocab_size) != checkpoint.model_config or ADAPTER in base.state:
        raise ValueError(f"{base_file} is not the base model {checkpoint.source} was trained on (another "
                         "shape or vocabulary): fine-tune again from the base you have")
    model = base.build_gpt()
    if new_rows is not None:
        model = grow_embeddings(model, new_rows["ids"], new_rows["mean_of"])
    model = add_lora(model, LoraConfig.from_dict(saved["config"]))
    if new_rows is not None:
        add_trainable_tokens(model, new_rows["ids"])
    load_lora_state(model, checkpoint.model_state)
    return model


def model_tensors(model: GPT | EncoderDecoder) -> dict[str, torch.Tensor]:
    """The model's state without the duplicate name of a tied head (safetensors stores no aliases)."""
    state = model.state_dict()
    if model.config.tied:
        state.pop("lm_head.weight")
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def flat_tensors(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The weights and optimiser slots under the keys a checkpoint stores them by (model.NAME,
    optim.PARAM/SLOT)."""
    tensors = {f"model.{name}": t for name, t in checkpoint.model_state.items()}
    for param, slots in (checkpoint.optimizer_state or {}).items():
        tensors.update({f"optim.{param}/{slot}": t for slot, t in slots.items()})
    return tensors


def header(checkpoint: Checkpoint) -> dict[str, str]:
    """The checkpoint's JSON header: format, architecture, configs, tokenizer and training state."""
    return {
        "format": FORMAT,
        "architecture": architecture(checkpoint.model_config),
        "model_config": json.dumps(checkpoint.model_config.to_dict()),
        "train_config": json.dumps(checkpoint.train_config.to_dict() if checkpoint.train_config else None),
        "tokenizer": json.dumps(checkpoint.tokenizer),
        "state": json.dumps(checkpoint.state),
        "has_optimizer": json.dumps(checkpoint.optimizer_state is not None),
    }


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> None:
    """Write `checkpoint` to `path` atomically (temporary file, fsync, rename)."""
    tensors = {key: t.contiguous() for key, t in flat_tensors(checkpoint).items()}
    tensors.update({f"rng.{name}": t.contiguous() for name, t in checkpoint.rng.items()})
    metadata = header(checkpoint)
    try:
        atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    except (OSError, SafetensorError) as err:  # a full disk, a file-size limit, a folder that went away
        reason = getattr(err, "strerror", None) or str(err).removeprefix("Error while serializing: ")
        raise OSError(f"could not write {path} ({reason}); the previous {Path(path).name}, "
                      "if any, is untouched: free some space, then continue the run with --resume") from err


def save_to_run(run_dir: Path, names: list[str], checkpoint: Checkpoint, shard: bool) -> None:
    """Save `checkpoint` as each of `names` (LAST, BEST) in a run folder: one sharded folder they all
    name (every process calls this; the tensors may be DTensor shards), or a single file each (only the
    main process calls this; it also retires a sharded checkpoint of the same name)."""
    if not shard:
        for name in names:
            save_checkpoint(run_dir / name, checkpoint)
            sharded.retire(run_dir, name)
        return
    rng = {name: base64.b64encode(t.numpy().tobytes()).decode() for name, t in checkpoint.rng.items()}
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = {**header(checkpoint), "rng": json.dumps(rng)}
    try:
        sharded.write(run_dir, names, flat_tensors(checkpoint), metadata, checkpoint.state.get("step", 0))
    except (OSError, CheckpointException) as err:  # a full disk, a folder that went away
        raise OSError(f"could not write a sharded checkpoint into {run_dir / sharded.FOLDER} "
                      f"({str(err).splitlines()[0]}); the previous one, if any, is untouched: free some "
                      "space, then continue the run with --resume") from err


def consolidate(run_dir: Path) -> list[Path]:
    """Turn a run's sharded checkpoints into single safetensors files (for copying, exporting or tools that
    read one file); the shard folders are removed once the files are written. Returns the files written:
    none when the run holds single files already."""
    if not has_checkpoint(run_dir):
        raise ValueError(f"{run_dir} holds no checkpoint: there is nothing to consolidate")
    written = []
    with RunLock(run_dir):
        remove_stale_temporaries(run_dir)
        for name in (LAST, BEST):
            if sharded.pointer(run_dir, name).is_file():
                save_checkpoint(run_dir / name, load_checkpoint(sharded.pointer(run_dir, name)))
                sharded.retire(run_dir, name)
                written.append(run_dir / name)
    return written


def has_checkpoint(run_dir: Path, *names: str) -> bool:
    """Whether the folder holds any of `names` (default LAST and BEST), as a file or sharded."""
    return any((run_dir / name).is_file() or sharded.pointer(run_dir, name).is_file()
               for name in names or (LAST, BEST))


def resolve_checkpoint(path: str | Path, prefer: str = BEST) -> Path:
    """A checkpoint from a path (a file, a sharded pointer or folder) or a run folder: its `prefer`
    checkpoint, else the other one; of a file and a sharded pointer of one name, the newer."""
    path = Path(path)
    if path.is_file() or sharded.is_sharded(path):
        return path
    if not path.exists():
        raise FileNotFoundError(f"no run folder or checkpoint at {path}")
    for name in (prefer, LAST, BEST):
        found = [p for p in (path / name, sharded.pointer(path, name)) if p.is_file()]
        if found:
            return max(found, key=lambda p: p.stat().st_mtime_ns)
    raise FileNotFoundError(f"{path} holds no checkpoint ({LAST} or {BEST}): train a model into it first")


def checkpoint_architecture(path: str | Path, prefer: str = BEST) -> str:
    """The architecture a run folder or checkpoint holds, read from its header alone."""
    return _metadata(resolve_checkpoint(path, prefer)).get("architecture", "decoder")


def _metadata(file: Path) -> dict[str, str]:
    if sharded.is_sharded(file):
        return sharded.read_header(file)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            return reader.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{file} is not a readable gptlab checkpoint ({err})") from err


def load_checkpoint(path: str | Path, prefer: str = BEST, lazy: bool = False,
                    optimizer: bool = True) -> Checkpoint:
    """Read a checkpoint (or a run folder's `prefer` checkpoint) onto the CPU, whole.

    With `lazy`, a sharded checkpoint's tensors are shapes only (meta tensors): a sharded run then
    loads just its own shards (gptlab.training.distributed.load_shards). Without `optimizer` the optimiser
    slots, twice the weights' size under AdamW, are not read (`optimizer_state` is None): enough to use a
    model.
    """
    return _read(path, prefer, "shapes" if lazy else "all" if optimizer else "weights")


def load_header(path: str | Path, prefer: str = BEST) -> Checkpoint:
    """A checkpoint's configs, tokenizer and state from its JSON header alone: no tensor is read, so
    `model_state`, `optimizer_state` and `rng` are empty."""
    return _read(path, prefer, "header")


def _read(path: str | Path, prefer: str, read: str) -> Checkpoint:
    """`read`: which tensors: header (none), weights (not the optimiser's), all, or shapes (all, as meta
    tensors, from a sharded checkpoint; a file reads them all)."""
    file = resolve_checkpoint(path, prefer)
    keep = {"header": lambda key: False, "weights": lambda key: not key.startswith("optim.")}.get(
        read, lambda key: True)
    metadata, found = (_read_sharded(file, keep, read == "shapes") if sharded.is_sharded(file)
                       else _read_file(file, keep))
    groups: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}, "rng": {}}
    for key, tensor in found.items():
        prefix, _, rest = key.partition(".")
        groups.setdefault(prefix, {})[rest] = tensor
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{file} is not a gptlab checkpoint (format {metadata.get('format')!r})")
    name = metadata.get("architecture", "decoder")  # files from before encoder-decoders name none
    if name not in ARCHITECTURES:
        raise ValueError(f"{file} holds a {name!r} model, which this version of gptlab cannot build")
    try:
        checkpoint = parse_checkpoint(metadata, groups, ARCHITECTURES[name][0], str(file))
    except (KeyError, TypeError, ValueError) as err:  # a header that was edited or damaged
        raise ValueError(f"{file} has a damaged header ({str(err).splitlines()[0]}): use another checkpoint "
                         "of the run") from None
    if read == "weights":
        checkpoint.optimizer_state = None
    return checkpoint


def _read_file(file: Path, keep: Callable[[str], bool]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            tensors = {key: reader.get_tensor(key) for key in reader.keys() if keep(key)}
            return reader.metadata() or {}, tensors
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{file} is not a readable gptlab checkpoint ({err})") from err


def _read_sharded(file: Path, keep: Callable[[str], bool],
                  lazy: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    metadata = sharded.read_header(file)
    found: dict[str, torch.Tensor] = {}
    if lazy:
        found = {key: torch.empty(size, dtype=dtype, device="meta")
                 for key, (size, dtype) in sharded.shapes(file).items()}
    elif keep("model."):
        found = sharded.read_whole(file, keep)
    try:
        rng = json.loads(metadata.pop("rng", "{}"))
        found.update({f"rng.{name}": torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)
                      for name, data in rng.items()})
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{file} has a damaged header ({err}): use another checkpoint of the run") from None
    return metadata, found


def parse_checkpoint(metadata: dict[str, str], groups: dict[str, dict[str, torch.Tensor]],
                     config_class: type[ModelConfig], source: str) -> Checkpoint:
    """A Checkpoint from a file's JSON header and its tensors grouped by prefix."""
    train_config = json.loads(metadata["train_config"])
    optimizer: dict[str, dict[str, torch.Tensor]] | None = None
    if json.loads(metadata["has_optimizer"]):
        optimizer = {}
        for key, tensor in groups["optim"].items():
            param, _, slot = key.rpartition("/")
            optimizer.setdefault(param, {})[slot] = tensor
    return Checkpoint(config_class.from_dict(json.loads(metadata["model_config"])),
                      json.loads(metadata["tokenizer"]), groups["model"],
                      TrainConfig.from_dict(train_config) if train_config else None,
                      json.loads(metadata["state"]), optimizer, groups["rng"], source)


HOLDS = {"decoder": "a decoder-only language model: use the language-model commands (train, sample, ...)",
         "encoder-decoder": "an encoder-decoder (seq2seq) model: use the `gptlab seq2seq` commands"}


def require_architecture(found: str, path: str | Path, expect: str) -> None:
    """A ValueError saying which commands to use when `path` holds another architecture than `expect`."""
    if found != expect:
        raise ValueError(f"{path} holds {HOLDS[found]}")


def data_folder(run_dir: Path, state: dict[str, Any]) -> Path:
    """The prepared folder a text run was trained on: stored relative to the run folder when inside it,
    so a run moved or renamed with its data still finds it; a clear error when it cannot be found."""
    if "data_dir" not in state:
        raise SettingError(f"{run_dir} was not trained by gptlab on text, so it has no train or val split: "
                           "evaluate it on a text with {data} FILE", data="data")
    folder = run_dir / state["data_dir"]  # an absolute path stays as it is
    if not (folder / "meta.json").is_file():
        raise SettingError(f"{run_dir} was trained on the prepared data in {folder}, which is not there: if "
                           "the run or its data was moved, point it at the data with {data} FOLDER (gptlab "
                           "train --resume --out RUN --data FOLDER, or gptlab eval RUN --data FOLDER)",
                           data="data")
    return folder


def portable(state: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`state` with its data folder stored relative to the run folder where it lies inside it."""
    if "data_dir" not in state:
        return state
    folder = Path(state["data_dir"]).resolve()
    inside = folder.is_relative_to(run_dir.resolve())
    return {**state, "data_dir": str(folder.relative_to(run_dir.resolve()) if inside else folder)}


# Names that moved to gptlab.inference.loading: they keep working for one release, with a warning.
_MOVED = {"load_run": "load", "load_for_inference": "load", "inference_model": "ready_model",
          "load_seq2seq": "load_seq2seq", "generation_defaults": "load"}


def __getattr__(name: str) -> Any:
    """A moved name, forwarded to its new home with a DeprecationWarning (PEP 562)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"gptlab.checkpoint.{name} goes in the next release: use gptlab.inference.loading."
                  f"{_MOVED[name]} (gptlab.load)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("gptlab.inference.deprecated"), name)
