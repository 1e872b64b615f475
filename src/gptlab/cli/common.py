"""Helpers shared by the command groups: logging above progress bars, config-field options, and the
command-line option of each library argument an error names."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.config import DTYPES, QUANTIZATIONS, Config

if TYPE_CHECKING:  # torch-free, but only needed when a command runs
    from gptlab.speculative import SpeculationConfig

# The command-line option of each library argument a SettingError names (config fields need no entry),
# for the CLI's one error line (`SettingError.as_flags`).
ARGUMENT_FLAGS = {
    "run_dir": "--out",
    "resume": "--resume",
    "data": "--data",
    "init_from": "--init-from",
    "device": "--device",
    "kind": "--type",
    "adapter_only": "--adapter-only",
    "lora": "--lora",
    "LoraConfig.r": "--lora",
    "base": "BASE",
    "read_history": "--history",
    "layer": "--layer",
    "head": "--head",
    "prompt": "--prompt",
    "replace": "--replace",
    "drop": "--drop",
    "clean": "--clean",
    "corrupt": "--corrupt",
    "target": "--target",
    "foil": "--foil",
    "preset": "--preset",
    "toml_path": "--config",
    "tokenizer": "--tokenizer",
    "vocab_size": "--vocab-size",
    "out": "--out",
    "jobs": "--jobs",
    "baseline": "--baseline",
    "varies": "--vary",
    "seeds": "--seeds",
    "RunOptions.preset": "--preset",
    "RunOptions.config": "--config",
    "RunOptions.data": "--data",
    "RunOptions.tokenizer": "--tokenizer",
    "RunOptions.tokenizer_vocab_size": "--vocab-size",
    "dtype": "--dtype",
    "quantize": "--quantize",
    "max_batch": "--max-batch",
    "max_context": "--max-context",
    "max_tokens": "--max-tokens",
    "max_stops": "--max-stops",
    "max_stop_chars": "--max-stop-chars",
    "max_waiting": "--max-waiting",
    "request_timeout": "--request-timeout",
    "prefill_chunk": "--prefill-chunk",
    "allowed_hosts": "--allowed-hosts",
    "api_key_file": "--api-key-file",
    "batch_size": "--batch-size",
    "limit": "--limit",
    "variant": "--variant",
    "shots": "--shots",
    "edges": "--edges",
    "steps": "--steps",
    "keep": "--keep",
    "method": "--method",
}


class TqdmHandler(logging.Handler):
    """Print log records above any progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        tqdm.write(self.format(record), file=sys.stdout)
        sys.stdout.flush()  # show progress promptly when stdout is a file or a pipe


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type[Config], title: str,
                         exclude: Sequence[str] = (), defaults: Mapping[str, object] | None = None) -> None:
    """Add one `--field-name VALUE` option per config field; only options the user gives are kept.

    `defaults` replaces the default shown in the help of the fields a preset sets.
    """
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if field.name in exclude:
            continue
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("aliases", ())]
        kind = hints[field.name]
        shown = (defaults or {}).get(field.name, field.default)
        help_text = f"{field.metadata.get('help', '')} (default: {shown})"
        if kind is bool:
            group.add_argument(
                *flags, dest=field.name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )
        elif typing.get_origin(kind) is tuple:  # a list of strings or numbers: the option may be repeated
            item = typing.get_args(kind)[0]
            group.add_argument(*flags, dest=field.name, nargs="+", action="extend",
                               type=Bounded(item) if item in (int, float) else item,
                               metavar="S" if item is str else "N", default=argparse.SUPPRESS, help=help_text)
        else:
            kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)  # X | None -> X
            if kind is bool:  # an optional bool (None: the model's own choice), given as true or false
                group.add_argument(*flags, dest=field.name, type=true_or_false, metavar="BOOL",
                                   default=argparse.SUPPRESS, help=help_text)
                continue
            if typing.get_origin(kind) is dict:  # a mapping (logit_bias), given as one JSON object
                group.add_argument(*flags, dest=field.name, type=json_object, metavar="JSON",
                                   default=argparse.SUPPRESS, help=help_text)
                continue
            choices = field.metadata.get("choices")
            optional = type(None) in typing.get_args(hints[field.name])  # "none" leaves it unset
            shown_kind = kind.__name__.upper() + "|none" * optional
            group.add_argument(
                *flags, dest=field.name, choices=choices,
                type=Bounded(kind, none=optional) if kind in (int, float) else kind,
                metavar="{" + ",".join(choices) + "}" if choices else shown_kind,
                default=argparse.SUPPRESS, help=help_text,
            )


def json_object(text: str) -> dict[str, Any]:
    """An option's value read as a JSON object (`--logit-bias '{"0": -100}'`), else argparse's error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object such as '{{\"0\": -100}}'")
    return value


def true_or_false(text: str) -> bool:
    """An option's value read as true or false (yes/no, 1/0), else argparse's error."""
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return words[text.lower()]


def config_overrides(args: argparse.Namespace, config_cls: type[Config]) -> dict[str, Any]:
    """The config fields the user set on the command line."""
    return {name: getattr(args, name) for name in config_cls.field_names() if hasattr(args, name)}


def print_configs(configs: Mapping[str, Config], hidden: Sequence[str] = ()) -> None:
    """One `name: field=value, ...` line per config, leaving out the fields gptlab sets itself."""
    for name, config in configs.items():
        print(f"{name}:", ", ".join(f"{k}={v}" for k, v in config.to_dict().items() if k not in hidden))


def report_run(result: Any, out: Path, evaluate: Callable[[], str] | None = None) -> None:
    """Where a training run stopped, its speed, one validation figure and what its folder holds.

    The figure is what `evaluate` returns (the best checkpoint scored by the caller; called after the
    first line is out, so that line marks the end of training for anyone timing it), else the best of
    the estimates made during training, each the mean loss of the same few sampled validation batches.
    """
    state = "interrupted at" if result.interrupted else "finished at"
    print(f"\n{state} step {result.step}: {result.tokens_per_s:,.0f} tokens/s, "
          f"{result.elapsed_s:.0f} s of training", flush=True)
    if evaluate is None and math.isinf(result.best_val_loss):
        print("no evaluation since step 0: the run is read from its last checkpoint")
    else:
        print(evaluate() if evaluate else f"best validation loss {result.best_val_loss:.4f} (estimated "
              "during training on sampled batches of the val split)")
    names = ["best.safetensors", "best.shards.json", "last.safetensors", "last.shards.json", "shards",
             "metrics.csv", "steps.csv", "loss.png", "tensorboard", "wandb"]  # shards and --log's: folders
    kept = [f"{name}/" if (out / name).is_dir() else name for name in names if (out / name).exists()]
    print(f"run folder: {out} ({', '.join(kept)})")


def note_long_prompt(tokens: int, block_size: int) -> None:
    """Say on stderr that a prompt of `tokens` tokens is read only from its last `block_size` (sample,
    attention and ablate keep the end of a prompt longer than the context window; serve refuses it)."""
    print(f"note: the prompt is {tokens:,} tokens, more than the model's context window of {block_size:,}: "
          f"only its last {block_size:,} are read", file=sys.stderr)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--resume and --stop-at, shared by the training commands."""
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint, exactly as it was saved. "
                        "Only --max-steps, --save-every, --device, --compile, --log, --checkpoint-format "
                        "(and --data for a moved run) may be given: a larger --max-steps extends a finished "
                        "run, keeping the "
                        "learning-rate schedule of its first max_steps and holding min_lr after it")
    parser.add_argument("--stop-at", type=NATURAL, metavar="STEP",
                        help="stop (and save) at this step, keeping "
                        "the schedule of the full run; resume later with --resume")


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """--device for the commands that run a trained model (default cpu)."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default cpu)")


def add_weight_options(parser: argparse.ArgumentParser) -> None:
    """--dtype and --quantize for the commands that run a trained model (quantize.inference_weights)."""
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="precision of the weights: bfloat16 halves the memory a step reads, and the "
                        "logits move a little (gptlab verify RUN --dtype bfloat16 measures it; default "
                        "float32)")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default="none",
                        help="int8: int8 weights with one scale per output channel, bfloat16 activations "
                        "into each product; CPU only (default none)")


def check_out(out: Path, force: bool) -> None:
    """Refuse an existing --out that gptlab did not write (a picture or page of its own is written again,
    as the same command twice must just work), unless --force."""
    from gptlab.files import remove_abandoned_temporaries, written_by_gptlab  # torch-free, but only now

    if out.exists() and not force and not written_by_gptlab(out):
        raise ValueError(f"--out {out} exists and was not written by gptlab: pass --force to replace it")
    remove_abandoned_temporaries(out)  # what an earlier run of it left, killed while writing


def speculation_of(args: argparse.Namespace) -> SpeculationConfig | None:
    """The SpeculationConfig --speculative, --draft-tokens and --ngram describe, or None without
    --speculative (a bad value's error names its flag)."""
    from gptlab.speculative import SpeculationConfig

    given = {name: value for name in ("draft_tokens", "ngram") if (value := getattr(args, name)) is not None}
    if args.speculative is None:
        if given:
            raise ValueError(f"--{next(iter(given)).replace('_', '-')} needs --speculative ngram")
        return None
    try:
        return SpeculationConfig(**given)
    except ValueError as err:
        raise ValueError(str(err).replace("SpeculationConfig.draft_tokens", "--draft-tokens")
                         .replace("SpeculationConfig.ngram", "--ngram")) from None


class Bounded:
    """An option's number type whose range argparse (and the command contract test) can read: an int or a
    float, finite, within [low, high] (None: no bound); anything else is argparse's one-line error."""

    def __init__(self, kind: type[int] | type[float], low: float | None = None, high: float | None = None,
                 none: bool = False) -> None:
        """`none`: the word none is also a value (None), for a setting that may be left unset."""
        self.kind, self.low, self.high, self.none = kind, low, high, none
        self.__name__ = kind.__name__  # argparse's name for the type in its messages

    def __call__(self, text: str) -> int | float | None:
        if self.none and text.lower() == "none":
            return None
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        below = self.low is not None and value < self.low
        if not math.isfinite(value) or below or (self.high is not None and value > self.high):
            raise argparse.ArgumentTypeError(f"{text} is not {self.describe()}")
        return value

    def describe(self) -> str:
        """What a valid value is, in words: "an integer from 0 to 65535", "a number of at least 0", ..."""
        what = ("none or " if self.none else "") + ("an integer" if self.kind is int else "a finite number")
        if self.low is not None and self.high is not None:
            return f"{what} from {self.low:g} to {self.high:g}"
        if self.low is not None:
            return f"{what} of at least {self.low:g}"
        return what if self.high is None else f"{what} of at most {self.high:g}"

    def outside(self) -> list[str]:
        """Values this type refuses (for the command contract test): just past each bound, and infinities
        and NaN."""
        step = 1 if self.kind is int else 1e-6 * max(1.0, abs(self.low or 0), abs(self.high or 0))
        past = [self.low - step] if self.low is not None else []
        past += [self.high + step] if self.high is not None else []
        return [repr(self.kind(v)) for v in past] + ["inf", "-inf", "nan"]


COUNT = Bounded(int, 1)  # how many of something: at least one
NATURAL = Bounded(int, 0)  # an index, a seed, a step, or a count that may be zero


class InputFile:
    """An option's file to read, checked as argparse reads it: it exists, is a file and (`text`) is UTF-8;
    the value stays the path as given."""

    __name__ = "file"

    def __init__(self, text: bool = True) -> None:
        self.text = text

    def __call__(self, value: str) -> str:
        path = Path(value)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{value} is a folder: give a file")
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{value}: no such file")
        if self.text:
            from gptlab.data.corpora import read_utf8  # numpy, only when the option is given

            try:
                read_utf8(path)
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return value


class RunPath:
    """A run folder, checkpoint file or Hugging Face folder to read: it must exist (a name that exists
    under runs/ is suggested)."""

    __name__ = "run"

    def __call__(self, value: str) -> str:
        if Path(value).exists():
            return value
        beside = Path("runs") / value
        hint = f": did you mean {beside}?" if beside.exists() else ": give a run folder or checkpoint file"
        raise argparse.ArgumentTypeError(f"no run folder or checkpoint at {value}{hint}")


class OutputFile:
    """A file a command writes: not a folder (whether an existing file may be replaced is the command's
    rule, `check_out`)."""

    __name__ = "output file"

    def __call__(self, value: str) -> str:
        if Path(value).is_dir():
            raise argparse.ArgumentTypeError(f"{value} is a folder: give a file name")
        return value


class OutputFolder:
    """A folder a command writes: not an existing file (whether an existing folder may be reused is the
    command's rule)."""

    __name__ = "output folder"

    def __call__(self, value: str) -> str:
        if Path(value).is_file():
            raise argparse.ArgumentTypeError(f"{value} is a file: give a folder")
        return value
