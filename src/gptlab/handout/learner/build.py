"""Building a learner's classes at the sizes a check needs, whatever their constructor looks like.

Learners write MultiHeadAttention(d_model, n_heads), MultiHeadAttention(num_heads, head_size),
Block(config), GPT(GPTConfig(...)) or GPT(vocab_size=..., ...). `build` reads the constructor's
parameter names (and a config class's fields) and gives each the size it names: `ROLES` lists the
spellings it knows. A config class is the parameter's annotation or a class in the learner's module
whose name ends in Config, Args or Params; failing that, an object carrying every known spelling.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from torch import nn

from gptlab.handout.learner.calling import LearnerError, describe

ROLES: dict[str, tuple[str, ...]] = {  # a size -> the parameter names (lower case) that take it
    "width": ("n_embd", "n_embed", "d_model", "dim", "embed_dim", "emb_dim", "embedding_dim", "hidden_size",
              "hidden_dim", "d_embed", "model_dim", "width", "d", "c", "n_embedding", "embed_size"),
    "heads": ("n_head", "n_heads", "num_heads", "nhead", "nheads", "heads", "h", "num_attention_heads",
              "head_count", "n_attn_heads"),
    "head_size": ("head_size", "d_head", "head_dim", "d_k", "dk", "hs", "dim_head", "d_h", "head_width"),
    "block": ("block_size", "context_length", "context_size", "context_len", "max_len", "max_seq_len",
              "seq_len", "n_ctx", "n_positions", "max_position_embeddings", "t", "ctx_len", "max_length",
              "max_seq_length", "context", "t_max", "seq_length"),
    "vocab": ("vocab_size", "n_vocab", "vocab", "num_tokens", "v", "vocabulary_size", "n_tokens"),
    "layers": ("n_layer", "n_layers", "num_layers", "depth", "l", "layers", "n_blocks", "num_blocks"),
    "dropout": ("dropout", "p_drop", "dropout_rate", "attn_pdrop", "resid_pdrop", "embd_pdrop", "drop",
                "p_dropout", "attn_dropout", "resid_dropout", "dropout_p"),
}
CONFIG_NAMES = {"config", "cfg", "conf", "args", "params", "hparams", "settings", "model_config"}
CONFIG_SUFFIXES = ("Config", "Args", "Params", "Hparams", "Settings")


class BuildError(LearnerError):
    """The class could not be built at the check's sizes: a check that needs it is skipped, not failed."""


def sizes(width: int, heads: int, vocab: int = 11, block: int = 16, layers: int = 2) -> dict[str, Any]:
    """Every size a constructor may ask for, from the model width and head count; no dropout."""
    return {"width": width, "heads": heads, "head_size": width // heads, "block": block, "vocab": vocab,
            "layers": layers, "dropout": 0.0}


def role(name: str) -> str | None:
    """The size a parameter called `name` takes, or None."""
    return next((size for size, names in ROLES.items() if name.lower() in names), None)


def build(cls: type, label: str, size: dict[str, Any], namespace: dict[str, Any]) -> nn.Module:
    """An instance of the learner's class `cls` at these sizes, in eval mode, or a BuildError saying why."""
    problems = []
    for attempt in (_by_names, _positional, _no_arguments):
        try:
            args, kwargs = attempt(cls, size, namespace)
        except ValueError as why:
            problems.append(str(why))
            continue
        try:
            made = cls(*args, **kwargs)
        except Exception as error:  # the learner's constructor may raise anything
            problems.append(f"{label}({_show(args, kwargs)}) raised {describe(error)}")
            continue
        if isinstance(made, nn.Module):
            return made.eval()
        problems.append(f"{label}({_show(args, kwargs)}) is a {type(made).__name__}, not an nn.Module")
    raise BuildError(f"cannot build {label} at D={size['width']}, H={size['heads']}: " + "; ".join(problems))


def _show(args: tuple, kwargs: dict[str, Any]) -> str:
    """Constructor arguments as they would be written."""
    return ", ".join([type(a).__name__ + "(...)" if hasattr(a, "__dict__") else repr(a) for a in args]
                     + [f"{k}={type(v).__name__}(...)" if hasattr(v, "__dict__") else f"{k}={v!r}"
                        for k, v in kwargs.items()])


def _parameters(cls: type) -> list[inspect.Parameter]:
    """The named parameters of a class's constructor (no self, *args or **kwargs)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{cls.__name__} has no readable signature") from error
    return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _by_names(cls: type, size: dict[str, Any], namespace: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Each parameter gets the size its name says, or a config built the same way; defaults stay."""
    kwargs: dict[str, Any] = {}
    for param in _parameters(cls):
        if named := role(param.name):
            kwargs[param.name] = size[named]
        elif param.name.lower() in CONFIG_NAMES or _config_class(param, namespace):
            kwargs[param.name] = config(_config_class(param, namespace), size, namespace)
        elif param.default is param.empty:
            raise ValueError(f"{cls.__name__}'s parameter {param.name!r} is not one of the sizes I know")
    return (), kwargs


def _positional(cls: type, size: dict[str, Any], namespace: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """(D, H), the common shape of a module's constructor."""
    required = [p for p in _parameters(cls) if p.default is p.empty]
    if len(required) != 2:
        raise ValueError(f"{cls.__name__} does not take (D, H)")
    return (size["width"], size["heads"]), {}


def _no_arguments(cls: type, size: dict[str, Any], namespace: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """No arguments: sizes from the learner's own globals."""
    if any(p.default is p.empty for p in _parameters(cls)):
        raise ValueError(f"{cls.__name__} needs arguments")
    return (), {}


def _config_class(param: inspect.Parameter, namespace: dict[str, Any]) -> type | None:
    """The class a config parameter is annotated with, if it is one of the learner's classes."""
    annotation = param.annotation
    if isinstance(annotation, str):
        annotation = namespace.get(annotation)
    is_config = isinstance(annotation, type) and annotation.__name__.endswith(CONFIG_SUFFIXES)
    return annotation if is_config else None


def config(cls: type | None, size: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """A config at these sizes: `cls`, else the learner's one config class, else one with every spelling."""
    if cls is None:
        module = namespace.get("__name__")
        found = [c for name, c in namespace.items() if isinstance(c, type) and name.endswith(CONFIG_SUFFIXES)
                 and getattr(c, "__module__", None) == module]
        cls = found[0] if len(found) == 1 else None
    if cls is not None:
        try:
            args, kwargs = _by_names(cls, size, namespace)
            return cls(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a config we cannot fill: fall back to every spelling
            pass
    every = {name: size[key] for key, names in ROLES.items() for name in names}
    return types.SimpleNamespace(**every, bias=True)


def find_class(namespace: dict[str, Any], name: str) -> type | None:
    """The nn.Module subclass `name` in the learner's namespace, or None."""
    found = namespace.get(name)
    return found if isinstance(found, type) and issubclass(found, nn.Module) else None
