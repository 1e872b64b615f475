"""Using a trained model: `gptlab.load(path) -> LM`, the one way every command and notebook loads a run or a
Hugging Face folder, read once and made ready to run (adapters, device, layout, dtype, int8).
"""
