"""Continuing a run exactly where its last checkpoint left off, and what a resumed run may change.

A resumed run continues as it was saved: only the RESUMABLE training fields may change (a larger
max_steps extends the run, keeping its schedule), and every other difference is refused, each by name,
in one `SettingError` (fields for a Python caller, options on the command line). `resume_as_given` is
the policy of `gptlab train` given again: the settings that started a run, repeated, continue it, since
a value equal to the run's is no change.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.checkpoint import (
    BEST,
    LAST,
    Checkpoint,
    architecture,
    data_folder,
    load_checkpoint,
    load_header,
    require_architecture,
)
from gptlab.config import SettingError, TaskConfig, TrainConfig
from gptlab.data.corpora import CORPORA
from gptlab.data.tokens import TokenData
from gptlab.seq2seq.tasks import TaskData
from gptlab.training import distributed
from gptlab.training.loop import Trainer, TrainResult
from gptlab.training.presets import Layer, config_layers
from gptlab.training.runs import TrainingData, check_settings, run_folder, saved_machine, write_run_config

# What `resume` may change: how long the run goes on, where it runs and where its metrics go, never
# what it computes.
RESUMABLE = ("max_steps", "save_every", "device", "compile", "log", "checkpoint_format")


@dataclass(frozen=True)
class Change:
    """One setting a resumed run refuses, as `SettingError` words it: `template` holds a `{key}` for each
    setting it names, and `settings` maps each key to the setting's Python spelling."""

    template: str
    settings: dict[str, str] = field(default_factory=dict)


def change(setting: str, name: str, old: Any, new: Any) -> Change:
    """How `refuse_changes` names one setting: `TrainConfig.lr (lr 0.003 -> 0.1)`."""
    return Change(f"{{setting}} ({name} {old} -> {new})", {"setting": setting})


def refuse_changes(changes: Sequence[Change]) -> None:
    """A resumed run continues as it was saved: refuse, by name, every setting that would change it
    (`changes` names each, with the run's value and the new one where known)."""
    if not changes:
        return
    settings = {"resume": "resume", "init_from": "init_from",
                **{f"free{i}": f"TrainConfig.{name}" for i, name in enumerate(RESUMABLE)}}
    parts = []
    for i, refused in enumerate(changes):  # each change's keys made unique: c0_setting, c1_setting, ...
        text = refused.template
        for key, spelling in refused.settings.items():
            text = text.replace("{" + key + "}", "{" + f"c{i}_{key}" + "}")
            settings[f"c{i}_{key}"] = spelling
        parts.append(text)
    free = ", ".join("{" + f"free{i}" + "}" for i in range(len(RESUMABLE)))
    raise SettingError("{resume} continues the run as it was saved: " + "; ".join(parts) + " would change it "
                       f"(options equal to the run's values are accepted; only {free} may differ); start a "
                       "new run, or fine-tune from this one with {init_from}", **settings)


def data_from_state(state: dict[str, Any], run_dir: Path) -> TrainingData:
    """The data source a checkpoint in `run_dir` was trained on."""
    if "sft" in state:  # its source is rebuilt by gptlab.adapt.finetune, which builds on this module
        raise ValueError(f"{run_dir} is a fine-tuning run: continue it with gptlab finetune ... --out "
                         f"{run_dir} --resume")
    return TaskData(TaskConfig.from_dict(state["task"])) if "task" in state else TokenData(
        data_folder(run_dir, state))


def with_intact_best(run_dir: Path, err: ValueError) -> ValueError:
    """`err` (an unreadable last checkpoint), saying how to go on from the best one when that is intact."""
    if not (run_dir / BEST).is_file():
        return err
    try:
        step = load_header(run_dir / BEST).state.get("step")
    except ValueError:
        return err
    return ValueError(f"{err}; {run_dir / BEST} (step {step}) is intact: copy it over {run_dir / LAST} to "
                      "resume from that step")


def resume(run_dir: str | Path, *, stop_at: int | None = None, progress: bool = True,
           expect: str | None = None, changes: dict[str, Any] | None = None,
           data: str | Path | None = None) -> TrainResult:
    """Continue the run in `run_dir` exactly where its last checkpoint left off.

    `changes` may set the RESUMABLE training fields: a larger `max_steps` extends the run, keeping the
    learning-rate schedule of its first max_steps and holding min_lr after it. `data` points a moved
    run at its prepared folder (the same tokenizer). `expect` ("decoder" or "encoder-decoder") refuses
    a run of the other architecture with a pointer to the right commands.
    """
    run_dir = Path(run_dir)
    with run_folder(run_dir, new=False):
        try:
            saved = load_header(run_dir, prefer=LAST).train_config
            # A sharded run reads only its own shards; any other reads whole tensors.
            lazy = (distributed.this_process().world_size > 1 and saved is not None
                    and saved.parallel == "fsdp")
            checkpoint = load_checkpoint(run_dir, prefer=LAST, lazy=lazy)
        except ValueError as err:
            raise with_intact_best(run_dir, err) from None
        if expect is not None:
            require_architecture(architecture(checkpoint.model_config), run_dir, expect)
        check_resumable(checkpoint, run_dir)
        train_config = extended(checkpoint, changes or {})
        if data is None:
            source = data_from_state(checkpoint.state, run_dir)
        else:
            source = TokenData(data)
            if source.tokenizer.to_dict() != checkpoint.tokenizer:
                raise SettingError(f"{data} was prepared with another tokenizer than the run's: give "
                                   "{data} the prepared folder the run was trained on", data="data")
        if train_config != checkpoint.train_config or data is not None:
            checkpoint.train_config = train_config
            if distributed.this_process().is_main:
                write_run_config(run_dir, checkpoint.model_config, train_config, source,
                                 saved_machine(run_dir))
        with distributed.session(train_config.device) as (dist, device):
            check_settings(checkpoint.model_config, train_config, dist.world_size)
            trainer = Trainer(run_dir, source, checkpoint.model_config, train_config, dist, device,
                              checkpoint, progress)
            return trainer.run(stop_at)


def check_resumable(checkpoint: Checkpoint, run_dir: Path) -> None:
    """Refuse a checkpoint that holds no training state, or weights gptlab did not train in float32."""
    if checkpoint.train_config is None or checkpoint.optimizer_state is None:
        raise ValueError(f"{run_dir} holds weights but no training state (an imported model?): "
                         "there is nothing to resume; start a new run instead")
    dtypes = {str(t.dtype).removeprefix("torch.") for t in checkpoint.model_state.values()}
    if dtypes != {"float32"}:
        raise SettingError(f"{checkpoint.source} holds {', '.join(sorted(dtypes))} weights, but a run "
                           "resumes only from the float32 checkpoints gptlab's training writes: start a new "
                           f"run from these weights with {{init_from}} {checkpoint.source}",
                           init_from="init_from")


def resume_changes(checkpoint: Checkpoint, layers: Sequence[Layer]) -> tuple[dict[str, Any], list[Change]]:
    """What the settings of `layers` (`presets.config_layers`) would do to the saved run: the RESUMABLE
    training fields that their own fields change, and one Change per layer that would change anything else.
    Values are compared as the configs hold them, so an lr of 3e-3 equals a saved 0.003."""
    assert checkpoint.train_config is not None, "check_resumable first"
    configs = {"model": checkpoint.model_config, "train": checkpoint.train_config}
    given: dict[tuple[str, str], tuple[str, str]] = {}  # (section, field) -> the last layer that sets it
    merged: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for setting, detail, layer in layers:
        for section, values in layer.items():
            values = {k: v for k, v in values.items() if k != "vocab_size"}  # the tokenizer's, never given
            merged[section].update(values)
            given.update({(section, name): (setting, detail) for name in values})
    saved = {section: config.to_dict() for section, config in configs.items()}
    resolved = {section: type(config).from_dict({**saved[section], **merged[section]}).to_dict()
                for section, config in configs.items()}
    changes: dict[str, Any] = {}
    refused: dict[tuple[str, str], list[str]] = {}
    for (section, name), named in given.items():
        old, new = saved[section][name], resolved[section][name]
        if old == new:
            continue
        if section == "train" and name in RESUMABLE and named == (f"TrainConfig.{name}", ""):
            changes[name] = new
        else:
            refused.setdefault(named, []).append(f"{name} {old} -> {new}")
    return changes, [Change(f"{{setting}}{detail} ({', '.join(parts)})", {"setting": setting})
                     for (setting, detail), parts in refused.items()]


def extended(checkpoint: Checkpoint, changes: dict[str, Any]) -> TrainConfig:
    """The run's training config with the RESUMABLE `changes`; a value equal to the run's is no change,
    and any other difference is refused, by name."""
    assert checkpoint.train_config is not None, "check_resumable first"
    old, step = checkpoint.train_config, checkpoint.state["step"]
    changes = {name: value for name, value in changes.items() if getattr(old, name) != value}
    refuse_changes([change(f"TrainConfig.{name}", name, getattr(old, name), value)
                    for name, value in sorted(changes.items()) if name not in RESUMABLE])
    max_steps = changes.get("max_steps", old.max_steps)
    if "max_steps" in changes and max_steps <= step:
        raise SettingError(f"the run is at step {step}: {{max_steps}} must be larger than that to extend it",
                           max_steps="TrainConfig.max_steps")
    if max_steps != old.max_steps:  # the first run's schedule stays; min_lr holds after it
        changes = {**changes, "decay_steps": old.decay_steps or old.max_steps}
    return old.replace(**changes)


def resume_as_given(run_dir: str | Path, *, preset: str | None = None, toml_path: str | Path | None = None,
                    model_overrides: dict[str, Any] | None = None,
                    train_overrides: dict[str, Any] | None = None, data: str | None = None,
                    tokenizer: str | None = None, vocab_size: int | None = None,
                    init_from: str | Path | None = None, stop_at: int | None = None,
                    progress: bool = True) -> TrainResult:
    """Continue the GPT run in `run_dir`, given again the settings of the `train` call that started it.

    Settings equal to the run's are accepted, the RESUMABLE fields of `train_overrides` change it, and
    `data` may name the run's prepared folder, moved; any other setting is refused, by name, with both
    values. `data` and `tokenizer` are as `train` takes them (None: not given)."""
    run_dir = Path(run_dir)
    try:
        header = load_header(run_dir, prefer=LAST)
    except ValueError as err:
        raise with_intact_best(Path(run_dir), err) from None
    require_architecture(architecture(header.model_config), run_dir, "decoder")
    prepared = data is not None and (Path(data) / "meta.json").is_file()
    changes = dict(train_overrides or {})
    if header.train_config is not None:  # else there is nothing to resume: `resume` says so
        layers = config_layers(preset, toml_path, model_overrides, train_overrides)
        changes, refused = resume_changes(header, layers)
        text = None if prepared else data
        refuse_changes(refused + source_changes(header, run_dir, text, tokenizer, vocab_size, init_from))
    return resume(run_dir, stop_at=stop_at, progress=progress, expect="decoder", changes=changes,
                  data=data if prepared else None)


def source_changes(header: Checkpoint, run_dir: Path, text: str | None, tokenizer: str | None,
                   vocab_size: int | None, init_from: str | Path | None) -> list[Change]:
    """The settings naming where the run's model, tokenizer and text come from (`init_from`, `tokenizer`,
    `vocab_size`, `text` as `train`'s data) that name something other than what the run was made from."""
    refused = []
    if init_from is not None:
        start = load_header(init_from)  # its vocabulary is its tokenizer's, compared below
        shape = {**start.model_config.to_dict(), "vocab_size": header.model_config.vocab_size}
        if shape != header.model_config.to_dict() or start.tokenizer != header.tokenizer:
            refused.append(Change(f"{{init_from}} {init_from} (another model or tokenizer than the run's)",
                                  {"init_from": "init_from"}))
    kind = header.tokenizer.get("kind")
    if tokenizer is not None and tokenizer != kind:
        refused.append(change("tokenizer", "tokenizer", kind, tokenizer))
    if vocab_size not in (None, header.model_config.vocab_size):
        refused.append(change("vocab_size", "vocab_size", header.model_config.vocab_size, vocab_size))
    if text is None:
        return refused  # a prepared folder is checked by `resume`: it must hold the run's tokenizer
    meta = json.loads((data_folder(run_dir, header.state) / "meta.json").read_text(encoding="utf-8"))
    source = meta.get("source")
    same = text == source or (text not in CORPORA and source not in CORPORA
                              and Path(text).resolve() == Path(str(source)).resolve())
    if not same:
        refused.append(change("data", "text", source, text))
    elif tokenizer is None and init_from is None and kind != "char":  # a new run would use char
        refused.append(Change(f"{{data}} {text} without {{tokenizer}} (char, but the run's tokenizer is "
                              f"{kind})", {"data": "data", "tokenizer": "tokenizer"}))
    return refused
