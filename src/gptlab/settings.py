"""The machinery every config shares, torch-free: a `Config` base for typed dataclass fields that checks and
coerces the values JSON files, TOML tables and parsed command-line options give (an int where a float is
wanted, a list for a tuple, a token id written as a JSON key string), a dict round trip and a `validate`
hook; the checks that name a bad field (`check_positive`, `check_choice`); `option`, a field carrying its
command-line help; and `SettingError`, whose message names each setting as a Python field (`TrainConfig.lr`)
or as a command-line flag (`--lr`). Kept apart from gptlab.config, which holds the configs themselves, so
that a module can define a config of its own without importing them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="Config")


class Config:
    """Shared behaviour of the config dataclasses: type checks, dict round trip, validation hook."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every subclass is a @dataclass

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(type(self).__name__, f.name, getattr(self, f.name), hints[f.name]))
        self.validate()

    def validate(self) -> None:
        """Check combinations of fields; subclasses raise ValueError with the fix."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """Build from a dict (a saved JSON file, a TOML table), refusing keys the config lacks."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(unknown)}; "
                             f"known fields are: {', '.join(cls.field_names())}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {name: list(v) if isinstance(v, tuple) else v for name, v in dataclasses.asdict(self).items()}

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed, validated again."""
        return type(self).from_dict({**self.to_dict(), **changes})


def _coerce(owner: str, name: str, value: Any, kind: Any) -> Any:
    """Accept a value of the annotated type (an int where a float is wanted), else say what is wrong;
    `X | None` fields accept None and `tuple[T, ...]` fields any list or tuple of T (JSON gives lists)."""
    if typing.get_origin(kind) in (types.UnionType, typing.Union):
        inner = next(k for k in typing.get_args(kind) if k is not type(None))
        return None if value is None else _coerce(owner, name, value, inner)
    if typing.get_origin(kind) is tuple:  # tuple[str, ...] or tuple[int, ...]: each item checked as one
        if isinstance(value, (list, tuple)):
            item = typing.get_args(kind)[0]
            return tuple(_coerce(owner, f"{name}[{i}]", v, item) for i, v in enumerate(value))
        raise ValueError(f"{owner}.{name}={value!r} must be a list")
    if typing.get_origin(kind) is dict:  # token id -> number; JSON's keys are strings ("50256": -100)
        given = value if isinstance(value, dict) else {}
        ids = {k: int(k) if isinstance(k, str) and k.isdigit() else k for k in given}
        if given is not value or not all(type(i) is int for i in ids.values()):
            raise ValueError(f"{owner}.{name}={value!r} must map token ids (whole numbers >= 0) to numbers")
        return {ids[k]: _coerce(owner, f"{name}[{k!r}]", v, float) for k, v in value.items()}
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{owner}.{name}={value} must be a finite number")
    # bool is a subclass of int in Python: `n_layer=True` must still be refused.
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r} must be of type {kind.__name__}, "
                         f"not {type(value).__name__}")
    return value


def check_positive(owner: str, **values: float) -> None:
    """Raise a ValueError naming the first field that is not > 0."""
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{owner}.{name}={value} must be positive")


def check_choice(owner: str, name: str, value: str, choices: typing.Iterable[str]) -> None:
    """Raise a ValueError naming the field and listing the allowed values."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r} is not one of: {', '.join(choices)}")


def flag(field: str) -> str:
    """The command-line option of a config field: max_steps -> --max-steps."""
    return "--" + field.replace("_", "-")


class SettingError(ValueError):
    """A user mistake in named settings. `str()` names each as Python does (`TrainConfig.track_heads`, an
    argument such as `run_dir`), so a Python caller reads what it passed; `as_flags` names each as the
    command line does (`--track-heads`, `--out`), for the CLI's one error line. `template` holds a `{key}`
    for each setting, filled from `settings` (key -> Python spelling); other braces in it are left alone."""

    def __init__(self, template: str, **settings: str) -> None:
        self.template, self.settings = template, settings
        super().__init__(self.fill(settings))

    def fill(self, spellings: typing.Mapping[str, str]) -> str:
        text = self.template
        for key, spelling in spellings.items():
            text = text.replace("{" + key + "}", spelling)
        return text

    def as_flags(self, argument_flags: typing.Mapping[str, str]) -> str:
        """The message with each setting as its command-line option: a config field (`XConfig.name`) as
        `flag(name)` unless `argument_flags` names it, an argument through `argument_flags` (a `--no-x` switch
        written as `not XConfig.x`)."""
        def option(spelling: str) -> str:
            if spelling in argument_flags:  # a field whose option is not its flag (LoraConfig.r: --lora)
                return argument_flags[spelling]
            negated = spelling.startswith("not ")
            owner, _, name = spelling.removeprefix("not ").rpartition(".")
            if owner.endswith("Config"):
                return "--no-" + flag(name)[2:] if negated else flag(name)
            return argument_flags.get(spelling, spelling)
        return self.fill({key: option(spelling) for key, spelling in self.settings.items()})


def option(default: Any, help: str, choices: tuple[str, ...] | None = None,
           aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field carrying its command-line help, allowed values and other spellings of its option."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})
