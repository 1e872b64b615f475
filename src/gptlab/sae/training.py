"""`train_sae`: a TopK SAE trained on a run's activations at one hook point, in a folder that the same call
continues or leaves alone.

Activations are streamed, never stored: random windows of the training ids go through the model, the
site's vectors of BUFFER_BATCHES batches are shuffled together (so that one batch mixes many windows),
and the SAE takes its steps on them. The folder holds, besides the SAELens files (`sae_export`):

- `sae.json`: the SAEConfig, the checkpoint (path and SHA-256) and data the activations came from, the
  tokens trained so far and, once training is done, the held-out figures (`sae_metrics`);
- `training.safetensors`: what continuing needs (weights, Adam's moments, the window generator's state,
  the dead-feature counts), saved between buffers, at least every SAVE_SECONDS and at the end;
- `features.html`: each feature's top-activating contexts (`sae_page`), written when training ends.

The same call again continues an interrupted run from its last save (giving the weights an uninterrupted
run would have) or, when it is done, trains nothing and returns the saved figures; a larger
`tokens` trains on from there. A folder holding an SAE of other settings, another model or other data is
refused in one line naming each difference, and is left as it was.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from gptlab.config import SettingError
from gptlab.files import RunLock, atomic_write, atomic_write_text, file_sha256, remove_stale_temporaries
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.sae.config import SAEConfig
from gptlab.sae.data import (
    SAEText,
    check_length,
    check_site,
    held_out_windows,
    random_windows,
    sae_text,
    site_activations,
)
from gptlab.sae.export import TENSORS, Provenance, write_saelens
from gptlab.sae.metrics import SAEMetrics, evaluate_sae
from gptlab.sae.model import SAETrainer, SparseAutoencoder
from gptlab.sae.page import write_feature_page
from gptlab.text.tokenizer import Tokenizer

FORMAT = "gptlab-sae-1"
STATE, TRAINING, PAGE = "sae.json", "training.safetensors", "features.html"
BUFFER_BATCHES = 8  # batches of activations read, shuffled and trained on together
SAVE_SECONDS = 60.0  # the longest time between saves (a save happens only between buffers)


@dataclass(frozen=True)
class SAERun:
    """A trained SAE's folder and figures, and what this call did."""

    folder: Path
    config: SAEConfig  # as trained, its width filled in
    tokens: int  # tokens trained on in all
    metrics: SAEMetrics  # on the held-out windows
    trained_now: int  # tokens this call trained on (0: there was nothing left to do)
    seconds: float  # time this call spent training


@dataclass(frozen=True)
class Session:
    """What a training call works with: the model, its tokenizer, the ids, and where they came from."""

    model: GPT
    tokenizer: Tokenizer
    text: SAEText
    origin: dict[str, str]  # checkpoint, checkpoint_sha256, data: what sae.json records and compares
    provenance: Provenance


def open_session(run: str | Path, config: SAEConfig, data: str | None,
                 device: str) -> tuple[Session, SAEConfig]:
    """Load the run's model and data for an SAE at `config.site`; the config with its width filled in."""
    lm = load(run, device=device)
    model, tokenizer, checkpoint = lm.model, lm.tokenizer, lm.header
    assert checkpoint is not None, "a loaded run has its header"
    check_site(model, config.site)
    source = Path(checkpoint.source)
    text = sae_text(source.parent, checkpoint.state, tokenizer, data)
    check_length(text, model.config.block_size)
    origin = {"checkpoint": str(source.resolve()), "checkpoint_sha256": file_sha256(source),
              "data": text.name}
    provenance = Provenance(config.site, source.resolve().parent.name, model.config.block_size, text.name)
    return Session(model, tokenizer, text, origin, provenance), config.resolved(model.config.n_embd)


def train_sae(run: str | Path, config: SAEConfig, out: str | Path, data: str | None = None,
              device: str = "cpu", progress: bool = False) -> SAERun:
    """Train (or continue, or find done) the SAE `config` describes on `run`'s activations in folder `out`;
    `data` (default: the run's own) as `sae_data.sae_text` reads it; `progress` draws a bar of the tokens."""
    session, config = open_session(run, config, data, device)
    out = Path(out)
    created = not out.exists()
    with RunLock(out) as lock:
        try:
            saved = read_saved(out, config, session.origin)
            remove_stale_temporaries(out)
            return train_in_folder(session, config, out, saved, progress)
        except BaseException:
            lock.restore()
            if created and not (out / TRAINING).exists():  # nothing saved: leave no folder behind
                shutil.rmtree(out, ignore_errors=True)
            raise


def read_saved(out: Path, config: SAEConfig, origin: dict[str, str]) -> dict[str, Any] | None:
    """The saved sae.json of an SAE in `out` that `config` and `origin` may continue; None for a new or
    empty folder; a SettingError naming every difference otherwise."""
    if not (out / STATE).is_file():
        if any(p.name != RunLock.NAME for p in out.iterdir()):
            raise SettingError(f"{out} is not empty and holds no gptlab SAE: choose a new or empty {{out}}",
                               out="out")
        return None
    try:
        saved = json.loads((out / STATE).read_text(encoding="utf-8"))
        saved_config = SAEConfig.from_dict(saved["config"])
    except (ValueError, KeyError, TypeError) as err:
        raise SettingError(f"{out / STATE} is damaged ({err}): choose another {{out}}", out="out") from None
    ignored = ("tokens", "expansion")  # tokens may grow; expansion only chose the width compared
    changes = [f"{{{name}}} {getattr(saved_config, name)}, not {getattr(config, name)}"
               for name in SAEConfig.field_names()
               if name not in ignored and getattr(saved_config, name) != getattr(config, name)]
    if saved.get("origin", {}).get("checkpoint_sha256") != origin["checkpoint_sha256"]:
        changes.append(f"the model in {saved.get('origin', {}).get('checkpoint')}, whose checkpoint has "
                       f"changed or is another ({origin['checkpoint']})")
    if saved.get("origin", {}).get("data") != origin["data"]:
        changes.append(f"the data {saved.get('origin', {}).get('data')}, not {origin['data']}")
    if saved.get("tokens", 0) > config.steps * config.batch_size:
        changes.append(f"{{tokens}} {saved['tokens']} already, more than {config.tokens}")
    if changes:
        settings = {name: f"SAEConfig.{name}" for name in SAEConfig.field_names()}
        raise SettingError(f"{out} holds an SAE trained with {'; '.join(changes)}: give the same settings to "
                           "continue it, or choose another {out} (nothing in it was changed)", out="out",
                           **settings)
    return saved


def train_in_folder(session: Session, config: SAEConfig, out: Path, saved: dict[str, Any] | None,
                    progress: bool) -> SAERun:
    """Train from the folder's last save (or from scratch) up to `config.tokens`, then measure and page."""
    assert config.width is not None, "train_sae fills in the width"
    sae = SparseAutoencoder(session.model.config.n_embd, config.width, config.k, seed=config.seed)
    sae = sae.to(next(session.model.parameters()).device)
    trainer = SAETrainer(sae, config.lr)
    generator = torch.Generator().manual_seed(config.seed)  # the windows read and their shuffling
    if saved is not None:
        load_training(trainer, generator, load_file(str(out / TRAINING)))
    before = trainer.steps * config.batch_size
    if saved is not None and trainer.steps >= config.steps and saved.get("metrics"):
        return SAERun(out, config, before, SAEMetrics.from_dict(saved["metrics"]), 0, 0.0)
    start = time.perf_counter()
    train_steps(session, config, trainer, generator, lambda: save(session, config, out, trainer, generator),
                progress)
    seconds = time.perf_counter() - start
    inputs, targets = held_out_windows(session.text.val, session.model.config.block_size)
    x = site_activations(session.model, config.site, inputs).flatten(0, 1).to(sae.b_dec.device)  # (B*T, D)
    metrics = evaluate_sae(session.model, sae, config.site, inputs, targets, x)
    title = f"{config.width} features of {session.provenance.model_name} at {config.site}"
    # The page before sae.json records the metrics: an SAE recorded as done always has its page.
    write_feature_page(session.model, session.tokenizer, sae, config.site, inputs, x, out / PAGE, title)
    save(session, config, out, trainer, generator, metrics)
    tokens = trainer.steps * config.batch_size
    return SAERun(out, config, tokens, metrics, tokens - before, seconds)


def train_steps(session: Session, config: SAEConfig, trainer: SAETrainer, generator: torch.Generator,
                save_now: Callable[[], None], progress: bool) -> None:
    """Steps on shuffled buffers of activations until `config.tokens`, saving between buffers and at the
    end."""
    total = config.steps
    bar = tqdm(total=total * config.batch_size, initial=trainer.steps * config.batch_size, unit="tok",
               unit_scale=True, disable=not progress, dynamic_ncols=True, leave=False)
    last_save = time.monotonic()
    with bar:
        while trainer.steps < total:
            batches = min(BUFFER_BATCHES, total - trainer.steps)
            buffer = activation_buffer(session, config, generator, batches * config.batch_size)  # (n, D)
            for batch in buffer.split(config.batch_size):
                unexplained = trainer.step(batch)
                bar.update(len(batch))
                bar.set_postfix(unexplained=f"{unexplained:.3f}", refresh=False)
            if trainer.steps == total or time.monotonic() - last_save >= SAVE_SECONDS:
                save_now()
                last_save = time.monotonic()


def activation_buffer(session: Session, config: SAEConfig, generator: torch.Generator,
                      tokens: int) -> torch.Tensor:
    """`tokens` activation vectors (N, D) at the site, from random training windows, shuffled."""
    block = session.model.config.block_size
    windows = random_windows(session.text.train, -(-tokens // block), block, generator)  # (B, T)
    vectors = site_activations(session.model, config.site, windows).flatten(0, 1)  # (B*T, D)
    order = torch.randperm(len(vectors), generator=generator)[:tokens]
    return vectors[order].to(next(session.model.parameters()).device)


def save(session: Session, config: SAEConfig, out: Path, trainer: SAETrainer, generator: torch.Generator,
         metrics: SAEMetrics | None = None) -> None:
    """Write the training state, the SAELens files and sae.json, in that order (sae.json last: the tokens
    it records are never ahead of the weights)."""
    tensors = training_tensors(trainer, generator)
    atomic_write(out / TRAINING, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))
    write_saelens(trainer.sae, out, session.provenance)
    state = {"format": FORMAT, "config": config.to_dict(), "origin": session.origin,
             "tokens": trainer.steps * config.batch_size, "metrics": metrics and metrics.to_dict()}
    atomic_write_text(out / STATE, json.dumps(state, indent=2) + "\n")


def training_tensors(trainer: SAETrainer, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Everything continuing needs, as named CPU tensors: weights, Adam's slots, counters, generator."""
    tensors = {f"sae.{name}": getattr(trainer.sae, name).detach().cpu() for name in TENSORS}
    for index, slots in trainer.optimizer.state_dict()["state"].items():
        tensors.update({f"adam.{index}.{slot}": value.cpu() for slot, value in slots.items()})
    tensors["since_fired"] = trainer.since_fired
    tensors["steps"] = torch.tensor(trainer.steps)
    tensors["generator"] = generator.get_state()
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def load_training(trainer: SAETrainer, generator: torch.Generator, tensors: dict[str, torch.Tensor]) -> None:
    """Restore what `training_tensors` saved into a fresh trainer and generator."""
    device = trainer.sae.b_dec.device
    trainer.sae.load_state_dict({name: tensors[f"sae.{name}"] for name in TENSORS})
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("adam."):
            _, index, slot = key.split(".")
            slots.setdefault(int(index), {})[slot] = value if slot == "step" else value.to(device)
    state = trainer.optimizer.state_dict()
    trainer.optimizer.load_state_dict({"state": slots, "param_groups": state["param_groups"]})
    trainer.since_fired = tensors["since_fired"]
    trainer.steps = int(tensors["steps"])
    generator.set_state(tensors["generator"])
