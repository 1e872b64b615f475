"""The `gptlab` command: a thin layer over the library, one subcommand per job.

Every subcommand is a small function over library calls; user mistakes (ValueError, missing files)
become one `gptlab: error: ...` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gptlab.config import Config, ModelConfig, TrainConfig

EXIT_USAGE = 2
EVAL_TOKENS = 2**18  # the final evaluation after training scores at most this many tokens


class TqdmHandler(logging.Handler):
    """Print log records above any progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        tqdm.write(self.format(record), file=sys.stdout)
        sys.stdout.flush()  # show progress promptly when stdout is a file or a pipe


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type[Config], title: str,
                         exclude: Sequence[str] = ()) -> None:
    """Add one `--field-name VALUE` option per config field; only options the user gives are kept."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
        if kind is bool:
            group.add_argument(
                flag, dest=field.name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )
        else:
            choices = field.metadata.get("choices")
            group.add_argument(
                flag, dest=field.name, type=kind, choices=choices,
                metavar="{" + ",".join(choices) + "}" if choices else kind.__name__.upper(),
                default=argparse.SUPPRESS, help=help_text,
            )


def config_overrides(args: argparse.Namespace, config_cls: type[Config]) -> dict[str, Any]:
    """The config fields the user set on the command line."""
    return {name: getattr(args, name) for name in config_cls.field_names() if hasattr(args, name)}


# --------------------------------------------------------------------------------------- commands


def cmd_lab(args: argparse.Namespace) -> int:
    """Run every worked example and property of the handout; non-zero exit if any fails."""
    from gptlab.lab import run_lab

    results = run_lab()
    width = max(len(r.name) for r in results)
    for r in results:
        verdict = "PASS" if r.passed else "FAIL"
        print(f"{verdict}  {r.section:<6} {r.name:<{width}}  expected {r.expected}  computed {r.computed}")
    failed = sum(not r.passed for r in results)
    print(f"\n{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


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
    from gptlab.data import prepare

    meta = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.tokenizer_vocab_size,
                   val_fraction=args.val_fraction, progress=not args.no_progress)
    tokens = meta["tokens"]
    print(f"wrote {args.out}: {tokens['train']:,} train and {tokens['val']:,} validation tokens, "
          f"{meta['tokenizer']} tokenizer with {meta['vocab_size']:,} ids")
    return 0


def data_folder(args: argparse.Namespace, out: Path) -> Path:
    """A prepared folder as given, or the corpus/text prepared into OUT/data."""
    from gptlab.data import prepare

    source = Path(args.data)
    if (source / "meta.json").is_file():
        return source
    print(f"preparing {args.data} with the {args.tokenizer} tokenizer into {out / 'data'}")
    prepare(args.data, out / "data", tokenizer=args.tokenizer, vocab_size=args.tokenizer_vocab_size,
            progress=not args.no_progress)
    return out / "data"


def cmd_train(args: argparse.Namespace) -> int:
    """Train a new run (or resume one), then report its evaluation and a few samples."""
    from gptlab.presets import resolve_configs
    from gptlab.train import resume, train

    out = Path(args.out)
    if args.resume:
        result = resume(out, stop_at=args.stop_at, progress=not args.no_progress)
    else:
        model_config, train_config = resolve_configs(
            args.preset, args.config, config_overrides(args, ModelConfig), config_overrides(args, TrainConfig)
        )
        if (out / "last.safetensors").exists():
            raise ValueError(f"{out} already holds a run: continue it with --resume, or choose another --out")
        data_dir = data_folder(args, out)
        print("model:", ", ".join(f"{k}={v}" for k, v in model_config.to_dict().items() if k != "vocab_size"))
        print("train:", ", ".join(f"{k}={v}" for k, v in train_config.to_dict().items()))
        result = train(out, data_dir, model_config, train_config, stop_at=args.stop_at,
                       progress=not args.no_progress)
    state = "interrupted at" if result.interrupted else "finished at"
    print(f"\n{state} step {result.step}: best validation loss {result.best_val_loss:.4f}, "
          f"{result.tokens_per_s:,.0f} tokens/s, {result.elapsed_s:.0f} s of training")
    print(f"run folder: {out} (best.safetensors, last.safetensors, metrics.csv, loss.png)")
    if result.interrupted:
        return 130
    print(f"best checkpoint on the {evaluation_line(out, 'val', max_tokens=EVAL_TOKENS)}")
    if args.samples:
        print_samples(out, "\n", args.samples, max_new_tokens=300, temperature=0.8, top_k=None, seed=0,
                      device="cpu")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Loss, perplexity and bits per character of a checkpoint on a split or any text."""
    print(evaluation_line(args.run, args.data, args.max_tokens))
    return 0


def evaluation_line(run: str | Path, data: str, max_tokens: int | None) -> str:
    """Evaluate a run's best checkpoint on `data` (train, val, or any text) and describe the result."""
    import dataclasses as dc

    from gptlab.checkpoint import load_checkpoint, load_run
    from gptlab.data import TokenData, load_text
    from gptlab.evaluate import evaluate_tokens

    model, tokenizer = load_run(run)
    if data in ("train", "val"):
        tokens = TokenData(load_checkpoint(run).state["data_dir"]).split(data)
        characters = len(tokens) if tokenizer.kind == "char" else None
        name = f"{data} split"
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


def print_samples(run: str | Path, prompt: str, num_samples: int, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, device: str) -> None:
    """Stream `num_samples` continuations of `prompt` to stdout as they are generated."""
    import torch

    from gptlab.checkpoint import load_run
    from gptlab.common import resolve_device
    from gptlab.generate import check_sampling, generate

    check_sampling(temperature, top_k, max_new_tokens)
    torch_device = resolve_device(device)
    model, tokenizer = load_run(run, torch_device)
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens: give a non-empty --prompt")
    generator = torch.Generator(torch_device).manual_seed(seed)
    for n in range(num_samples):
        print(f"--- sample {n + 1} ---")
        idx = torch.tensor([prompt_ids], device=torch_device)
        ids: list[int] = []
        shown = ""
        sys.stdout.write(prompt)
        for token in generate(model, idx, max_new_tokens, temperature, top_k, generator):
            ids.append(int(token))
            text = tokenizer.decode(ids)
            sys.stdout.write(text[len(shown):])  # print only what is new (multi-byte tokens complete late)
            sys.stdout.flush()
            shown = text
        print()


def cmd_sample(args: argparse.Namespace) -> int:
    """Print continuations of a prompt from a trained checkpoint."""
    print_samples(args.run, args.prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k,
                  args.seed, args.device)
    return 0


# ----------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptlab",
        description="Small decoder-only Transformer language models, verified against handout #11.",
        epilog="Start with `gptlab lab` to see the handout's numbers reproduced by the library.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
    add_data_commands(sub)
    return parser


def add_data_commands(sub: Any) -> None:
    """The prepare / train / eval / sample commands."""
    from gptlab.data import CORPORA
    from gptlab.presets import PRESETS
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
    add_tokenizer_options(prep, TOKENIZERS)
    prep.set_defaults(func=cmd_prepare)

    tr = sub.add_parser(
        "train", help="train a model (the main job)",
        description="Train a GPT on a corpus with teacher forcing. Settings are layered: defaults, "
        "then --preset, then --config FILE.toml ([model] and [train] tables), then options below. "
        "The run folder gets config.json, metrics.csv, loss.png, last.safetensors and "
        "best.safetensors. Ctrl-C saves and stops; --resume continues exactly.",
        epilog="example: gptlab train --preset demo --data shakespeare --out runs/demo",
    )
    tr.add_argument("--preset", choices=list(PRESETS), help="named settings to start from")
    tr.add_argument("--config", metavar="FILE.toml", help="TOML file with [model] and [train] tables")
    tr.add_argument("--data", default="shakespeare", help=source_help + ", or a prepared folder")
    tr.add_argument("--out", default="runs/latest", help="run folder (default: runs/latest)")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out from last.safetensors")
    tr.add_argument("--stop-at", type=int, metavar="STEP", help="stop (and save) at this step, keeping "
                    "the schedule of the full run; resume later with --resume")
    tr.add_argument("--samples", type=int, default=2, help="samples printed after training (default 2)")
    add_tokenizer_options(tr, TOKENIZERS)
    # vocab_size comes from the tokenizer (so --vocab-size is the tokenizer's); causal is never switched off
    add_config_arguments(tr, ModelConfig, "model options", exclude=("vocab_size", "causal"))
    add_config_arguments(tr, TrainConfig, "training options")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint",
                        description="Report the loss, perplexity and bits per character of a run's "
                        "best checkpoint on its train or val split, or on any text.")
    ev.add_argument("run", help="run folder or checkpoint file")
    ev.add_argument("--data", default="val", help="train, val, or " + source_help)
    ev.add_argument("--max-tokens", type=int, help="score at most this many tokens")
    ev.set_defaults(func=cmd_eval)

    sa = sub.add_parser("sample", help="generate text from a checkpoint",
                        description="Continue a prompt with a trained model, streaming the text.")
    sa.add_argument("run", help="run folder or checkpoint file")
    sa.add_argument("--prompt", default="\n", help="text to continue (cropped to the context window)")
    sa.add_argument("--max-new-tokens", type=int, default=300)
    sa.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random")
    sa.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    sa.add_argument("--seed", type=int, default=1337)
    sa.add_argument("--num-samples", type=int, default=1)
    sa.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto")
    sa.set_defaults(func=cmd_sample)


def add_tokenizer_options(parser: argparse.ArgumentParser, tokenizers: Sequence[str]) -> None:
    parser.add_argument("--tokenizer", choices=tokenizers, default="char", help="how text becomes ids")
    parser.add_argument("--vocab-size", type=int, dest="tokenizer_vocab_size", metavar="N",
                        help="vocabulary size of a trained bpe tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gptlab` console command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[TqdmHandler()], force=True)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, OSError) as err:
        print(f"gptlab: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gptlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
