"""Exchanges with other tools: files and models that other programs run or read.

- `huggingface`: runs <-> Hugging Face folders (export_hf, import_hf) and `transformers` models in memory.
- `gpt2`, `llama`: the config and tensor-name maps of GPT-2 and of the Llama family (Llama, Qwen2).
- `hf_tokenizer`: gptlab tokenizers <-> tokenizer.json, vocab.json and merges.txt.
- `hf_folder`: reading a save_pretrained folder: weight shards, generation settings, chat template.
- `shapes`: the tensors a gptlab model stores, the target every name map is checked against.
- `gguf`: GGUF files for llama.cpp, and back.
"""
