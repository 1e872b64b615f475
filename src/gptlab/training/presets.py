"""Named presets and the layering of configs: defaults < preset < TOML file < command-line options.

Plain data and one function. Seq2seq runs have one preset per built-in task, in gptlab.seq2seq.tasks.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gptlab.config import ModelConfig, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Each preset is a pair of partial configs. `demo` is what the README's main command trains: chosen
# by measurement for the lowest validation loss in about three minutes on a 2-core CPU.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "demo": {
        # Measured on shakespeare/char (2-core Xeon, float32, 2026-11-30): the same 4 x 128 model at
        # context 64 trained with Muon on the blocks' matrices, batch 48 and peak lr 6e-3 (muon 0.04)
        # reached 1.446 on the validation split in 159 s of training; the earlier AdamW recipe (batch
        # 12, lr 2e-3, 4,000 steps) had reached 1.615 in 177 s (2-core EPYC, 2026-11-29).
        "model": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, ffn="gelu_exact"),
        "train": dict(batch_size=48, max_steps=1300, lr=6e-3, min_lr=6e-4, warmup_steps=50, optimizer="muon",
                      muon_lr=0.04, eval_interval=260, eval_batches=20, precision="float32"),
    },
    # nanoGPT's CPU recipe (its README), for comparison with that project: its shape, no biases and
    # the exact (erf) GELU, as its model.py has them.
    "nanogpt-cpu": {
        "model": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, bias=False,
                      ffn="gelu_exact"),
        "train": dict(batch_size=12, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                      eval_interval=250, eval_batches=20),
    },
    # The fastest way found to nanoGPT's CPU-recipe loss (benchmarks/time_to_loss.py; docs/performance.md
    # has the records and what each change bought, 3 seeds each): Muon on the blocks' matrices, a 4x
    # larger batch, 3 blocks, the exact GELU (a third cheaper than the tanh form on a 2-core Xeon), an
    # untied head, windows growing from 16 tokens over the first 100 steps, a trapezoidal schedule at
    # peak lr 8e-3, one evaluation, at the end, and (round three) bigram, trigram and 4-gram embeddings,
    # which reach a lower loss in 100 steps than round two's recipe did in 200, on three corpora. The
    # precision is measured at start-up (machine.py): bfloat16 lost at this width on every CPU so far.
    "speedrun": {
        "model": dict(n_layer=3, n_head=4, n_embd=128, block_size=64, dropout=0.0, ffn="gelu_exact",
                      tied=False, ngram_embeddings=(2, 3, 4)),
        "train": dict(batch_size=48, max_steps=100, lr=8e-3, min_lr=8e-4, warmup_steps=20, optimizer="muon",
                      muon_lr=0.04, schedule="trapezoid", cooldown=0.4, seq_warmup=100, eval_interval=100,
                      eval_batches=4),
    },
    # A 2-layer attention-only model scoring its heads at every evaluation, for the generated `repeats`
    # corpus (gptlab train --preset induction --data repeats): an induction head forms in a few hundred
    # steps (README, "Watch circuits form").
    "induction": {
        "model": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, ffn="none", dropout=0.0,
                      positions="rope"),
        "train": dict(batch_size=32, max_steps=800, lr=3e-3, min_lr=3e-4, warmup_steps=50,
                      eval_interval=25, eval_batches=4, precision="float32", track_heads=True),
    },
    # A few seconds on any machine: for trying the commands and for tests.
    "tiny": {
        "model": dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
        "train": dict(batch_size=8, max_steps=60, lr=3e-3, min_lr=3e-4, warmup_steps=10,
                      eval_interval=20, eval_batches=4),
    },
    # A GPU-sized character model (6 x 384, context 256).
    "small": {
        "model": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2),
        "train": dict(batch_size=64, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                      eval_interval=500, eval_batches=50),
    },
}


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a config file with optional `[model]` and `[train]` tables (and an optional `preset`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from err
    unknown = sorted(set(table) - {"preset", "model", "train"})
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {', '.join(unknown)}; expected [model], [train], preset")
    return table


# One layer of settings: the setting that gives it, as Python names it (`TrainConfig.lr`, or the argument
# `preset` or `toml_path`), what follows that name when the layer is named (" demo"), and the fields it sets.
Layer = tuple[str, str, dict[str, dict[str, Any]]]


def config_layers(preset: str | None = None, toml_path: str | Path | None = None,
                  model_overrides: dict[str, Any] | None = None,
                  train_overrides: dict[str, Any] | None = None) -> list[Layer]:
    """The settings `resolve_configs` layers, in order, each named by the setting that gives it (one layer
    per overriding field), so that a resumed run can name the setting that would change it."""
    table = read_toml(toml_path) if toml_path else {}
    layers: list[Layer] = []
    if preset is None and table.get("preset") is not None:
        preset, named = table["preset"], ("toml_path", f" {toml_path} (preset {table['preset']})")
    else:
        named = ("preset", f" {preset}")
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        layers.append((*named, PRESETS[preset]))
    if toml_path:
        tables = {"model": table.get("model", {}), "train": table.get("train", {})}
        layers.append(("toml_path", f" {toml_path}", tables))
    for section, owner, overrides in (("model", "ModelConfig", model_overrides),
                                      ("train", "TrainConfig", train_overrides)):
        layers += [(f"{owner}.{name}", "", {section: {name: value}})
                   for name, value in (overrides or {}).items()]
    return layers


def resolve_configs(preset: str | None = None, toml_path: str | Path | None = None,
                    model_overrides: dict[str, Any] | None = None,
                    train_overrides: dict[str, Any] | None = None) -> tuple[ModelConfig, TrainConfig]:
    """Layer defaults, a preset, a TOML file and explicit overrides into validated configs."""
    merged: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for _, _, layer in config_layers(preset, toml_path, model_overrides, train_overrides):
        for section, values in layer.items():
            merged[section].update(values)
    return ModelConfig.from_dict(merged["model"]), TrainConfig.from_dict(merged["train"])
