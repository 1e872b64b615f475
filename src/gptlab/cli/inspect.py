"""The attention / ablate / intervene / verify / lens / patch / heads commands: look inside a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gptlab.cli.common import (
    COUNT,
    NATURAL,
    Bounded,
    OutputFile,
    RunPath,
    add_device_option,
    check_out,
    note_long_prompt,
)
from gptlab.config import DETECTORS, DTYPES


def load_prompt(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    """The model and tokenizer of `args.run` on `args.device`, and the token ids of `args.prompt`."""
    from gptlab.inference.loading import load
    from gptlab.inspection.tokens import encode_prompt

    lm = load(args.run, device=args.device)

    model, tokenizer = lm.model, lm.tokenizer
    return model, tokenizer, encode_prompt(tokenizer, args.prompt, model.config.block_size)


def load_prompt_end(args: argparse.Namespace) -> tuple[Any, Any, list[int], str]:
    """As load_prompt, for a command that names no position: the ids of the last block_size tokens of a
    longer `args.prompt` (after a note saying so) and their text."""
    from gptlab.inference.loading import load
    from gptlab.inspection.tokens import prompt_window

    lm = load(args.run, device=args.device)

    model, tokenizer = lm.model, lm.tokenizer
    ids, left_out = prompt_window(tokenizer, args.prompt, model.config.block_size)
    if not left_out:
        return model, tokenizer, ids, args.prompt
    note_long_prompt(len(ids) + left_out, len(ids))
    return model, tokenizer, ids, tokenizer.decode(ids)


def cmd_attention(args: argparse.Namespace) -> int:
    """Draw a prompt's attention weights as a PNG grid or an interactive HTML page."""
    from gptlab.checkpoint import checkpoint_architecture
    from gptlab.inspection.attention_view import attention_maps, save_attention_html, save_attention_png

    out = Path(args.out)
    if out.suffix.lower() not in (".png", ".html"):
        raise ValueError(f"--out {args.out} must end in .png (a picture) or .html (an interactive page)")
    check_out(out, args.force)
    if checkpoint_architecture(args.run) == "encoder-decoder":
        return draw_cross_attention(args, out)
    model, tokenizer, ids, prompt = load_prompt_end(args)
    maps = attention_maps(model, tokenizer, prompt, ids, args.layer, args.head)
    if out.suffix.lower() == ".png":
        save_attention_png(maps, out)
    else:
        save_attention_html(maps, tokenizer, out)
    print(f"wrote {out}: {len(maps.layers)} layer(s) x {len(maps.heads)} head(s) over {len(ids)} tokens")
    return 0


def draw_cross_attention(args: argparse.Namespace, out: Path) -> int:
    """A seq2seq run: draw where each answer token looked in the source (--prompt is the source)."""
    from gptlab.common import resolve_device
    from gptlab.inference.loading import load_seq2seq
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
    check_out(Path(args.out), args.force)
    model, tokenizer, ids, _ = load_prompt_end(args)
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

    from gptlab.checkpoint import load_checkpoint
    from gptlab.common import resolve_device
    from gptlab.handout.properties import failed
    from gptlab.handout.verify import verify_model
    from gptlab.handout.verify_finetune import measured_model, verify_finetuned
    from gptlab.handout.verify_seq2seq import verify_seq2seq
    from gptlab.seq2seq.model import EncoderDecoder

    # The handout's checks use random token ids; only a fine-tuned run's data checks read its tokenizer.
    checkpoint = load_checkpoint(args.run)
    model = checkpoint.build_model().to(resolve_device(args.device)).eval()
    if isinstance(model, EncoderDecoder):
        properties = verify_seq2seq(model, seed=args.seed)
    else:
        measured = measured_model(model)  # an adapter run's merged copy
        if measured is not model:
            print("note: an adapter run: the handout's properties are measured on its merged weights")
        if args.dtype == "float32":
            properties = verify_model(measured, seed=args.seed)
        else:  # the properties on the reduced-precision model, and its logits against float32
            reduced = copy.deepcopy(measured).to(getattr(torch, args.dtype))
            properties = verify_model(reduced, seed=args.seed, reference=measured)
        properties += verify_finetuned(checkpoint, model, seed=args.seed)  # float32, whatever --dtype says
    width = max(len(p.name) for p in properties)
    print(f"{'result':<6} {'section':<7} {'property':<{width}} {'deviation':>10} {'tolerance':>10}  note")
    for p in properties:
        numbers = "".join(f" {'-' if v is None else f'{v:.1e}':>10}" for v in (p.deviation, p.tolerance))
        print(f"{p.verdict:<6} {p.section:<7} {p.name:<{width}}{numbers}  {p.note}")
    bad = failed(properties)
    print(f"\n{len(properties) - len(bad)} of {len(properties)} hold or do not apply, {len(bad)} failed")
    return 1 if bad else 0


def cmd_lens(args: argparse.Namespace) -> int:
    """Read every stage's residual stream through the final norm and head: a table and a heatmap."""
    from gptlab.inspection.lens import lens_table, logit_lens, save_lens_html, save_lens_png
    from gptlab.inspection.tokens import resolve_position, token_label

    out = Path(args.out)
    if out.suffix.lower() not in (".png", ".html"):
        raise ValueError(f"--out {args.out} must end in .png (a heatmap) or .html (a table to hover)")
    check_out(out, args.force)
    model, tokenizer, ids = load_prompt(args)
    position = None if args.position is None else resolve_position(args.position, len(ids), "--position")
    lens = logit_lens(model, tokenizer, args.prompt, ids)
    if position is None:
        print("\n".join(lens_table(lens, tokenizer)))
        print("each stage: its top prediction, then the probability of the token that actually comes next")
    else:
        following = f" (next in the prompt: '{lens.labels[position + 1]}')" if position + 1 < len(ids) else ""
        print(f"position {position}, token '{lens.labels[position]}'{following}: top {lens.top_ids.size(-1)} "
              "predictions at each stage")
        for s, stage in enumerate(lens.stages):
            pairs = zip(lens.top_ids[s, position], lens.top_probs[s, position], strict=True)
            tops = "  ".join(f"'{token_label(tokenizer, int(t))}' {float(p):.3f}" for t, p in pairs)
            print(f"{stage:>9}: {tops}")
    if out.suffix.lower() == ".png":
        save_lens_png(lens, tokenizer, out)
    else:
        save_lens_html(lens, tokenizer, out)
    print(f"wrote {out}")
    return 0


def cmd_patch(args: argparse.Namespace) -> int:
    """Patch clean values into a corrupted run; print and draw how much of the difference each restores."""
    from gptlab.inference.loading import load
    from gptlab.inspection.patching import check_same_length, patch_activations, save_patching_png
    from gptlab.inspection.tokens import encode_prompt, encode_token, token_label, token_labels

    if Path(args.out).suffix.lower() != ".png":
        raise ValueError(f"--out {args.out} must end in .png: the heatmaps are written as a PNG picture")
    check_out(Path(args.out), args.force)
    lm = load(args.run, device=args.device)
    model, tokenizer = lm.model, lm.tokenizer
    block = model.config.block_size
    clean = encode_prompt(tokenizer, args.clean, block, "--clean")
    corrupt = encode_prompt(tokenizer, args.corrupt, block, "--corrupt")
    check_same_length(clean, corrupt)
    target, foil = (None if text is None else encode_token(tokenizer, text, option)
                    for text, option in ((args.target, "--target"), (args.foil, "--foil")))
    result = patch_activations(model, clean, corrupt, target, foil)
    target_label, foil_label = token_label(tokenizer, result.target), token_label(tokenizer, result.foil)
    print(f"logit('{target_label}') - logit('{foil_label}') after the last token: clean {result.clean:+.3f}, "
          f"corrupted {result.corrupted:+.3f}")
    labels = token_labels(tokenizer, clean)
    print("\nshare of the difference restored by patching the residual stream at one position:")
    print(f"{'stage':>9} " + " ".join(f"{label[:5]:>6}" for label in labels))
    for stage, row in zip(result.stages, result.residual.tolist(), strict=True):
        print(f"{stage:>9} " + " ".join(f"{value:>6.2f}" for value in row))
    print("\nby one head's output at every position, largest first:")
    print(f"{'layer':>5} {'head':>4} {'restored':>9}")
    flat = [(layer, head, value) for layer, row in enumerate(result.heads.tolist())
            for head, value in enumerate(row)]
    for layer, head, value in sorted(flat, key=lambda row: -row[2]):
        print(f"{layer:>5} {head:>4} {value:>9.3f}")
    save_patching_png(result, labels, target_label, foil_label, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_heads(args: argparse.Namespace) -> int:
    """Score every head with the detectors (table, heatmap, --json), or plot --history of a tracked run."""
    import json

    from gptlab.inference.loading import load
    from gptlab.inspection.attention_view import check_index
    from gptlab.inspection.detectors import repeat_ablation, save_scores_png, score_heads

    if args.out is not None and Path(args.out).suffix.lower() != ".png":
        raise ValueError(f"--out {args.out} must end in .png: the heatmaps are written as a PNG picture")
    if args.out is not None or not args.json:
        check_out(Path(args.out or ("heads-history.png" if args.history else "heads.png")), args.force)
    if args.history:
        if args.json or args.ablate:
            raise ValueError("--history plots the scores saved during training: it takes no --json or "
                             "--ablate")
        return draw_history(args)
    model = load(args.run, device=args.device).model
    layers = check_index(args.layer, model.config.n_layer, "--layer")
    heads = check_index(args.head, model.config.n_head, "--head")
    scores = score_heads(model, seed=args.seed)
    ablation = repeat_ablation(model, seed=args.seed) if args.ablate else None
    rows = [row for row in scores.rows() if row["layer"] in layers and row["head"] in heads]
    for row in rows:
        if ablation is not None:
            row["ablated_repeat_loss_change"] = float(ablation[int(row["layer"]), int(row["head"])])
    rows.sort(key=lambda row: -row[args.sort])
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"head scores on {SEQUENCES_TEXT.format(n=scores.length, seed=args.seed)}; loss on their "
              f"repeats {scores.repeat_loss:.4f} nats; sorted by {args.sort}")
        extra = f" {'ablated':>8}" if ablation is not None else ""
        print(f"{'layer':>5} {'head':>4} " + " ".join(f"{d:>15}" for d in DETECTORS) + extra)
        for row in rows:
            cells = " ".join(f"{row[d]:>15.3f}" for d in DETECTORS)
            ablated = f" {row['ablated_repeat_loss_change']:>+8.3f}" if ablation is not None else ""
            print(f"{row['layer']:>5} {row['head']:>4} {cells}{ablated}")
        if ablation is not None:
            print("ablated: change in the repeat loss (nats) when the head's output is zeroed")
    if args.out is not None or not args.json:
        out = args.out or "heads.png"
        probe = SEQUENCES_TEXT.format(n=scores.length, seed=args.seed)
        save_scores_png(scores, out, f"head detectors on {probe}")
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


SEQUENCES_TEXT = "repeated random tokens (2 x {n}, seed {seed})"
FORCE = "replace --out even if gptlab did not write it (its own earlier picture is replaced anyway)"


def draw_history(args: argparse.Namespace) -> int:
    """Plot each head's scores against steps beside the losses, from a run trained with --track-heads."""
    from gptlab.inspection.history import read_history, save_history_png

    history = read_history(args.run)
    out = args.out or "heads-history.png"
    save_history_png(history, out, Path(args.run).name)
    before, after, jump = history.rise("induction")
    scores = history.scores["induction"][-1]  # (L, H) at the last evaluation
    layer, head = divmod(int(scores.argmax()), scores.size(1))
    print(f"{len(history.steps)} evaluations, steps {history.steps[0]} to {history.steps[-1]}; best "
          f"induction head at the end: L{layer}H{head} {float(scores.max()):.3f}; the best induction score "
          f"rose most between steps {before} and {after} (+{jump:.3f})")
    print(f"wrote {out}")
    return 0


def add_inspect_commands(sub: Any) -> None:
    """The attention / ablate / intervene / verify / lens / patch / heads commands: look inside a trained
    model (handout §2.2)."""
    for add in (add_attention_command, add_ablate_command, add_intervene_command, add_verify_command,
                add_lens_command, add_patch_command, add_heads_command):
        add(sub)


def command(sub: Any, name: str, help: str, description: str,
            prompt: str = "refused") -> argparse.ArgumentParser:
    """An inspection command's parser: the run, --prompt and --device. A prompt longer than the context
    window is `prompt`: "refused" (the command names positions in it), "cropped" or "none" (no --prompt)."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument("run", type=RunPath(),
                        help="run folder or checkpoint file (from gptlab train or import-hf)")
    if prompt != "none":
        longer = ("at most block_size tokens, never cropped: positions are named in it" if prompt == "refused"
                  else "a longer one is read from its last block_size tokens, and a note says so")
        parser.add_argument("--prompt", required=True, help=f"the text to inspect; {longer}")
    add_device_option(parser)
    return parser


def add_attention_command(sub: Any) -> None:
    """The attention command."""
    at = command(sub, "attention", "draw a prompt's attention weights (PNG grid or HTML page)",
                 "Draw the attention weights of every head on a prompt: FILE.png is a grid of heatmaps "
                 "(layers down, heads across; rows are queries, columns keys, labelled with the tokens); "
                 "FILE.html is a self-contained page where you pick a layer and head and hover a token to "
                 "see where it attends and what the model predicts next. The forward pass keeps the fast "
                 "kernel; the weights are recomputed only for the layers and heads drawn. For a seq2seq run "
                 "(gptlab seq2seq train), --prompt is the source and FILE.png shows cross-attention: rows "
                 "are the answer's tokens, columns the source's.", prompt="cropped")
    at.add_argument("--out", required=True, metavar="FILE.png|FILE.html", type=OutputFile(),
                    help="the picture or page to write")
    at.add_argument("--force", action="store_true", help=FORCE)
    at.add_argument("--layer", type=NATURAL, help="draw only this layer (default: all)")
    at.add_argument("--head", type=NATURAL, help="draw only this head (default: all)")
    at.set_defaults(func=cmd_attention)


def add_ablate_command(sub: Any) -> None:
    """The ablate command."""
    ab = command(sub, "ablate", "remove each head and measure the change in the next token's log-probability",
                 "For every head, remove it and report the change in log p(target) after the prompt's "
                 "last token: zero ablation sets the head's output (its slice of W_O's input) to zero; "
                 "mean ablation sets it to its mean over the prompt's positions. Prints a sorted table and "
                 "writes a layer x head heatmap of both.", prompt="cropped")
    ab.add_argument("--target", help="the next token to score, as text that is exactly one token "
                    "(default: the model's own top prediction)")
    ab.add_argument("--sort", choices=("zero", "mean"), default="zero",
                    help="which ablation orders the table (default zero)")
    ab.add_argument("--out", default="ablation.png", metavar="FILE.png", type=OutputFile(),
                    help="the heatmap to write (default ablation.png)")
    ab.add_argument("--force", action="store_true", help=FORCE)
    ab.set_defaults(func=cmd_ablate)


def add_intervene_command(sub: Any) -> None:
    """The intervene command."""
    iv = command(sub, "intervene", "replace or drop prompt tokens and compare the prediction",
                 "Replace or drop tokens of the prompt and print the next-token probabilities after its "
                 "last token before and after: the handout's test of a causal claim (§2.2). Positions are "
                 "token indices from 0; negative ones count from the end (write --replace=-1=x).")
    iv.add_argument("--replace", action="append", default=[], metavar="POS=TOKEN",
                    help="put TOKEN (text that is exactly one token) at position POS; repeatable")
    iv.add_argument("--drop", action="append", default=[], type=Bounded(int), metavar="POS",
                    help="remove the token at position POS; repeatable")
    iv.add_argument("--top", type=COUNT, default=5,
                    help="how many of the likeliest tokens to show, before and after (default 5)")
    iv.set_defaults(func=cmd_intervene)


def add_verify_command(sub: Any) -> None:
    """The verify command."""
    ve = command(sub, "verify", "measure the handout's properties on a trained model", "Run the handout's "
                 "properties on the model and print each one's measured deviation: attention rows sum to "
                 "one (§3.2); logits at i ignore every later input, exactly (§7.3); cached = uncached "
                 "generation (§7.1); fused = separate projections (§4.2); a tied head is one tensor (§6); "
                 "without positions, permutation equivariance of the unmasked stack (§6.1). On a run from "
                 "gptlab finetune: merged = unmerged logits and adapters off = the base run's logits "
                 "exactly (--lora runs, whose handout properties are measured merged), each example's loss "
                 "mask checked by bytes on the run's own data file, and its conversations rendered again "
                 "with the run's chat template giving the ids trained on. On a seq2seq "
                 "run: rows (cross-attention too), padding ignored exactly, decoder causality, every "
                 "target position reading every source token, cached = recomputed decoding, tying. Exits "
                 "1 if any fails.", prompt="none")
    ve.add_argument("--seed", type=NATURAL, default=0, help="seed of the random test prompts (default 0)")
    ve.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="check the model in this precision; bfloat16 adds its logits' difference to "
                    "float32, and tolerances follow the dtype's epsilon (default float32)")
    ve.set_defaults(func=cmd_verify)


def add_lens_command(sub: Any) -> None:
    """The lens command."""
    le = command(sub, "lens", "read each block's residual stream through the head (the logit lens)",
                 "At the input rows and after every block, read the residual stream through the final "
                 "norm and the vocabulary head: per position, that stage's top predictions and the "
                 "probability of the token that actually comes next. Prints a table and writes a stages x "
                 "positions heatmap (FILE.png) or a page to hover (FILE.html). The last stage is the "
                 "model's own output.")
    le.add_argument("--out", default="lens.png", metavar="FILE.png|FILE.html", type=OutputFile(),
                    help="the heatmap or page to write (default lens.png)")
    le.add_argument("--position", type=Bounded(int), help="print the top five at every stage for this token "
                    "position instead of the table (negative counts from the end)")
    le.add_argument("--force", action="store_true", help=FORCE)
    le.set_defaults(func=cmd_lens)


def add_patch_command(sub: Any) -> None:
    """The patch command."""
    pa = command(sub, "patch", "patch clean activations into a corrupted run: which values carry the answer",
                 "Run a clean and a corrupted prompt of the same length, then run the corrupted one again "
                 "with one value taken from the clean run: the residual stream at each (stage, position), "
                 "and each head's output at every position. Reports the share of the logit difference "
                 "logit(target) - logit(foil) after the last token that each patch restores (0: none, 1: "
                 "all) as tables and heatmaps.", prompt="none")
    pa.add_argument("--clean", required=True, help="the prompt whose prediction is studied")
    pa.add_argument("--corrupt", required=True, help="the same prompt changed where the prediction "
                    "should depend on it; it must tokenize to the same length")
    pa.add_argument("--target", help="the clean answer, exactly one token (default: the clean run's top "
                    "prediction)")
    pa.add_argument("--foil", help="the token it is compared with, exactly one token (default: the "
                    "corrupted run's likeliest other token)")
    pa.add_argument("--out", default="patch.png", metavar="FILE.png", type=OutputFile(),
                    help="the heatmaps (default patch.png)")
    pa.add_argument("--force", action="store_true", help=FORCE)
    pa.set_defaults(func=cmd_patch)


def add_heads_command(sub: Any) -> None:
    """The heads command."""
    he = command(sub, "heads", "score every head: previous-token, duplicate-token, induction, first-token",
                 "Score every head on repeated random token sequences made up here (n random tokens, then "
                 "the same n again): previous-token (weight on i - 1), duplicate-token (on the earlier copy "
                 "of the current token), induction (on the token after that copy) and first-token (on "
                 "position 0); each score is a mean attention weight in [0, 1]. Prints a sorted table and "
                 "writes a layer x head heatmap per detector. --ablate adds the causal test: the change in "
                 "the loss on the repeats when each head is zeroed. --history plots the scores a run "
                 "recorded at every evaluation (gptlab train --track-heads) beside its losses.",
                 prompt="none")
    he.add_argument("--sort", choices=DETECTORS, default="induction", help="the score that orders the table")
    he.add_argument("--layer", type=NATURAL, help="only this layer (default: all)")
    he.add_argument("--head", type=NATURAL, help="only this head (default: all)")
    he.add_argument("--json", action="store_true", help="print one JSON object per head (layer, head and "
                    "one field per detector) instead of the table")
    he.add_argument("--ablate", action="store_true", help="also zero each head and report the change in "
                    "the loss on the repeats (nats)")
    he.add_argument("--history", action="store_true", help="plot the scores recorded during training "
                    "against steps, beside the losses (a run trained with --track-heads)")
    he.add_argument("--seed", type=NATURAL, default=0, help="seed of the random sequences (default 0)")
    he.add_argument("--out", metavar="FILE.png", type=OutputFile(),
                    help="the picture to write (default heads.png, or "
                    "heads-history.png with --history; with --json only when given)")
    he.add_argument("--force", action="store_true", help=FORCE)
    he.set_defaults(func=cmd_heads)
