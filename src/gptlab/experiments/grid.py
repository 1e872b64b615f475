"""The grid of a comparison: which settings vary, the cells they make, and one run folder per cell and seed.

A varied key (`varies`, `--vary KEY=V1,V2` on the command line) names any setting of `gptlab train`: a model
or training field (model, optimiser, schedule) or one of the data options preset, config, data, tokenizer,
vocab_size; several make the product of their values. Every cell is resolved to validated configs here,
so an unknown key or a bad value is one line before anything trains. Runs live in OUT/<cell>/seed-<n>,
each a normal run folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.config import Config, ModelConfig, SettingError, TrainConfig
from gptlab.training.presets import resolve_configs

# Keys that name where a run's settings and text come from, not a config field: key -> RunOptions field.
SOURCE_KEYS = {"preset": "preset", "config": "config", "data": "data", "tokenizer": "tokenizer",
               "vocab_size": "tokenizer_vocab_size"}
# Config fields that cannot be varied: gptlab sets them, or the grid itself does (seeds). The reasons name
# the settings of FIXED_NAMES, as SettingError keys.
FIXED = {"vocab_size": "it is the tokenizer's (vary vocab-size, the tokenizer's size, instead)",
         "causal": "a language model masks the future in every block",
         "seed": "seeds are the grid's other axis: use {seeds}",
         "device": "every run of a comparison runs on the same device",
         "log": "every run logs the same way: give {log} once"}
FIXED_NAMES = {"seeds": "seeds", "log": "TrainConfig.log"}
OWNERS = {"source": "RunOptions", "model": "ModelConfig", "train": "TrainConfig"}  # where a key's field is
TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class RunOptions:
    """What one `gptlab train` command line sets: a preset, a TOML file, the text and its tokenizer, and
    the config fields given as options."""

    preset: str | None = None
    config: str | None = None
    data: str = "shakespeare"
    tokenizer: str = "char"
    tokenizer_vocab_size: int | None = None
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)

    def configs(self) -> tuple[ModelConfig, TrainConfig]:
        """The validated configs these options resolve to (defaults < preset < file < options)."""
        return resolve_configs(self.preset, self.config, self.model, self.train)


@dataclass(frozen=True, eq=False)  # each cell is itself: compared and hashed by identity
class Cell:
    """One combination of the varied values: its name (`positions=rope`), the options it trains with and
    the configs they resolve to (the seed is set per run)."""

    name: str
    settings: tuple[tuple[str, str], ...]
    options: RunOptions
    model_config: ModelConfig
    train_config: TrainConfig


@dataclass(frozen=True)
class Run:
    """One cell trained with one seed, in its own run folder."""

    cell: Cell
    seed: int
    folder: Path

    @property
    def train_config(self) -> TrainConfig:
        return self.cell.train_config.replace(seed=self.seed)

    @property
    def label(self) -> str:
        return f"{self.cell.name} seed {self.seed}"


def option_value(key: str, text: str) -> tuple[str, str, Any]:
    """Where the varied `key=text` goes ("source", "model" or "train"), the field, and the typed value."""
    if key in SOURCE_KEYS:
        name = SOURCE_KEYS[key]
        hint = typing.get_type_hints(RunOptions)[name]
        return "source", name, _typed(f"RunOptions.{name}", key, text, hint)
    for section, config_cls in (("model", ModelConfig), ("train", TrainConfig)):
        if key in config_cls.field_names():
            if key in FIXED:
                raise SettingError(f"{{varies}} {key} is not offered: {FIXED[key]}", varies="varies",
                                   **FIXED_NAMES)
            hint = typing.get_type_hints(config_cls)[key]
            return section, key, _typed(f"{config_cls.__name__}.{key}", key, text, hint)
    known = sorted({*SOURCE_KEYS, *ModelConfig.field_names(), *TrainConfig.field_names()} - set(FIXED))
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise SettingError(f"{{varies}} {key}: no such option of gptlab train; {hint}the options: "
                       f"{', '.join(known)}", varies="varies")


def _typed(setting: str, key: str, text: str, hint: Any) -> Any:
    """`text` as the type of the option `key` (the field `setting`): numbers, booleans (true/false), `none`
    for an optional field."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if text.lower() == "none":
            return None
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is tuple:
        raise SettingError(f"{{varies}} {key}: a list option cannot be varied", varies="varies")
    if hint is bool:
        if text.lower() not in TRUE + FALSE:
            raise SettingError(f"{{varies}} {key}={text}: give true or false", varies="varies")
        return text.lower() in TRUE
    try:
        return hint(text)
    except ValueError:
        raise SettingError(f"{{varies}} {key}={text}: {{setting}} takes a {hint.__name__}", varies="varies",
                           setting=setting) from None


def build_grid(base: RunOptions, varies: list[tuple[str, tuple[str, ...]]]) -> list[Cell]:
    """Every combination of the varied values over `base`, each resolved and validated; no vary: one cell."""
    keys = [key for key, _ in varies]
    if len(set(keys)) != len(keys):
        raise SettingError("a key is varied twice: give all its values in one {varies} KEY=V1,V2",
                           varies="varies")
    targets = [option_value(key, values[0])[:2] for key, values in varies]
    for section, name in targets:
        given = getattr(base, name) if section == "source" else getattr(base, section).get(name)
        default = getattr(RunOptions(), name) if section == "source" else None
        if given is not None and given != default:
            raise SettingError(f"{{setting}} is both given ({given}) and varied: leave out {{setting}}",
                               setting=f"{OWNERS[section]}.{name}")
    cells, names = [], set()
    for combination in itertools.product(*(values for _, values in varies)):
        settings = tuple(zip(keys, combination, strict=True))
        options = base
        for key, text in settings:
            section, name, value = option_value(key, text)
            if section == "source":
                options = dataclasses.replace(options, **{name: value})
            elif section == "model":
                options = dataclasses.replace(options, model={**options.model, name: value})
            else:
                options = dataclasses.replace(options, train={**options.train, name: value})
        name = ",".join(f"{key}={text}" for key, text in settings) or "base"
        try:
            model_config, train_config = options.configs()
        except ValueError as err:
            raise ValueError(f"cell {name}: {err}") from None
        folder = safe_name(name)
        if folder in names:
            raise ValueError(f"cells {name} and another share the folder name {folder}: use distinct values")
        names.add(folder)
        cells.append(Cell(name, settings, options, model_config, train_config))
    return cells


def safe_name(name: str) -> str:
    """A cell's folder name: its name with characters a shell or a path would trip on replaced."""
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def grid_runs(cells: list[Cell], seeds: tuple[int, ...], out: Path) -> list[Run]:
    """One run per cell and seed, in OUT/<cell>/seed-<n>, cell by cell."""
    return [Run(cell, seed, out / safe_name(cell.name) / f"seed-{seed}") for cell in cells for seed in seeds]


def find_cell(cells: list[Cell], name: str | None) -> Cell:
    """The cell named `name` (its full name, or its values alone: `rope` for `positions=rope`); the first
    one when no name is given."""
    if name is None:
        return cells[0]
    matches = [c for c in cells if name in (c.name, ",".join(v for _, v in c.settings))]
    if len(matches) != 1:
        raise SettingError(f"{{baseline}} {name!r} is not one cell of the grid; the cells are: "
                           f"{', '.join(c.name for c in cells)}", baseline="baseline")
    return matches[0]


def config_differences(old: Config, new: Config) -> list[str]:
    """`field old -> new` for every field two configs of one kind disagree on."""
    a, b = old.to_dict(), new.to_dict()
    return [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b.get(k)]
