"""Supervised fine-tuning (issue 25, point 1): train a run, or LoRA adapters on it, on JSONL examples.

`SFTData` is the training loop's data source (train.TrainingData) for examples from `sft.load_examples`:
a deterministic validation split, batches of whole examples padded on the right, targets -1 where nothing
is trained. The loop itself is train.Trainer, so progress, evaluation, best/last checkpoints, Ctrl-C and
--resume behave as in `gptlab train`.

What a fine-tuned run records in its checkpoint state, beside the training counters:
    "sft"            the data file (absolute), its SHA-256, and the options that shape the data
    "base"           the base run's checkpoint file
    "chat_template"  the template its examples were rendered with (so chat and serve render the same)
    "generation"     the base's sampling defaults, when it had any (an import's generation_config.json)
    "lora"           with --lora: the LoraConfig, the base file and its SHA-256, and "new_rows" when chat
                     markers were added (their ids, and how many old rows their start is the mean of); the
                     checkpoint then holds only the adapter tensors (and those rows), and
                     `Checkpoint.build_model` puts them on the base, refusing a base whose file has changed
                     since (checkpoint.ADAPTER)
`merge_run` folds the adapters into the weights and writes a normal run.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptlab.adapt.chat import add_chat_tokens, token_ids
from gptlab.adapt.options import SFTConfig
from gptlab.adapt.sft import Example, collate, load_examples, read_records
from gptlab.checkpoint import (
    ADAPTER,
    BEST,
    LAST,
    Checkpoint,
    architecture,
    has_checkpoint,
    load_checkpoint,
    load_header,
    model_tensors,
    require_architecture,
    resolve_checkpoint,
    save_checkpoint,
)
from gptlab.common import seed_everything
from gptlab.config import TrainConfig
from gptlab.files import file_sha256
from gptlab.lora import LoraConfig, add_lora, add_trainable_tokens, merge_lora, trainable_parameters
from gptlab.model import GPT
from gptlab.text.chat_template import ChatTemplate, missing_tokens, template_from_state
from gptlab.text.tokenizer import Tokenizer
from gptlab.training import distributed
from gptlab.training.loop import Trainer, TrainResult
from gptlab.training.presets import config_layers
from gptlab.training.resume import (
    change,
    check_resumable,
    extended,
    refuse_changes,
    resume_changes,
    with_intact_best,
)
from gptlab.training.runs import (
    check_settings,
    decide_for_machine,
    run_folder,
    saved_machine,
    write_run_config,
)

KEPT = ("base", "chat_template", "generation", ADAPTER)  # the state keys a run keeps (module docstring)
log = logging.getLogger("gptlab.adapt.finetune")


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file, so that a resumed run can tell its data was changed."""
    return file_sha256(Path(path))


MIN_VAL_EXAMPLES = 16  # validation examples from which a best checkpoint is chosen by its loss


def split_examples(examples: list[Example], val_fraction: float) -> tuple[list[Example], list[Example]]:
    """Train and validation examples: a fixed shuffle (the same for every run of the same file) holds out
    round(val_fraction * n) examples, at least one; each part keeps the file's order."""
    if len(examples) < 2:
        raise ValueError(f"{len(examples)} usable example(s): fine-tuning needs at least 2 (one is held "
                         "out for validation)")
    held = max(1, min(len(examples) - 1, round(val_fraction * len(examples))))
    val = set(random.Random(0).sample(range(len(examples)), held))
    kept = [e for i, e in enumerate(examples) if i not in val]
    return kept, [e for i, e in enumerate(examples) if i in val]


class SFTData:
    """Fine-tuning examples as the training loop's data source (train.TrainingData)."""

    metric_names = ("val_token_accuracy",)

    def __init__(self, config: SFTConfig, tokenizer: Tokenizer, template: ChatTemplate, block_size: int,
                 record: dict[str, Any]) -> None:
        """`record`: the run's state keys beyond the data (KEPT), saved with every checkpoint."""
        self.config, self.tokenizer, self.record = config, tokenizer, record
        self.digest = file_digest(config.data)
        loaded = load_examples(config.data, tokenizer, template, block_size, config.loss_on, config.too_long)
        self.summary = loaded.summary()
        train, val = split_examples(loaded.examples, config.val_fraction)
        self.splits = {"train": train, "val": val}
        # A loss over a few examples cannot tell checkpoints apart: below this, best is the last one.
        self.selects_best = len(val) >= MIN_VAL_EXAMPLES

    def check_window(self, block_size: int) -> None:
        """Nothing to check: `load_examples` already kept every example within block_size + 1 tokens."""

    def get_batch(self, split: str, batch_size: int, block_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (B, T) and targets (B, T) of `batch_size` examples drawn with replacement, T the longest."""
        pool = self.splits[split]
        picks = torch.randint(len(pool), (batch_size,), generator=generator)
        return collate([pool[i] for i in picks.tolist()])

    def state(self) -> dict[str, Any]:
        """The data options and the file's digest, with the run's record (module docstring)."""
        return {"sft": {**self.config.to_dict(), "sha256": self.digest}, **self.record}

    @torch.no_grad()
    def metrics(self, model: nn.Module, losses: dict[str, float], seed: int,
                device: torch.device) -> dict[str, float]:
        """The share of trained validation tokens the model predicts exactly (argmax), over every
        validation example: a figure that reaches 1 when the answers are learned."""
        right = total = 0
        val = self.splits["val"]
        for start in range(0, len(val), 16):
            inputs, targets = (t.to(device) for t in collate(val[start:start + 16]))  # (B, T) each
            logits, _ = model(inputs)  # (B, T, V)
            scored = targets != -1
            right += int((logits.argmax(-1) == targets)[scored].sum())
            total += int(scored.sum())
        return {"val_token_accuracy": right / total}

    def describe(self) -> str:
        """One line: the examples kept and why any were not, and the train/validation split."""
        held = len(self.splits["val"])
        best = "" if self.selects_best else (f" (too few to choose a best checkpoint, under "
                                              f"{MIN_VAL_EXAMPLES}: best is the last one; hold out more "
                                              "with --val-fraction)")
        return f"data: {self.summary}; {len(self.splits['train'])} train and {held} validation examples{best}"


def announce(data: SFTData, notes: list[str]) -> None:
    """Log the notes and the data summary before step 0 (the main process only), so that a user sees
    what was skipped, and the option that keeps it, before spending the training time."""
    if distributed.this_process().is_main:
        for note in notes:
            log.info(f"note: {note}")
        log.info(data.describe())


# ---------------------------------------------------------------------------------------------
# Starting and resuming a fine-tuning run


def base_checkpoint(base: str | Path) -> Checkpoint:
    """The base run's checkpoint (its best), refusing what cannot be fine-tuned here."""
    path = Path(base)
    if (path / "config.json").is_file() and not has_checkpoint(path) and (path / "tokenizer.json").is_file():
        raise ValueError(f"{base} is a Hugging Face folder: import it first (gptlab import-hf {base} RUN), "
                         "then fine-tune RUN")
    start = load_checkpoint(path)
    require_architecture(architecture(start.model_config), base, "decoder")
    if ADAPTER in start.state:
        raise ValueError(f"{base} holds LoRA adapters (a finetune --lora run): merge them first "
                         f"(gptlab merge {base} --out MERGED), then fine-tune MERGED")
    return start


def prepare_model(start: Checkpoint, data_path: str | Path, lora: LoraConfig | None,
                  seed: int) -> tuple[GPT, Tokenizer, ChatTemplate, list[str], dict[str, Any] | None]:
    """The base model ready to fine-tune (chat markers added when the data needs them, adapters on with
    `lora`), its tokenizer, the chat template, notes for the user, and the markers' new rows when they
    train under LoRA ({"ids", "mean_of"}, as `checkpoint.adapted_model` rebuilds them; else None)."""
    model, tokenizer = start.build_gpt(), start.load_tokenizer()
    template, mean_of = template_from_state(start.state), tokenizer.vocab_size
    notes: list[str] = []
    shape, _ = read_records(data_path)
    missing = missing_tokens(tokenizer, template) if shape == "messages" else []
    if missing:
        model, tokenizer = add_chat_tokens(model, tokenizer, template)
        notes.append(f"added {', '.join(missing)} to the tokenizer as new ids, their embedding rows the "
                     "mean of the others")
    if lora is None:
        return model, tokenizer, template, notes, None
    seed_everything(seed)  # the adapters' A matrices are drawn from this seed
    add_lora(model, lora)
    new_rows: dict[str, Any] | None = None
    if missing:  # the markers' rows train too; every other row of the embedding stays frozen
        new_rows = {"ids": token_ids(tokenizer, missing), "mean_of": mean_of}
        add_trainable_tokens(model, new_rows["ids"])
    rows = f" and the {len(missing)} new tokens' rows" if missing else ""
    notes.append(f"LoRA r={lora.r}{rows}: {trainable_parameters(model):,} of "
                 f"{sum(p.numel() for p in model.parameters()):,} parameters train")
    return model, tokenizer, template, notes, new_rows


def finetune(base: str | Path, out: str | Path, config: SFTConfig, train_config: TrainConfig,
             lora: LoraConfig | None = None, stop_at: int | None = None,
             progress: bool = True) -> tuple[TrainResult, SFTData, list[str]]:
    """Fine-tune the run `base` on `config.data` into the new run `out` (with LoRA adapters if `lora`):
    the result, the data source and the notes for the user (both logged before step 0)."""
    out, start = Path(out), base_checkpoint(base)
    config = config.replace(data=str(Path(config.data).resolve()))
    model, tokenizer, template, notes, new_rows = prepare_model(start, config.data, lora, train_config.seed)
    base_file = str(resolve_checkpoint(base).resolve())
    record = {"base": base_file, "chat_template": template.to_dict(),
              **{key: start.state[key] for key in ("generation",) if key in start.state}}
    if lora is not None:
        record[ADAPTER] = {"base": base_file, "base_sha256": file_sha256(Path(base_file)),
                           "config": lora.to_dict(), **({"new_rows": new_rows} if new_rows else {})}
    data = SFTData(config, tokenizer, template, model.config.block_size, record)
    with run_folder(out, new=True), distributed.session(train_config.device) as (dist, device):
        announce(data, notes)
        train_config, machine_record = decide_for_machine(model.config, train_config, dist, device)
        if dist.is_main:
            write_run_config(out, model.config, train_config, data, machine_record)
        check_settings(model.config, train_config, dist.world_size)
        trainer = Trainer(out, data, model.config, train_config, dist, device, progress=progress,
                          model=model, patience=config.patience)
        return trainer.run(stop_at), data, notes


def resume_finetune(base: str | Path, out: str | Path, config: SFTConfig, train_overrides: dict[str, Any],
                    lora: LoraConfig | None = None, stop_at: int | None = None,
                    progress: bool = True) -> tuple[TrainResult, SFTData, list[str]]:
    """Continue the fine-tuning run `out` exactly; the arguments must repeat those that started it (only
    train.RESUMABLE fields may change), and its data file must be unchanged."""
    out = Path(out)
    with run_folder(out, new=False):
        try:
            checkpoint = load_checkpoint(out, prefer=LAST)
        except ValueError as err:
            raise with_intact_best(out, err) from None
        check_resumable(checkpoint, out)
        state = checkpoint.state
        if "sft" not in state:
            raise ValueError(f"{out} is not a fine-tuning run: continue it with gptlab train --resume")
        saved = SFTConfig.from_dict({k: v for k, v in state["sft"].items() if k != "sha256"})
        config = config.replace(data=str(Path(config.data).resolve()))
        refused = [change(f"SFTConfig.{name}", name, old, getattr(config, name))
                   for name, old in saved.to_dict().items() if getattr(config, name) != old]
        if str(resolve_checkpoint(base).resolve()) != state["base"]:
            refused.append(change("base", "base", state["base"], base))
        saved_lora = state[ADAPTER]["config"] if ADAPTER in state else None
        if (lora.to_dict() if lora else None) != saved_lora:
            refused.append(change("lora", "lora", saved_lora, lora.to_dict() if lora else None))
        changes, train_refused = resume_changes(checkpoint, config_layers(train_overrides=train_overrides))
        refuse_changes(refused + train_refused)
        if file_digest(saved.data) != state["sft"]["sha256"]:
            raise ValueError(f"{saved.data} has changed since the run started (its SHA-256 differs): put "
                             "back the file it was trained on, or start a new run")
        train_config = extended(checkpoint, changes)
        record = {key: state[key] for key in KEPT if key in state}
        data = SFTData(saved, checkpoint.load_tokenizer(), template_from_state(state),
                       checkpoint.model_config.block_size, record)
        model = checkpoint.build_gpt() if ADAPTER in state else None  # the base with the saved adapters
        announce(data, [])
        with distributed.session(train_config.device) as (dist, device):
            if train_config != checkpoint.train_config and dist.is_main:
                write_run_config(out, checkpoint.model_config, train_config, data, saved_machine(out))
            check_settings(checkpoint.model_config, train_config, dist.world_size)
            trainer = Trainer(out, data, checkpoint.model_config, train_config, dist, device, checkpoint,
                              progress, model=model, patience=saved.patience)
            return trainer.run(stop_at), data, []


def merged_from(folder: Path) -> str | None:
    """The adapter checkpoint a merge in `folder` was made from (its resolved path), or None."""
    try:
        return load_header(folder, BEST).state.get("merged_from")
    except (OSError, ValueError):
        return None


def merge_run(run: str | Path, out: str | Path) -> Path:
    """Fold an adapter run's LoRA adapters into its base's weights and write them as the new run `out`
    (best.safetensors, with the run's tokenizer, chat template and sampling defaults); its path."""
    checkpoint, out = load_checkpoint(run), Path(out)
    if ADAPTER not in checkpoint.state:
        raise ValueError(f"{run} holds no LoRA adapters (it is not a gptlab finetune --lora run): there is "
                         "nothing to merge")
    model = merge_lora(checkpoint.build_gpt())
    source = str(resolve_checkpoint(run).resolve())
    state: dict[str, Any] = {key: checkpoint.state[key] for key in ("chat_template", "generation")
                             if key in checkpoint.state} | {"merged_from": source}
    with run_folder(out, new=True, redoes=lambda folder: merged_from(folder) == source):
        save_checkpoint(out / BEST, Checkpoint(model.config, checkpoint.tokenizer, model_tensors(model),
                                               state=state))
    return out
