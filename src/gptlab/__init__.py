"""gptlab: small Transformer language models, verified against handout #11, and encoder-decoders
assembled from the same parts.

    lm = gptlab.load("runs/demo")            # a run, or a Hugging Face folder
    lm.generate("ROMEO:", max_new_tokens=20)  # as `gptlab sample` prints it

The public names below are imported when first used, so `import gptlab` (and every `gptlab --help`)
does not wait for torch."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gptlab.config import ModelConfig, Seq2SeqConfig, parameter_count
    from gptlab.handout.learner.notebook import check
    from gptlab.inference.lm import LM
    from gptlab.inference.loading import load
    from gptlab.model import GPT
    from gptlab.seq2seq.model import EncoderDecoder

__all__ = ["GPT", "LM", "EncoderDecoder", "ModelConfig", "Seq2SeqConfig", "check", "load", "parameter_count"]
__version__ = "0.1.0"
# Each public name and the module that defines it.
_HOMES = {"GPT": "gptlab.model", "parameter_count": "gptlab.config", "EncoderDecoder": "gptlab.seq2seq.model",
          "ModelConfig": "gptlab.config", "Seq2SeqConfig": "gptlab.config",
          "load": "gptlab.inference.loading", "LM": "gptlab.inference.lm",
          "check": "gptlab.handout.learner.notebook"}  # gptlab.check(attention=..., model=...) in a notebook
# Public modules that moved: the old path imports the new module for one release, with a warning.
_MOVED_MODULES = {"gptlab.quantize": "gptlab.inference.quantize",
                  "gptlab.layouts": "gptlab.inference.layouts"}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module's old path and answers it with the module at its new one."""

    def find_spec(self, name: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in _MOVED_MODULES else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {_MOVED_MODULES[spec.name]}; the old path goes in the next "
                      "release", DeprecationWarning, stacklevel=2)
        return importlib.import_module(_MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is imported already."""


sys.meta_path.append(_MovedModule())


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
