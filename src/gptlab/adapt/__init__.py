"""Adapting a trained model: chat templates (`chat`), fine-tuning examples with loss masks (`sft`), LoRA.

Builds on `model`, `tokenizer` and `train`; `serve` and `cli` import it, never the other way round.
"""
