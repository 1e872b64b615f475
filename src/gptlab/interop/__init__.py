"""Exchanges with other tools: files that other programs run or read (GGUF for llama.cpp, in `gguf`)."""
