"""Named presets and the layering of configs: defaults < preset < TOML file < command-line options.

Plain data and one function. Seq2seq runs have one preset per built-in task, in gptlab.tasks.
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
        # Measured on shakespeare/char (2-core CPU, float32): this 4 x 128 model at context 64 beat
        # context 128 (4 x 128, batch 16: 1.723 in 229 s) and a 192-wide bf16 model (1.756 in 209 s)
        # per second of training; lr 2e-3 for 3,000 steps (1.691 in 129 s) beat lr 1e-3 for 4,000
        # steps (1.705 in 236 s). 4,000 steps at 2e-3 fill about three minutes.
        "model": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0),
        "train": dict(batch_size=12, max_steps=4000, lr=2e-3, min_lr=2e-4, warmup_steps=100,
                      eval_interval=400, eval_batches=20, precision="float32"),
    },
    # The well-known nanoGPT CPU recipe, for comparison with that project's figures.
    "nanogpt-cpu": {
        "model": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0),
        "train": dict(batch_size=12, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                      eval_interval=250, eval_batches=20),
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


def read_toml(path: str | Path) -> dict[str, dict[str, Any]]:
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


def resolve_configs(preset: str | None = None, toml_path: str | Path | None = None,
                    model_overrides: dict[str, Any] | None = None,
                    train_overrides: dict[str, Any] | None = None) -> tuple[ModelConfig, TrainConfig]:
    """Layer defaults, a preset, a TOML file and explicit overrides into validated configs."""
    table = read_toml(toml_path) if toml_path else {}
    preset = preset or table.get("preset")
    layers: list[dict[str, dict[str, Any]]] = []
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        layers.append(PRESETS[preset])
    layers.append({"model": table.get("model", {}), "train": table.get("train", {})})
    layers.append({"model": model_overrides or {}, "train": train_overrides or {}})
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    for layer in layers:
        model.update(layer.get("model", {}))
        train.update(layer.get("train", {}))
    return ModelConfig.from_dict(model), TrainConfig.from_dict(train)
