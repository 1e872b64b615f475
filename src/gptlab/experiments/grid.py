"""The grid of a comparison: which settings vary, the cells they make, and one run folder per cell and seed.

`--vary KEY=V1,V2` names any option of `gptlab train` by its flag (model, optimiser, schedule, and the
data options preset, config, data, tokenizer, vocab-size); several `--vary` make the product of their
values. Every cell is resolved to validated configs here, so an unknown key or a bad value is one line
before anything trains. Runs live in OUT/<cell>/seed-<n>, each a normal run folder.
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

from gptlab.config import Config, ModelConfig, TrainConfig, flag
from gptlab.training.presets import resolve_configs

# Keys that name where a run's settings and text come from, not a config field: key -> RunOptions field.
SOURCE_KEYS = {"preset": "preset", "config": "config", "data": "data", "tokenizer": "tokenizer",
               "vocab_size": "tokenizer_vocab_size"}
# Config fields that cannot be varied: gptlab sets them, or the grid itself does (seeds).
FIXED = {"vocab_size": "it is the tokenizer's (vary vocab-size, the tokenizer's size, instead)",
         "causal": "a language model masks the future in every block",
         "seed": "seeds are the grid's other axis: use --seeds",
         "device": "every run of a comparison runs on the same device",
         "log": "every run logs the same way: give --log once"}
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


def parse_vary(text: str) -> tuple[str, tuple[str, ...]]:
    """`KEY=V1,V2` -> (key as a field name, the values); the key may be written as its flag."""
    key, sep, values = text.partition("=")
    key = key.strip().removeprefix("--").replace("-", "_")
    items = tuple(v.strip() for v in values.split(","))
    if not sep or not key or not all(items):
        raise ValueError(f"--vary {text!r} must be KEY=V1,V2[,...], e.g. --vary positions=learned,rope")
    if len(set(items)) != len(items):
        raise ValueError(f"--vary {text!r} repeats a value: give each value once")
    return key, items


def parse_seeds(text: str) -> tuple[int, ...]:
    """`3` -> seeds 1, 2, 3; `1,5,9` -> those seeds."""
    try:
        seeds = tuple(int(s) for s in text.split(",")) if "," in text else tuple(range(1, int(text) + 1))
    except ValueError:
        raise ValueError(f"--seeds {text!r} must be a count (3: seeds 1, 2, 3) or a list (1,5,9)") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r} must give at least one seed, each once and not negative")
    return seeds


def option_value(key: str, text: str) -> tuple[str, str, Any]:
    """Where `--vary key=text` goes ("source", "model" or "train"), the field, and the typed value."""
    if key in SOURCE_KEYS:
        name = SOURCE_KEYS[key]
        hint = typing.get_type_hints(RunOptions)[name]
        return "source", name, _typed(key, text, hint)
    for section, config_cls in (("model", ModelConfig), ("train", TrainConfig)):
        if key in config_cls.field_names():
            if key in FIXED:
                raise ValueError(f"--vary {key} is not offered: {FIXED[key]}")
            hint = typing.get_type_hints(config_cls)[key]
            return section, key, _typed(key, text, hint)
    known = sorted({*SOURCE_KEYS, *ModelConfig.field_names(), *TrainConfig.field_names()} - set(FIXED))
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ValueError(f"--vary {key}: no such option of gptlab train; {hint}the options: {', '.join(known)}")


def _typed(key: str, text: str, hint: Any) -> Any:
    """`text` as the option's type: numbers, booleans (true/false), `none` for an optional field."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if text.lower() == "none":
            return None
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is tuple:
        raise ValueError(f"--vary {key}: a list option cannot be varied")
    if hint is bool:
        if text.lower() not in TRUE + FALSE:
            raise ValueError(f"--vary {key}={text}: give true or false")
        return text.lower() in TRUE
    try:
        return hint(text)
    except ValueError:
        raise ValueError(f"--vary {key}={text}: {flag(key)} takes a {hint.__name__}") from None


def build_grid(base: RunOptions, varies: list[tuple[str, tuple[str, ...]]]) -> list[Cell]:
    """Every combination of the varied values over `base`, each resolved and validated; no vary: one cell."""
    keys = [key for key, _ in varies]
    if len(set(keys)) != len(keys):
        raise ValueError("a key is varied twice: give all its values in one --vary KEY=V1,V2")
    targets = [option_value(key, values[0])[:2] for key, values in varies]
    for key, (section, name) in zip(keys, targets, strict=True):
        given = getattr(base, name) if section == "source" else getattr(base, section).get(name)
        default = getattr(RunOptions(), name) if section == "source" else None
        if given is not None and given != default:
            raise ValueError(f"{flag(key)} is both given ({given}) and varied: leave out {flag(key)}")
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
        raise ValueError(f"--baseline {name!r} is not one cell of the grid; the cells are: "
                         f"{', '.join(c.name for c in cells)}")
    return matches[0]


def config_differences(old: Config, new: Config) -> list[str]:
    """`field old -> new` for every field two configs of one kind disagree on."""
    a, b = old.to_dict(), new.to_dict()
    return [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b.get(k)]
