"""The tensors a gptlab GPT stores, by name and shape: what every conversion's name map is checked
against (each target filled, each shape asserted), for Hugging Face folders and GGUF files alike, and
the two checks every name map runs: `check_tensors` and `gather_tensors`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from gptlab.config import ModelConfig
from gptlab.model import GPT

HEAD = "lm_head.weight"  # the output head; a tied model stores it once, as the token embedding


def expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Shapes of the gptlab tensors a model of this config stores (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    state = model.state_dict()
    if config.tied:
        state.pop(HEAD)  # the embedding holds it
    return {name: tensor.shape for name, tensor in state.items()}


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
