"""Checkpoints: one safetensors file holding everything a run needs, written atomically.

A checkpoint file holds tensors under three prefixes (`model.NAME`, `optim.PARAM/SLOT`, `rng.NAME`)
and JSON in the safetensors header: the model and train configs, the tokenizer, and the training
state (step, best validation loss, ...). Nothing needs pickle to load. Weights and optimiser slots
are full tensors keyed by parameter name, so the file is the same whatever the world size. A run folder holds
`last.safetensors` (for --resume) and `best.safetensors` (lowest validation loss, for sampling).

Writes go to a temporary file that is fsynced and then renamed over the old one, so a crash or kill
at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from gptlab.common import decoding_layout
from gptlab.config import ModelConfig, Seq2SeqConfig, TaskConfig, TrainConfig
from gptlab.encoder_decoder import EncoderDecoder
from gptlab.files import atomic_write
from gptlab.model import GPT
from gptlab.tokenizer import DamagedTokenizerError, Tokenizer, tokenizer_from_dict

FORMAT = "gptlab-checkpoint-1"
# The state key of an adapter run (`gptlab finetune --lora`): {"base": its base run's checkpoint file,
# "config": the LoraConfig}. Such a checkpoint holds only the adapter tensors.
ADAPTER = "lora"
LAST, BEST = "last.safetensors", "best.safetensors"
# The architectures a checkpoint may hold: its config class and model class, by the name it is saved under.
ARCHITECTURES: dict[str, tuple[type[ModelConfig], type[nn.Module]]] = {
    "decoder": (ModelConfig, GPT),
    "encoder-decoder": (Seq2SeqConfig, EncoderDecoder),
}


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
    source: str = "the checkpoint"  # the file it was read from, for error messages

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
    """The base run's model (`checkpoint.state[ADAPTER]["base"]`) with the checkpoint's LoRA adapters."""
    # gptlab.adapt builds on this module (lora -> convert -> checkpoint): imported when used, not above.
    from gptlab.adapt.lora import LoraConfig, add_lora, load_lora_state

    saved = checkpoint.state[ADAPTER]
    base_file = Path(saved["base"])
    if not base_file.is_file():
        raise ValueError(f"{checkpoint.source} holds LoRA adapters for the base model {base_file}, which is "
                         "not there: put the base run back, or merge the adapters (gptlab merge) while it is")
    base = load_checkpoint(base_file)
    if base.model_config != checkpoint.model_config or ADAPTER in base.state:
        raise ValueError(f"{base_file} is not the base model {checkpoint.source} was trained on (another "
                         "shape or vocabulary): fine-tune again from the base you have")
    model = add_lora(base.build_model(), LoraConfig.from_dict(saved["config"]))
    load_lora_state(model, checkpoint.model_state)
    return model


def model_tensors(model: GPT | EncoderDecoder) -> dict[str, torch.Tensor]:
    """The model's state without the duplicate name of a tied head (safetensors stores no aliases)."""
    state = model.state_dict()
    if model.config.tied:
        state.pop("lm_head.weight")
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> None:
    """Write `checkpoint` to `path` atomically (temporary file, fsync, rename)."""
    tensors = {f"model.{name}": t for name, t in checkpoint.model_state.items()}
    for param, slots in (checkpoint.optimizer_state or {}).items():
        tensors.update({f"optim.{param}/{slot}": t.contiguous() for slot, t in slots.items()})
    tensors.update({f"rng.{name}": t.contiguous() for name, t in checkpoint.rng.items()})
    metadata = {
        "format": FORMAT,
        "architecture": architecture(checkpoint.model_config),
        "model_config": json.dumps(checkpoint.model_config.to_dict()),
        "train_config": json.dumps(checkpoint.train_config.to_dict() if checkpoint.train_config else None),
        "tokenizer": json.dumps(checkpoint.tokenizer),
        "state": json.dumps(checkpoint.state),
        "has_optimizer": json.dumps(checkpoint.optimizer_state is not None),
    }
    try:
        atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    except (OSError, SafetensorError) as err:  # a full disk, a file-size limit, a folder that went away
        reason = getattr(err, "strerror", None) or str(err).removeprefix("Error while serializing: ")
        raise OSError(f"could not write {path} ({reason}); the previous {Path(path).name}, "
                      "if any, is untouched: free some space, then continue the run with --resume") from err


def resolve_checkpoint(path: str | Path, prefer: str = BEST) -> Path:
    """A checkpoint file from a file path or a run folder (its `prefer` file, else the other one)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"no run folder or checkpoint at {path}")
    for name in (prefer, LAST, BEST):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"{path} holds no checkpoint ({LAST} or {BEST}): train a model into it first")


def checkpoint_architecture(path: str | Path, prefer: str = BEST) -> str:
    """The architecture a run folder or checkpoint file holds, read from its header alone."""
    file = resolve_checkpoint(path, prefer)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            return (reader.metadata() or {}).get("architecture", "decoder")
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{file} is not a readable gptlab checkpoint ({err})") from err


def load_checkpoint(path: str | Path, prefer: str = BEST) -> Checkpoint:
    """Read a checkpoint file (or a run folder's `prefer` checkpoint) onto the CPU."""
    return _read(path, prefer, tensors=True)


def load_header(path: str | Path, prefer: str = BEST) -> Checkpoint:
    """A checkpoint's configs, tokenizer and state from its JSON header alone: no tensor is read, so
    `model_state`, `optimizer_state` and `rng` are empty."""
    return _read(path, prefer, tensors=False)


def generation_defaults(run_path: str | Path) -> dict[str, Any]:
    """The sampling settings a run asks for when the user gives none (an imported model's
    generation_config.json): keys among temperature, top_p, top_k, max_new_tokens; empty for most runs."""
    return dict(load_header(run_path).state.get("generation", {}))


def _read(path: str | Path, prefer: str, tensors: bool) -> Checkpoint:
    file = resolve_checkpoint(path, prefer)
    groups: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}, "rng": {}}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            metadata = reader.metadata() or {}
            for key in reader.keys() if tensors else ():
                prefix, _, rest = key.partition(".")
                groups.setdefault(prefix, {})[rest] = reader.get_tensor(key)
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{file} is not a readable gptlab checkpoint ({err})") from err
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{file} is not a gptlab checkpoint (format {metadata.get('format')!r})")
    name = metadata.get("architecture", "decoder")  # files from before encoder-decoders name none
    if name not in ARCHITECTURES:
        raise ValueError(f"{file} holds a {name!r} model, which this version of gptlab cannot build")
    try:
        return parse_checkpoint(metadata, groups, ARCHITECTURES[name][0], str(file))
    except (KeyError, TypeError, ValueError) as err:  # a header that was edited or damaged
        raise ValueError(f"{file} has a damaged header ({str(err).splitlines()[0]}): use another checkpoint "
                         "of the run") from None


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
    return Checkpoint(
        model_config=config_class.from_dict(json.loads(metadata["model_config"])),
        tokenizer=json.loads(metadata["tokenizer"]),
        model_state=groups["model"],
        train_config=TrainConfig.from_dict(train_config) if train_config else None,
        state=json.loads(metadata["state"]),
        optimizer_state=optimizer,
        rng=groups["rng"],
        source=source,
    )


HOLDS = {"decoder": "a decoder-only language model: use the language-model commands (train, sample, ...)",
         "encoder-decoder": "an encoder-decoder (seq2seq) model: use the `gptlab seq2seq` commands"}


def check_tensors(model_state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size]) -> None:
    """A ValueError unless `model_state` holds exactly the tensors of `shapes`, each of its shape."""
    if set(model_state) != set(shapes):
        missing, unused = sorted(set(shapes) - set(model_state)), sorted(set(model_state) - set(shapes))
        raise ValueError(f"checkpoint tensors do not fit its config: missing {missing}, unused {unused}")
    for name, shape in shapes.items():
        if model_state[name].shape != shape:
            found = tuple(model_state[name].shape)
            raise ValueError(f"{name} has shape {found}, its config says {tuple(shape)}")


def gather_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], sources: Mapping[str, tuple[str, ...]],
    build: Callable[[str, list[torch.Tensor]], torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Build each target of `sources` (target -> the source names it is made of) with `build(target,
    parts)` as soon as all its parts have been read, so that weights streamed tensor by tensor, shard by
    shard, are never all held twice. Returns the targets, the source tensors no target names (the caller
    decides which of them may be left over) and the names that never came."""
    target_of = {name: target for target, names in sources.items() for name in names}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # target -> the parts read so far
    built: dict[str, torch.Tensor] = {}
    others: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        target = target_of.get(name)
        if target is None:
            others[name] = tensor
            continue
        if target in built or name in parts.get(target, {}):
            raise ValueError(f"the weights hold {name} twice")
        got = parts.setdefault(target, {})
        got[name] = tensor
        if len(got) == len(sources[target]):
            del parts[target]  # the parts now belong to `build` alone
            built[target] = build(target, [got[n] for n in sources[target]])
    missing = sorted(n for target, names in sources.items() if target not in built for n in names
                     if n not in parts.get(target, {}))
    return built, others, missing


def require_architecture(found: str, path: str | Path, expect: str) -> None:
    """A ValueError saying which commands to use when `path` holds another architecture than `expect`."""
    if found != expect:
        raise ValueError(f"{path} holds {HOLDS[found]}")


def load_run(
    path: str | Path, device: torch.device | str = "cpu", prefer: str = BEST, expect: str = "decoder",
    dtype: torch.dtype = torch.float32,
) -> tuple[GPT | EncoderDecoder, Tokenizer]:
    """The model (in eval mode, on `device`, its weights in `dtype`) and tokenizer of a run folder or
    checkpoint file.

    `expect` names the architecture the caller can use; another one is a ValueError saying what to run.
    """
    checkpoint = load_checkpoint(path, prefer)
    return inference_model(checkpoint, path, device, expect, dtype), checkpoint.load_tokenizer()


def inference_model(checkpoint: Checkpoint, path: str | Path, device: torch.device | str = "cpu",
                    expect: str = "decoder", dtype: torch.dtype = torch.float32) -> GPT | EncoderDecoder:
    """The checkpoint's model in eval mode on `device` (in the decoding layout on the CPU).

    bfloat16 weights halve the memory a step reads; the logits then differ from float32 a little
    (`gptlab verify RUN --dtype bfloat16` measures how much).
    """
    require_architecture(architecture(checkpoint.model_config), path, expect)
    model = checkpoint.build_model().to(device=device, dtype=dtype).eval()
    if next(model.parameters()).device.type == "cpu":  # faster batch-1 decoding, the same logits
        decoding_layout(model)
    return model


def load_seq2seq(path: str | Path, device: torch.device | str = "cpu",
                 ) -> tuple[EncoderDecoder, Tokenizer, TaskConfig]:
    """The encoder-decoder (eval mode, on `device`), its vocabulary and its task, from a seq2seq run."""
    checkpoint = load_checkpoint(path)
    model = inference_model(checkpoint, path, device, expect="encoder-decoder")
    return model, checkpoint.load_tokenizer(), TaskConfig.from_dict(checkpoint.state["task"])


def data_folder(run_dir: Path, state: dict[str, Any]) -> Path:
    """The prepared folder a text run was trained on: stored relative to the run folder when inside it,
    so a run moved or renamed with its data still finds it; a clear error when it cannot be found."""
    if "data_dir" not in state:
        raise ValueError(f"{run_dir} was not trained by gptlab on text, so it has no train or val split: "
                         "evaluate it on a text with --data FILE")
    folder = run_dir / state["data_dir"]  # an absolute path stays as it is
    if not (folder / "meta.json").is_file():
        raise ValueError(f"{run_dir} was trained on the prepared data in {folder}, which is not there: if "
                         "the run or its data was moved, point it at the data with --data FOLDER (gptlab "
                         "train --resume --out RUN --data FOLDER, or gptlab eval RUN --data FOLDER)")
    return folder


def portable(state: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`state` with its data folder stored relative to the run folder where it lies inside it."""
    if "data_dir" not in state:
        return state
    folder = Path(state["data_dir"]).resolve()
    inside = folder.is_relative_to(run_dir.resolve())
    return {**state, "data_dir": str(folder.relative_to(run_dir.resolve()) if inside else folder)}
