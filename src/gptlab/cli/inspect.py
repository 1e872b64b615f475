"""The attention / ablate / intervene / verify commands: look inside a trained model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptlab.cli.common import add_device_option

DTYPES = ("float32", "bfloat16")  # weight precisions for running a trained model


def load_prompt(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    """The model and tokenizer of `args.run` on `args.device`, and the token ids of `args.prompt`."""
    from gptlab.checkpoint import load_run
    from gptlab.common import resolve_device
    from gptlab.inspection.tokens import encode_prompt

    model, tokenizer = load_run(args.run, resolve_device(args.device))
    return model, tokenizer, encode_prompt(tokenizer, args.prompt, model.config.block_size)


def cmd_attention(args: argparse.Namespace) -> int:
    """Draw a prompt's attention weights as a PNG grid or an interactive HTML page."""
    from gptlab.checkpoint import checkpoint_architecture
    from gptlab.inspection.attention_view import attention_maps, save_attention_html, save_attention_png

    out = Path(args.out)
    if out.suffix.lower() not in (".png", ".html"):
        raise ValueError(f"--out {args.out} must end in .png (a picture) or .html (an interactive page)")
    if checkpoint_architecture(args.run) == "encoder-decoder":
        return draw_cross_attention(args, out)
    model, tokenizer, ids = load_prompt(args)
    maps = attention_maps(model, tokenizer, args.prompt, ids, args.layer, args.head)
    if out.suffix.lower() == ".png":
        save_attention_png(maps, out)
    else:
        save_attention_html(maps, tokenizer, out)
    print(f"wrote {out}: {len(maps.layers)} layer(s) x {len(maps.heads)} head(s) over {len(ids)} tokens")
    return 0


def draw_cross_attention(args: argparse.Namespace, out: Path) -> int:
    """A seq2seq run: draw where each answer token looked in the source (--prompt is the source)."""
    from gptlab.checkpoint import load_seq2seq
    from gptlab.common import resolve_device
    from gptlab.inspection.cross_attention import cross_attention_maps, save_cross_attention_png

    if out.suffix.lower() != ".png":
        raise ValueError(f"--out {args.out}: a seq2seq run's cross-attention is drawn as a picture; "
                         "give --out FILE.png")
    model, vocab, task = load_seq2seq(args.run, resolve_device(args.device))
    maps = cross_attention_maps(model, vocab, task, args.prompt, args.layer, args.head)
    save_cross_attention_png(maps, out)
    print(f"wrote {out}: cross-attention of {len(maps.layers)} layer(s) x {len(maps.heads)} head(s), "
          f"{maps.source!r} -> {maps.answer!r}")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    """Remove each head in turn and print the change in log-probability of the target next token."""
    import math

    from gptlab.inspection.interventions import ablate_heads, save_ablation_png
    from gptlab.inspection.tokens import encode_token, token_label

    if Path(args.out).suffix.lower() != ".png":
        raise ValueError(f"--out {args.out} must end in .png: the heatmap is written as a PNG picture")
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
    import copy

    import torch

    from gptlab.checkpoint import architecture, load_checkpoint
    from gptlab.checks import failed
    from gptlab.common import resolve_device
    from gptlab.inspection.verify import verify_model
    from gptlab.inspection.verify_seq2seq import verify_seq2seq

    # Only the weights: the checks use random token ids, so a run needs no working tokenizer here.
    checkpoint = load_checkpoint(args.run)
    model = checkpoint.build_model().to(resolve_device(args.device)).eval()
    if architecture(checkpoint.model_config) == "encoder-decoder":
        properties = verify_seq2seq(model, seed=args.seed)
    elif args.dtype == "float32":
        properties = verify_model(model, seed=args.seed)
    else:  # the properties on the reduced-precision model, and its logits against float32
        reduced = copy.deepcopy(model).to(getattr(torch, args.dtype))
        properties = verify_model(reduced, seed=args.seed, reference=model)
    width = max(len(p.name) for p in properties)
    print(f"{'result':<6} {'section':<7} {'property':<{width}} {'deviation':>10} {'tolerance':>10}  note")
    for p in properties:
        numbers = "".join(f" {'-' if v is None else f'{v:.1e}':>10}" for v in (p.deviation, p.tolerance))
        print(f"{p.verdict:<6} {p.section:<7} {p.name:<{width}}{numbers}  {p.note}")
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
        add_device_option(parser)
        return parser

    at = command("attention", "draw a prompt's attention weights (PNG grid or HTML page)",
                 "Draw the attention weights of every head on a prompt: FILE.png is a grid of heatmaps "
                 "(layers down, heads across; rows are queries, columns keys, labelled with the tokens); "
                 "FILE.html is a self-contained page where you pick a layer and head and hover a token to "
                 "see where it attends and what the model predicts next. The forward pass keeps the fast "
                 "kernel; the weights are recomputed only for the layers and heads drawn. For a seq2seq run "
                 "(gptlab seq2seq train), --prompt is the source and FILE.png shows cross-attention: rows "
                 "are the answer's tokens, columns the source's.")
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
                 "without positions, permutation equivariance of the unmasked stack (§6.1). On a seq2seq "
                 "run: rows (cross-attention too), padding ignored exactly, decoder causality, every "
                 "target position reading every source token, cached = recomputed decoding, tying. Exits "
                 "1 if any fails.", prompt=False)
    ve.add_argument("--seed", type=int, default=0, help="seed of the random test prompts (default 0)")
    ve.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="check the model in this precision; bfloat16 adds its logits' difference to "
                    "float32, and tolerances follow the dtype's epsilon (default float32)")
    ve.set_defaults(func=cmd_verify)
