"""The `gptlab seq2seq` commands: train an encoder-decoder on a built-in task, answer inputs, score it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptlab.cli.common import (
    COUNT,
    NATURAL,
    OutputFolder,
    RunPath,
    add_config_arguments,
    add_device_option,
    add_run_options,
    add_weight_options,
    config_overrides,
    print_configs,
    report_run,
)
from gptlab.config import SamplingConfig, Seq2SeqConfig, TaskConfig, TrainConfig

SHOWN_EXAMPLES = 5  # held-out examples printed after training
SAMPLE_DEFAULTS = {"temperature": 0.0}  # answers are greedy unless a temperature is given


def answer_lines(model: Any, vocab: Any, task: TaskConfig, sources: list[str],
                 sampling: SamplingConfig | None = None, use_cache: bool = True) -> list[str]:
    """`source -> answer` lines, each marked right or wrong against the task's true answer."""
    from gptlab.seq2seq import tasks
    from gptlab.seq2seq.model import decode_answers

    for source in sources:
        tasks.check_source(task, source, model.config.block_size)
    src = tasks.encode_sources(vocab, sources).to(next(model.parameters()).device)
    ids = decode_answers(model, src, tasks.BOS, tasks.EOS, sampling, use_cache=use_cache)
    answers = [vocab.decode(a) for a in ids]
    lines = []
    for source, answer in zip(sources, answers, strict=True):
        truth = tasks.get_task(task.task).answer(source)
        verdict = "right" if answer == truth else f"wrong, expected {truth}"
        lines.append(f"{source} -> {answer}  ({verdict})")
    return lines


def cmd_seq2seq_train(args: argparse.Namespace) -> int:
    """Train a new seq2seq run (or resume one), then report exact match and a few held-out answers."""
    from gptlab.checkpoint import LAST, has_checkpoint
    from gptlab.inference.loading import load_seq2seq
    from gptlab.seq2seq import tasks
    from gptlab.seq2seq.tasks import resolve_seq2seq_configs
    from gptlab.training import distributed
    from gptlab.training.loop import train_seq2seq
    from gptlab.training.resume import Change, refuse_changes, resume

    out = Path(args.out or f"runs/seq2seq-{args.task}")
    is_main = distributed.this_process().is_main
    repeated = not args.resume and has_checkpoint(out, LAST)  # the same command again continues its run
    if repeated:
        same_run(args, out)
        if is_main:
            print(f"note: {out} already holds this run: continuing it, as --resume would")
    elif args.resume:
        refuse_changes([Change("{setting}", {"setting": f"{config.__name__}.{name}"})
                        for config in (TaskConfig, Seq2SeqConfig) for name in config_overrides(args, config)])
    if args.resume or repeated:
        result = resume(out, stop_at=args.stop_at, progress=not args.no_progress, expect="encoder-decoder",
                        changes=config_overrides(args, TrainConfig))
    else:
        task, model, train = resolve_seq2seq_configs(
            args.task, config_overrides(args, TaskConfig), config_overrides(args, Seq2SeqConfig),
            config_overrides(args, TrainConfig))
        if is_main:
            print_configs({"task": task, "model": model, "train": train},
                          hidden=("vocab_size", "pad_id", "causal"))
        result = train_seq2seq(out, task, model, train, stop_at=args.stop_at, progress=not args.no_progress)
    if is_main:
        report_run(result, out)
    if not is_main or result.interrupted:
        return result.exit_status
    trained, vocab, task = load_seq2seq(out)
    import torch

    score = tasks.exact_match(trained, task, task.eval_examples, seed=0, device=torch.device("cpu"))
    print(f"best checkpoint: {score:.1%} exact match on {task.eval_examples} held-out {task.task} examples")
    shown = tasks.draw_sources(task, torch.Generator().manual_seed(1), SHOWN_EXAMPLES, held_out=True)
    print("\n".join(answer_lines(trained, vocab, task, shown)))
    return 0


def same_run(args: argparse.Namespace, out: Path) -> None:
    """Refuse to continue the run in `out` with other task or model settings than the ones it was started
    with (the same command again continues it; another one would change it)."""
    from gptlab.checkpoint import LAST, load_header
    from gptlab.seq2seq.tasks import resolve_seq2seq_configs

    header = load_header(out, prefer=LAST)
    task, model, _ = resolve_seq2seq_configs(args.task, config_overrides(args, TaskConfig),
                                             config_overrides(args, Seq2SeqConfig), {})
    saved = header.model_config
    if task.to_dict() != header.state.get("task") or model.replace(vocab_size=saved.vocab_size) != saved:
        raise ValueError(f"{out} holds a seq2seq run with other task or model settings than these: continue "
                         "it with --resume (its own settings), or choose another --out")


def cmd_seq2seq_sample(args: argparse.Namespace) -> int:
    """Answer each --input with the trained model (greedy decoding)."""
    from gptlab.common import resolve_device
    from gptlab.inference.loading import load_seq2seq

    model, vocab, task = load_seq2seq(args.run, resolve_device(args.device), args.dtype, args.quantize)
    sampling = SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **config_overrides(args, SamplingConfig)})
    print("\n".join(answer_lines(model, vocab, task, args.input, sampling, args.use_cache)))
    return 0


def cmd_seq2seq_eval(args: argparse.Namespace) -> int:
    """Exact match on held-out examples (sources never trained on, of the trained lengths)."""
    from gptlab.common import resolve_device
    from gptlab.inference.loading import load_seq2seq
    from gptlab.seq2seq import tasks

    model, _, task = load_seq2seq(args.run, resolve_device(args.device), args.dtype, args.quantize)
    if args.examples < 1:
        raise ValueError(f"--examples={args.examples} must be at least 1")
    device = next(model.parameters()).device
    overall = tasks.exact_match(model, task, args.examples, seed=args.seed, device=device)
    print(f"{args.run}: {overall:.2%} exact match on {args.examples} held-out {task.task} examples "
          f"(lengths {task.min_len}-{task.max_len})")
    return 0


def preset_defaults(group: str) -> dict[str, str]:
    """The defaults the task presets give a config group's fields, for --help ("2" or "reverse 1500, ...")."""
    from gptlab.seq2seq.presets import SEQ2SEQ_PRESETS

    names = {name for preset in SEQ2SEQ_PRESETS.values() for name in preset[group]}
    shown = {}
    for name in sorted(names):
        values = {task: preset[group].get(name) for task, preset in SEQ2SEQ_PRESETS.items()}
        same = len(set(values.values())) == 1
        shown[name] = str(next(iter(values.values()))) if same else ", ".join(
            f"{task} {value}" for task, value in values.items())
    return shown


def add_seq2seq_commands(sub: Any) -> None:
    """`gptlab seq2seq train | sample | eval`."""
    from gptlab.config import TASKS

    group = sub.add_parser(
        "seq2seq", help="encoder-decoder models on built-in tasks (reverse, sort, add)",
        description="Train and use an encoder-decoder Transformer built from the same blocks as the GPT, "
        "with cross-attention from the decoder to the encoder's output. Tasks are generated on the fly; "
        "about 1 in 20 sources is held out of training and used to measure exact match.",
        epilog="example: gptlab seq2seq train --task reverse && gptlab seq2seq sample "
        "runs/seq2seq-reverse --input transformer && gptlab attention runs/seq2seq-reverse "
        "--prompt transformer --out cross.png",
    )
    commands = group.add_subparsers(dest="seq2seq_command", metavar="COMMAND", required=True)

    tr = commands.add_parser(
        "train", help="train on a task with teacher forcing",
        description="Train an encoder-decoder on a built-in task with teacher forcing, reporting the "
        "held-out loss and exact match at every evaluation. Settings: the task's preset, then the "
        "options below; block_size fits the task's longest example unless given. Ctrl-C saves and stops; "
        "--resume continues exactly.",
        epilog="example: gptlab seq2seq train --task add --max-len 3 --out runs/add3",
    )
    tr.add_argument("--task", choices=TASKS, default="reverse", help="the task (default reverse)")
    tr.add_argument("--out", type=OutputFolder(), help="run folder (default: runs/seq2seq-TASK)")
    add_run_options(tr)
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(tr, TaskConfig, "task options", exclude=("task",), defaults=preset_defaults("task"))
    excluded = ("vocab_size", "causal", "pad_id")  # set by the task's vocabulary; the decoder stays causal
    model_defaults = {**preset_defaults("model"), "block_size": "fits the task's longest example"}
    add_config_arguments(tr, Seq2SeqConfig, "model options", exclude=excluded, defaults=model_defaults)
    add_config_arguments(tr, TrainConfig, "training options", defaults=preset_defaults("train"))
    tr.set_defaults(func=cmd_seq2seq_train)

    sa = commands.add_parser("sample", help="answer inputs with a trained model",
                             description="Answer each input (greedily unless --temperature is given), "
                             "encoding it once and decoding with a KV cache, and say whether the answer is "
                             "right.",
                             epilog="example: gptlab seq2seq sample runs/seq2seq-reverse --input gptlab "
                             "--input attention")
    sa.add_argument("run", type=RunPath(), help="seq2seq run folder or checkpoint file")
    sa.add_argument("--input", required=True, action="append", help="a source to answer; repeatable")
    sa.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                    help="recompute the whole answer at every step (the reference decoder)")
    add_config_arguments(sa, SamplingConfig, "sampling options", exclude=("stop",), defaults=SAMPLE_DEFAULTS)
    add_device_option(sa)
    add_weight_options(sa)
    sa.set_defaults(func=cmd_seq2seq_sample)

    ev = commands.add_parser("eval", help="exact match on held-out examples",
                             description="Decode held-out examples (never seen in training) and report the "
                             "share answered exactly right.")
    ev.add_argument("run", type=RunPath(), help="seq2seq run folder or checkpoint file")
    ev.add_argument("--examples", type=COUNT, default=2000, help="held-out examples to decode (default 2000)")
    ev.add_argument("--seed", type=NATURAL, default=0, help="which held-out examples (default 0)")
    add_device_option(ev)
    add_weight_options(ev)
    ev.set_defaults(func=cmd_seq2seq_eval)

