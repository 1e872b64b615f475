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


def data_folder(args: argparse.Namespace, out: Path, is_main: bool) -> Path:
    """A prepared folder as given, or the corpus/text prepared (by rank 0) into OUT/data."""
    from gptlab import distributed
    from gptlab.checkpoint import load_checkpoint
    from gptlab.data import prepare
    from gptlab.tokenizer import tokenizer_from_dict

    if (Path(args.data) / "meta.json").is_file():
        return Path(args.data)
    tokenizer = args.tokenizer
    if args.init_from:  # fine-tuning: the text must be tokenized exactly as the checkpoint was
        tokenizer = tokenizer_from_dict(load_checkpoint(args.init_from).tokenizer)
    if is_main:
        which = f"the {tokenizer}" if isinstance(tokenizer, str) else "the checkpoint's"
        print(f"preparing {args.data} with {which} tokenizer into {out / 'data'}")
        prepare(args.data, out / "data", tokenizer=tokenizer, vocab_size=args.tokenizer_vocab_size,
                progress=not args.no_progress)
    distributed.barrier()  # under torchrun the other ranks wait for rank 0's data
    return out / "data"


def cmd_train(args: argparse.Namespace) -> int:
    """Train a new run (or resume one), then report its evaluation and a few samples.

    Under torchrun every process runs this; rank 0 prepares the data and does all the printing.
    """
    from gptlab import distributed
    from gptlab.presets import resolve_configs
    from gptlab.train import resume, train

    out = Path(args.out)
    try:
        if args.resume:
            result = resume(out, stop_at=args.stop_at, progress=not args.no_progress)
            is_main = distributed.setup("auto")[0].is_main
        else:
            model_overrides = config_overrides(args, ModelConfig)
            if args.init_from and model_overrides:
                flags = ", ".join("--" + name.replace("_", "-") for name in model_overrides)
                raise ValueError(f"--init-from takes the model from the checkpoint: {flags} cannot change it")
            model_config, train_config = resolve_configs(
                args.preset, args.config, model_overrides, config_overrides(args, TrainConfig)
            )
            if (out / "last.safetensors").exists():
                raise ValueError(f"{out} already holds a run: continue it with --resume, or choose another "
                                 "--out")
            is_main = distributed.setup(train_config.device)[0].is_main
            data_dir = data_folder(args, out, is_main)
            if is_main:
                print("model:", ", ".join(f"{k}={v}" for k, v in model_config.to_dict().items()
                                          if k != "vocab_size"))
                print("train:", ", ".join(f"{k}={v}" for k, v in train_config.to_dict().items()))
            result = train(out, data_dir, model_config, train_config, stop_at=args.stop_at,
                           progress=not args.no_progress, init_from=args.init_from)
    finally:
        distributed.shutdown()
    if not is_main:
        return 130 if result.interrupted else 0
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
        data_dir = load_checkpoint(run).state.get("data_dir")
        if data_dir is None:
            raise ValueError(f"{run} was not trained by gptlab, so it has no {data} split: "
                             "evaluate it on a text with --data FILE")
        tokens = TokenData(data_dir).split(data)
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


def print_samples(run: str | Path, prompt: str, num_samples: int, *, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, device: str, top_p: float = 1.0, stop: Sequence[str] = (),
                  use_cache: bool = True, as_json: bool = False) -> None:
    """Stream `num_samples` continuations of `prompt` to stdout, or print one JSON line per sample."""
    import json
    import time

    import torch

    from gptlab.checkpoint import load_run
    from gptlab.common import resolve_device
    from gptlab.generate import check_sampling, stream_text

    check_sampling(temperature, top_k, max_new_tokens, top_p)
    if num_samples < 1:
        raise ValueError(f"--num-samples={num_samples} must be at least 1")
    torch_device = resolve_device(device)
    model, tokenizer = load_run(run, torch_device)
    generator = torch.Generator(torch_device).manual_seed(seed)
    for n in range(num_samples):
        begin = time.perf_counter()
        # stream_text checks the prompt and the stop strings before anything is printed
        chunks = stream_text(model, tokenizer, prompt, max_new_tokens, temperature, top_k, generator,
                             top_p=top_p, stop=stop, use_cache=use_cache)
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
    """Print continuations of a prompt (or of a file's text) from a trained checkpoint."""
    prompt = args.prompt if args.prompt_file is None else Path(args.prompt_file).read_text(encoding="utf-8")
    print_samples(args.run, prompt, args.num_samples, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, stop=args.stop or (),
                  seed=args.seed, device=args.device, use_cache=args.use_cache, as_json=args.json)
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
    add_hf_commands(sub)
    add_inspect_commands(sub)
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
    tr.add_argument("--init-from", metavar="RUN", help="fine-tune: start from this run's (or an imported "
                    "model's) weights and architecture, tokenizing --data with its tokenizer")
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
                        description="Continue a prompt with a trained model, streaming the text. Generation "
                        "stops at the end-of-text token, a --stop string (not printed) or --max-new-tokens.",
                        epilog="example: gptlab sample runs/demo --prompt ROMEO: --top-p 0.9 "
                        "--stop $'\\n\\n'")
    sa.add_argument("run", help="run folder or checkpoint file")
    source = sa.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="\n", help="text to continue (cropped to the context window)")
    source.add_argument("--prompt-file", metavar="FILE", help="continue the text of this UTF-8 file instead")
    sa.add_argument("--max-new-tokens", type=int, default=300)
    sa.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random")
    sa.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    sa.add_argument("--top-p", type=float, default=1.0, metavar="P",
                    help="sample only among the fewest tokens whose probability reaches P (default 1: all)")
    sa.add_argument("--stop", nargs="+", action="extend", metavar="S",
                    help="stop before any of these strings (repeatable); they are not printed")
    sa.add_argument("--seed", type=int, default=1337)
    sa.add_argument("--num-samples", type=int, default=1)
    sa.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                    help="recompute every step without the KV cache (the slow reference loop)")
    sa.add_argument("--json", action="store_true", help="print one JSON object per sample: prompt, "
                    "completion, tokens, stop_reason, tokens_per_s")
    sa.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto")
    sa.set_defaults(func=cmd_sample)


def add_tokenizer_options(parser: argparse.ArgumentParser, tokenizers: Sequence[str]) -> None:
    parser.add_argument("--tokenizer", choices=tokenizers, default="char", help="how text becomes ids")
    parser.add_argument("--vocab-size", type=int, dest="tokenizer_vocab_size", metavar="N",
                        help="vocabulary size of a trained bpe tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Write a run as a Hugging Face GPT-2 folder."""
    from gptlab.convert import export_hf

    result = export_hf(args.run, args.out_dir)
    loader = f"transformers.GPT2LMHeadModel.from_pretrained({str(result.out_dir)!r})"
    report_conversion(result, f"load it with {loader}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    """Read a local Hugging Face GPT-2 folder into a gptlab run folder."""
    from gptlab.convert import import_hf

    result = import_hf(args.hf_dir, args.out_dir)
    report_conversion(result, f"try it: gptlab sample {result.out_dir}")
    return 0


def report_conversion(result: Any, next_step: str) -> None:
    """What a conversion wrote, its notes, and what to do next."""
    print(f"wrote {result.out_dir}: {', '.join(result.files)}")
    for note in result.notes:
        print(f"note: {note}")
    print(next_step)


def add_hf_commands(sub: Any) -> None:
    """The export-hf / import-hf commands (Hugging Face GPT-2 folders)."""
    ex = sub.add_parser(
        "export-hf", help="write a run as a Hugging Face GPT-2 folder",
        description="Write a run's best checkpoint as OUT_DIR/config.json and model.safetensors, which "
        "transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR) loads, plus tokenizer files for "
        "AutoTokenizer when the run used the bpe or gpt2 tokenizer. Only GPT-2-shaped models export "
        "(learned positions, layernorm, gelu, pre-norm, tied head, biases).",
    )
    ex.add_argument("run", help="run folder or checkpoint file")
    ex.add_argument("out_dir", help="new or empty folder to write")
    ex.set_defaults(func=cmd_export_hf)

    im = sub.add_parser(
        "import-hf", help="read a local Hugging Face GPT-2 folder into a run folder",
        description="Read HF_DIR (config.json with model.safetensors or pytorch_model.bin, and "
        "tokenizer.json or vocab.json + merges.txt) into a gptlab run folder that sample, eval and "
        "the other commands accept. Nothing is downloaded.",
    )
    im.add_argument("hf_dir", help="folder written by save_pretrained")
    im.add_argument("out_dir", help="new or empty run folder to write")
    im.set_defaults(func=cmd_import_hf)


# ------------------------------------------------------------------------------------- inspection


def load_prompt(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    """The model and tokenizer of `args.run` on `args.device`, and the token ids of `args.prompt`."""
    from gptlab.checkpoint import load_run
    from gptlab.common import resolve_device
    from gptlab.inspection.tokens import encode_prompt

    model, tokenizer = load_run(args.run, resolve_device(args.device))
    return model, tokenizer, encode_prompt(tokenizer, args.prompt, model.config.block_size)


def cmd_attention(args: argparse.Namespace) -> int:
    """Draw a prompt's attention weights as a PNG grid or an interactive HTML page."""
    from gptlab.inspection.attention_view import attention_maps, save_attention_html, save_attention_png

    out = Path(args.out)
    if out.suffix.lower() not in (".png", ".html"):
        raise ValueError(f"--out {args.out} must end in .png (a picture) or .html (an interactive page)")
    model, tokenizer, ids = load_prompt(args)
    maps = attention_maps(model, tokenizer, args.prompt, ids, args.layer, args.head)
    if out.suffix.lower() == ".png":
        save_attention_png(maps, out)
    else:
        save_attention_html(maps, tokenizer, out)
    print(f"wrote {out}: {len(maps.layers)} layer(s) x {len(maps.heads)} head(s) over {len(ids)} tokens")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    """Remove each head in turn and print the change in log-probability of the target next token."""
    import math

    from gptlab.inspection.interventions import ablate_heads, save_ablation_png
    from gptlab.inspection.tokens import encode_token, token_label

    model, tokenizer, ids = load_prompt(args)
    target = None if args.target is None else encode_token(tokenizer, args.target, "--target")
    result = ablate_heads(model, ids, target)
    label = token_label(tokenizer, result.target)
    print(f"target next token '{label}': log p = {result.logprob:.4f} (p = {math.exp(result.logprob):.4f}) "
          "with every head")
    print(f"change in log p when one head is removed, largest drop under {args.sort} ablation first:")
    print(f"{'layer':>5} {'head':>4} {'zero':>9} {'mean':>9}")
    for effect in result.ranked(args.sort):
        print(f"{effect.layer:>5} {effect.head:>4} {effect.zero:>+9.4f} {effect.mean:>+9.4f}")
    save_ablation_png(result, label, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_intervene(args: argparse.Namespace) -> int:
    """Replace or drop prompt tokens and compare the next-token prediction before and after."""
    from gptlab.inspection.interventions import intervene
    from gptlab.inspection.tokens import encode_token, parse_replacement, token_label

    if not args.replace and not args.drop:
        raise ValueError("nothing to change: give --replace POS=TOKEN or --drop POS (both repeatable)")
    model, tokenizer, ids = load_prompt(args)
    replace = [(pos, encode_token(tokenizer, text, "--replace"))
               for pos, text in map(parse_replacement, args.replace)]
    result = intervene(model, ids, replace, args.drop)
    for pos, token in replace:
        print(f"replaced position {pos % len(ids)}: '{token_label(tokenizer, ids[pos])}' -> "
              f"'{token_label(tokenizer, token)}'")
    for pos in args.drop:
        print(f"dropped position {pos % len(ids)}: '{token_label(tokenizer, ids[pos])}'")
    print(f"before: {tokenizer.decode(result.before)!r} ({len(result.before)} tokens)")
    print(f"after:  {tokenizer.decode(result.after)!r} ({len(result.after)} tokens)")
    print(f"\n{'next token':<14} {'p before':>9} {'p after':>9} {'change':>9}")
    for token, before, after in result.top(args.top):
        label = f"'{token_label(tokenizer, token)}'"
        print(f"{label:<14} {before:>9.4f} {after:>9.4f} {after - before:>+9.4f}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Measure the handout's properties on a trained model; non-zero exit if any fails."""
    from gptlab.checkpoint import load_checkpoint
    from gptlab.common import resolve_device
    from gptlab.inspection.verify import failed, verify_model

    # Only the weights: the checks use random token ids, so a run needs no working tokenizer here.
    model = load_checkpoint(args.run).build_model().to(resolve_device(args.device)).eval()
    properties = verify_model(model, seed=args.seed)
    width = max(len(p.name) for p in properties)
    print(f"{'result':<6} {'section':<7} {'property':<{width}} {'deviation':>10} {'tolerance':>10}  note")
    for p in properties:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[p.passed]
        numbers = "".join(f" {'-' if v is None else f'{v:.1e}':>10}" for v in (p.deviation, p.tolerance))
        print(f"{verdict:<6} {p.section:<7} {p.name:<{width}}{numbers}  {p.note}")
    bad = failed(properties)
    print(f"\n{len(properties) - len(bad)} of {len(properties)} hold or do not apply, {len(bad)} failed")
    return 1 if bad else 0


def add_inspect_commands(sub: Any) -> None:
    """The attention / ablate / intervene / verify commands: look inside a trained model (handout §2.2)."""

    def command(name: str, help: str, description: str, prompt: bool = True) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, description=description)
        parser.add_argument("run", help="run folder or checkpoint file (from gptlab train or import-hf)")
        if prompt:
            parser.add_argument("--prompt", required=True,
                                help="the text to inspect; at most block_size tokens, never cropped")
        parser.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default cpu)")
        return parser

    at = command("attention", "draw a prompt's attention weights (PNG grid or HTML page)",
                 "Draw the attention weights of every head on a prompt: FILE.png is a grid of heatmaps "
                 "(layers down, heads across; rows are queries, columns keys, labelled with the tokens); "
                 "FILE.html is a self-contained page where you pick a layer and head and hover a token to "
                 "see where it attends and what the model predicts next. The forward pass keeps the fast "
                 "kernel; the weights are recomputed only for the layers and heads drawn.")
    at.add_argument("--out", required=True, metavar="FILE.png|FILE.html", help="the picture or page to write")
    at.add_argument("--layer", type=int, help="draw only this layer (default: all)")
    at.add_argument("--head", type=int, help="draw only this head (default: all)")
    at.set_defaults(func=cmd_attention)

    ab = command("ablate", "remove each head and measure the change in the next token's log-probability",
                 "For every head, remove it and report the change in log p(target) after the prompt's "
                 "last token: zero ablation sets the head's output (its slice of W_O's input) to zero; "
                 "mean ablation sets it to its mean over the prompt's positions. Prints a sorted table and "
                 "writes a layer x head heatmap of both.")
    ab.add_argument("--target", help="the next token to score, as text that is exactly one token "
                    "(default: the model's own top prediction)")
    ab.add_argument("--sort", choices=("zero", "mean"), default="zero",
                    help="which ablation orders the table (default zero)")
    ab.add_argument("--out", default="ablation.png", metavar="FILE.png",
                    help="the heatmap to write (default ablation.png)")
    ab.set_defaults(func=cmd_ablate)

    iv = command("intervene", "replace or drop prompt tokens and compare the prediction",
                 "Replace or drop tokens of the prompt and print the next-token probabilities after its "
                 "last token before and after: the handout's test of a causal claim (§2.2). Positions are "
                 "token indices from 0; negative ones count from the end (write --replace=-1=x).")
    iv.add_argument("--replace", action="append", default=[], metavar="POS=TOKEN",
                    help="put TOKEN (text that is exactly one token) at position POS; repeatable")
    iv.add_argument("--drop", action="append", default=[], type=int, metavar="POS",
                    help="remove the token at position POS; repeatable")
    iv.add_argument("--top", type=int, default=5,
                    help="how many of the likeliest tokens to show, before and after (default 5)")
    iv.set_defaults(func=cmd_intervene)

    ve = command("verify", "measure the handout's properties on a trained model", "Run the handout's "
                 "properties on the model and print each one's measured deviation: attention rows sum to "
                 "one (§3.2); logits at i ignore every later input, exactly (§7.3); cached = uncached "
                 "generation (§7.1); fused = separate projections (§4.2); a tied head is one tensor (§6); "
                 "without positions, permutation equivariance of the unmasked stack (§6.1). Exits 1 if "
                 "any fails.", prompt=False)
    ve.add_argument("--seed", type=int, default=0, help="seed of the random test prompts (default 0)")
    ve.set_defaults(func=cmd_verify)


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
