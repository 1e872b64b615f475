"""The options of a fine-tuning run: which examples it sees (`SFTConfig`) and the training settings it
takes where the user gives none. Apart from the training code, and free of torch, so that the finetune
command's parser (and its `--help`) is built without it."""

from __future__ import annotations

from dataclasses import dataclass

from gptlab.config import Config, check_choice, option

LOSS_ON = ("completion", "all")
TOO_LONG = ("skip", "truncate")
# Training settings of a fine-tuning run where the user gives none: shorter and gentler than pre-training.
DEFAULTS = dict(batch_size=8, max_steps=300, lr=3e-4, warmup_steps=20, eval_interval=50, eval_batches=4)
LORA_LR = 1e-3  # adapters start at zero and are few: they take a larger step than full fine-tuning


@dataclass
class SFTConfig(Config):
    """The options that decide which examples a fine-tuning run sees; --resume must repeat them."""

    data: str = option("", "the JSONL file of examples")
    loss_on: str = option("completion", "completion: train completions and assistant turns only; all: "
                          "every token", LOSS_ON)
    too_long: str = option("skip", "an example longer than the context is skipped or cut to fit", TOO_LONG)
    val_fraction: float = option(0.1, "share of the examples held out for validation (at least one)")
    patience: int = option(0, "stop after this many evaluations without a better validation loss (0: off)")

    def validate(self) -> None:
        owner = "SFTConfig"
        check_choice(owner, "loss_on", self.loss_on, LOSS_ON)
        check_choice(owner, "too_long", self.too_long, TOO_LONG)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"{owner}.val_fraction={self.val_fraction} must be between 0 and 1")
        if self.patience < 0:
            raise ValueError(f"{owner}.patience={self.patience} must not be negative")
