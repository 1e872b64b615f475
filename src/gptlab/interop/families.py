"""Which Hugging Face family a gptlab config exports as (`export_family`), and what an export or import
wrote (`Conversion`): shared by the folder exports (`huggingface`) and the adapter export (`peft`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gptlab.config import ModelConfig
from gptlab.interop.gpt2 import gpt2_problems
from gptlab.interop.llama import family_of, llama_problems


@dataclass(frozen=True)
class Conversion:
    """What export_hf or import_hf wrote, and anything the user should know about it."""

    out_dir: Path
    files: list[str]
    notes: list[str] = field(default_factory=list)


def export_family(config: ModelConfig) -> str:
    """`gpt2`, `llama` or `qwen2`: the Hugging Face family this config is; one ValueError lists, for GPT-2
    and for the Llama family, every field that does not fit."""
    gpt2, llama = gpt2_problems(config), llama_problems(config)
    if not gpt2:
        return "gpt2"
    if not llama:
        return family_of(config)
    raise ValueError(f"this model is neither a GPT-2 ({'; '.join(gpt2)}) nor a Llama ({'; '.join(llama)})")
