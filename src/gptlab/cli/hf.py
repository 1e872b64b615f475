"""The export-hf / import-hf commands (runs to and from Hugging Face GPT-2 and Llama-family folders), and
export-gguf (a run as one GGUF file for llama.cpp)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptlab.cli.common import OutputFile, RunPath


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Write a run as a Hugging Face GPT-2, Llama or Qwen2 folder."""
    from gptlab.interop.huggingface import export_hf
    from gptlab.interop.peft import ADAPTER_CONFIG

    result = export_hf(args.run, args.out_dir, adapter_only=args.adapter_only)
    adapter = next(((result.out_dir / name).parent for name in result.files
                    if Path(name).name == ADAPTER_CONFIG), None)
    base = "HF_DIR" if adapter == result.out_dir else repr(str(result.out_dir))  # HF_DIR: exported apart
    loader = f"transformers.AutoModelForCausalLM.from_pretrained({base})"
    if adapter is not None:  # PEFT puts the adapter on the base model transformers loads
        loader = f"peft.PeftModel.from_pretrained({loader}, {str(adapter)!r})"
    report_conversion(result, f"load it with {loader}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    """Read a local Hugging Face GPT-2, Llama or Qwen2 folder into a gptlab run folder."""
    from gptlab.interop.huggingface import import_hf

    result = import_hf(args.hf_dir, args.out_dir)
    report_conversion(result, f"try it: gptlab sample {result.out_dir}")
    return 0


def cmd_export_gguf(args: argparse.Namespace) -> int:
    """Write a run as a GGUF file for llama.cpp, Ollama and LM Studio."""
    from gptlab.interop.gguf import export_gguf

    result = export_gguf(args.run, args.out, args.type)
    print(f"wrote {result.path}: llama.cpp architecture {result.arch}, {args.type}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"run it: llama-cli -m {result.path}")
    return 0


def report_conversion(result: Any, next_step: str) -> None:
    """What a conversion wrote, its notes, and what to do next."""
    print(f"wrote {result.out_dir}: {', '.join(result.files)}")
    for note in result.notes:
        print(f"note: {note}")
    print(next_step)


def add_hf_commands(sub: Any) -> None:
    """The export-hf / import-hf commands (Hugging Face GPT-2 and Llama-family folders) and export-gguf."""
    ex = sub.add_parser(
        "export-hf", help="write a run as a Hugging Face GPT-2, Llama or Qwen2 folder",
        description="Write a run's best checkpoint as OUT_DIR/config.json and model.safetensors, which "
        "transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads, plus tokenizer files for "
        "AutoTokenizer when the run used the bpe, gpt2 or an imported tokenizer. GPT-2-shaped models "
        "(learned positions, layernorm, gelu or gelu_exact, pre-norm, tied head; biases a model leaves out "
        "are written as zeros) export as GPT2LMHeadModel; "
        "Llama-shaped ones (rope, rmsnorm, swiglu, pre-norm, no biases, any n_kv_head, tied or not) as "
        "LlamaForCausalLM, or Qwen2ForCausalLM with --qkv-bias. A LoRA run (gptlab finetune --lora) writes "
        "its base model so, and its adapters as a PEFT adapter in OUT_DIR/adapter (adapter_config.json, "
        "adapter_model.safetensors), which peft.PeftModel.from_pretrained(base, OUT_DIR/adapter) puts on "
        "the base with the run's logits.",
    )
    ex.add_argument("run", type=RunPath(), help="run folder or checkpoint file")
    ex.add_argument("out_dir", help="new or empty folder to write")
    ex.add_argument("--adapter-only", action="store_true",
                    help="for a LoRA run: write only its PEFT adapter into OUT_DIR, for a base exported "
                    "apart (gptlab export-hf BASE_RUN)")
    ex.set_defaults(func=cmd_export_hf)

    im = sub.add_parser(
        "import-hf", help="read a local Hugging Face GPT-2, Llama or Qwen2 folder into a run folder",
        description="Read HF_DIR (config.json with model.safetensors, or its shards and "
        "model.safetensors.index.json, or pytorch_model.bin, and tokenizer.json, or for GPT-2 vocab.json + "
        "merges.txt) into a gptlab run folder that sample, eval and the other commands accept. model_type "
        "gpt2, llama (SmolLM2, TinyLlama) and qwen2 (Qwen2.5) are read; rope scaling other than 'default', "
        "sliding windows and experts are refused with every such field named. Every end-of-sequence id is "
        "kept, and generation_config.json's temperature, top_p, top_k and max_new_tokens become the run's "
        "sampling defaults. Shards are read one at a time. Nothing is downloaded.",
    )
    im.add_argument("hf_dir", type=RunPath(), help="folder written by save_pretrained")
    im.add_argument("out_dir", help="new or empty run folder to write")
    im.set_defaults(func=cmd_import_hf)

    gg = sub.add_parser(
        "export-gguf", help="write a run as a GGUF file for llama.cpp, Ollama and LM Studio",
        description="Write a run's best checkpoint as one GGUF file with its tokenizer (byte-level BPE, char "
        "or byte) and chat template in the metadata. GPT-2-shaped models (learned positions, layernorm, "
        "gelu, pre-norm, tied head) use llama.cpp's gpt2 graph, which computes the tanh gelu: a gelu_exact "
        "model is measured on its validation tokens and exported only when llama.cpp's gelu keeps the "
        "greedy token at every one but exact ties (the figures are printed). Llama-shaped ones (rope, "
        "rmsnorm, swiglu, pre-norm, no biases, any n_kv_head) use its llama graph, or qwen2 with --qkv-bias. "
        "What llama.cpp cannot compute as gptlab does (post-norm, sinusoidal positions, ...) is refused, "
        "every such setting at once, with the nearest setting that exports. f32 keeps every weight bit for "
        "bit; f16 and q8_0 keep norms and biases in f32.",
    )
    gg.add_argument("run", type=RunPath(), help="run folder or checkpoint file")
    gg.add_argument("--out", required=True, type=OutputFile(), help="the .gguf file to write")
    gg.add_argument("--type", default="f32", choices=("f32", "f16", "q8_0"),
                    help="weight type of the matrices (default f32: exact)")
    gg.set_defaults(func=cmd_export_gguf)
