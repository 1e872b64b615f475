"""The attribute and circuit commands: which edges of the model's graph carry a prediction (issue 41)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gptlab.cli.common import COUNT, Bounded, InputFile, OutputFile, RunPath, add_device_option, check_out

METHODS = ("exact", "eap", "eap-ig", "eap-dest")
EXACT_LAYERS = 4  # gptlab.inspection.edges.EXACT_LAYERS, kept here so that --help imports no torch
FORCE = "replace --out even if gptlab did not write it (its own earlier picture is replaced anyway)"


def load_pairs(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    """The model, tokenizer and pairs of `args`: --pairs FILE.jsonl, or --clean/--corrupt/--target/--foil."""
    from gptlab.inference.loading import load
    from gptlab.inspection.attribution import read_pairs, text_pair

    given = [name for name in ("clean", "corrupt", "target", "foil") if getattr(args, name) is not None]
    if args.pairs is not None and given:
        raise ValueError(f"--pairs takes its prompts from the file: leave out --{', --'.join(given)}")
    if args.pairs is None and len({"clean", "corrupt", "target"} & set(given)) < 3:
        raise ValueError("give --clean, --corrupt and --target (and optionally --foil), or --pairs "
                         "FILE.jsonl")
    if args.method == "eap-ig" and args.steps < 1:
        raise ValueError(f"--steps={args.steps}: the integral needs at least one point")
    if args.out is not None:
        if Path(args.out).suffix.lower() != ".png":
            raise ValueError(f"--out {args.out} must end in .png: the graph is drawn as a PNG picture")
        check_out(Path(args.out), args.force)
    lm = load(args.run, device=args.device)
    model, tokenizer = lm.model, lm.tokenizer
    if args.pairs is not None:
        return model, tokenizer, read_pairs(model, tokenizer, args.pairs)
    return model, tokenizer, [text_pair(model, tokenizer, args.clean, args.corrupt, args.target, args.foil)]


def score(args: argparse.Namespace, model: Any, pairs: list[Any], method: str) -> Any:
    """Run one attribution method, saying on stderr what it does and how long it took."""
    from gptlab.inspection.attribution import attribute

    steps = f" ({args.steps} steps)" if method == "eap-ig" else ""
    print(f"scoring edges by {method}{steps} on {len(pairs)} pair(s) ...", file=sys.stderr, flush=True)
    begin = time.perf_counter()
    result = attribute(model, pairs, method, args.steps, args.edges)
    seconds = time.perf_counter() - begin
    edges = len(result.names) * len(pairs)
    print(f"{method}: {len(result.names)} edges x {len(pairs)} pair(s) in {seconds:.2f} s "
          f"({edges / seconds:,.0f} edges/s)", file=sys.stderr)
    return result


def cmd_attribute(args: argparse.Namespace) -> int:
    """Score every edge; certify an estimate against exact patching where the model is small enough and
    the pairs separate clean from corrupted (else say why there is no certificate)."""
    from gptlab.inspection.attribution import certify, unseparated
    from gptlab.inspection.graph_view import save_graph_png

    if args.top < 1:
        raise ValueError(f"--top={args.top}: show and compare at least one edge (--top 1 or more)")
    model, _, pairs = load_pairs(args)
    result = score(args, model, pairs, args.method)
    certificate, problem = None, unseparated(result.clean, result.corrupt)
    if args.method != "exact" and model.config.n_layer <= EXACT_LAYERS and problem is None:
        certificate = certify(result, score(args, model, pairs, "exact"), args.top)
    if args.json:
        print(json.dumps(result.to_json() | {"steps": result.steps, "separated": problem is None,
                                             "certificate": certificate and certificate.to_json()}))
    else:
        print(f"m = logit(target) - logit(foil) after the last token, mean over {result.pairs} pair(s): "
              f"clean {result.clean:+.3f}, corrupted {result.corrupt:+.3f}")
        print(f"{len(result.names)} edges scored by {result.method}; score = change in m when the edge alone "
              "carries the corrupted run's value. The largest by |score|:")
        for name, value in result.ranked()[:args.top]:
            print(f"  {name:<28} {value:+.4f}")
        if problem is not None:
            print(f"{problem}: the scores are changes in a difference that hardly exists, with no order "
                  "worth certifying")
        if certificate is not None:
            print(f"certificate against exact patching, over all {len(result.names)} edges: Spearman "
                  f"{certificate.spearman:.3f} of |score| ({certificate.signed_spearman:.3f} signed); "
                  f"top-{certificate.top_k} overlap {certificate.overlap:.2f}")
    if args.out is not None:
        save_graph_png(model, result.ranked()[:args.top], args.out,
                       f"top {args.top} edges by |{result.method} score| ({result.pairs} pair(s))")
        print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_circuit(args: argparse.Namespace) -> int:
    """Find the fewest edges, in order of attribution, that keep --keep of the metric; report, draw them."""
    from gptlab.inspection.circuit import find_circuit, recovery
    from gptlab.inspection.edges import build_graph
    from gptlab.inspection.graph_view import save_graph_png

    model, _, pairs = load_pairs(args)
    if args.method == "exact" and model.config.n_layer > EXACT_LAYERS:
        raise ValueError(f"--method exact is refused above {EXACT_LAYERS} layers, and a circuit needs every "
                         "edge scored: use --method eap, eap-ig or eap-dest")
    graph = build_graph(model)
    known = [graph.names[i] for i in graph.select(args.known)] if args.known else []
    attribution = score(args, model, pairs, args.method)
    print("checking circuits by cutting every other edge ...", file=sys.stderr, flush=True)
    circuit = find_circuit(model, pairs, attribution, args.keep)
    precision, recall = recovery(circuit.names, known) if known else (None, None)
    if args.json:
        print(json.dumps(circuit.to_json() | {"pairs": len(pairs), "known": known or None,
                                              "precision": precision, "recall": recall}))
    else:
        print(f"circuit of {len(circuit.names)} of {circuit.total_edges} edges (ranked by {circuit.method}), "
              f"the first to keep {circuit.keep:.0%} of m:")
        for name, value in zip(circuit.names, circuit.scores, strict=True):
            print(f"  {name:<28} {value:+.4f}")
        print(f"m: clean {circuit.clean:+.3f}, corrupted {circuit.corrupt:+.3f}, circuit alone "
              f"{circuit.kept:+.3f}, circuit cut {circuit.removed:+.3f}")
        print(f"faithfulness {circuit.faithfulness:.3f} (share of m the circuit alone keeps), completeness "
              f"{circuit.completeness:.3f} (share cutting the circuit alone removes)")
        if known:
            print(f"against the {len(known)} known edges: precision {precision:.2f}, recall {recall:.2f}")
    if args.out is not None:
        save_graph_png(model, list(zip(circuit.names, circuit.scores, strict=True)), args.out,
                       f"circuit: {len(circuit.names)} edges, faithfulness {circuit.faithfulness:.2f}, "
                       f"completeness {circuit.completeness:.2f}")
        print(f"wrote {args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def add_pair_options(parser: argparse.ArgumentParser) -> None:
    """The run, the prompts and the method: what attribute and circuit share."""
    parser.add_argument("run", type=RunPath(),
                        help="run folder or checkpoint file (from gptlab train or import-hf)")
    parser.add_argument("--clean", help="the prompt whose prediction is studied")
    parser.add_argument("--corrupt", help="the same prompt changed where the prediction should depend on it; "
                        "it must tokenize to the same length")
    parser.add_argument("--target", help="the clean answer, exactly one token")
    parser.add_argument("--foil", help="the token it is compared with, exactly one token (default: the "
                        "corrupted run's likeliest other token)")
    parser.add_argument("--pairs", metavar="FILE.jsonl", type=InputFile(),
                        help='many pairs, one {"clean", "corrupt", '
                        '"target", "foil"} object a line (foil optional); scores are averaged over them, '
                        "signs kept")
    parser.add_argument("--method", choices=METHODS, default="eap-ig", help="exact: cut each edge for real "
                        "(one forward pass per edge); eap: gradient x change, one forward and backward pass; "
                        "eap-ig: the gradient integrated from the clean to the corrupted input (default); "
                        "eap-dest: each edge's destination (head, MLP, logits) recomputed for real, linear "
                        "after it (the closest to exact, at a fraction of its cost on deeper models)")
    parser.add_argument("--steps", type=COUNT, default=16,
                        help="points of the integral of eap-ig (default 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing "
                        "else (progress goes to stderr)")
    parser.add_argument("--out", metavar="FILE.png", type=OutputFile(),
                        help="also draw the graph's edges into this picture")
    parser.add_argument("--force", action="store_true", help=FORCE)
    add_device_option(parser)


def add_attribution_commands(sub: Any) -> None:
    """The attribute and circuit commands."""
    at = sub.add_parser("attribute", help="score every edge of the model's graph for a prediction",
                        description="Score each edge of the graph (sources: embeddings, each head's output, "
                        "each MLP; destinations: each later head's q, k and v inputs, each later MLP, the "
                        "logits) by the change in m = logit(target) - logit(foil) after the last token when "
                        "that edge alone carries the corrupted run's value. exact cuts each edge; eap, "
                        "eap-ig and eap-dest estimate it from gradients, and on models of up to 4 layers are "
                        "certified against exact (Spearman, top-k overlap). Under grouped-query attention "
                        "the k and v edges belong to the shared key/value heads (a1.kv0.k).")
    add_pair_options(at)
    at.add_argument("--edges", action="append", metavar="PATTERN", help="score only the edges whose names "
                    f"match (a0.h1->a1.*, repeatable); exact patching needs it above {EXACT_LAYERS} layers")
    at.add_argument("--top", type=COUNT, default=10, help="edges shown, drawn and compared (default 10)")
    at.set_defaults(func=cmd_attribute)
    ci = sub.add_parser("circuit", help="the fewest edges, by attribution, that keep a share of the "
                        "prediction", description="Rank the edges by |attribution|, then take the shortest "
                        "prefix that keeps "
                        "--keep of m when every other edge is cut to the corrupted run. Reports faithfulness "
                        "(m(circuit) - m(corrupt)) / (m(clean) - m(corrupt)) and completeness, the share of "
                        "the same difference that cutting the circuit alone removes.")
    add_pair_options(ci)
    ci.add_argument("--keep", type=Bounded(float, 0, 1), default=0.8,
                    help="share of m the circuit must keep (default 0.8)")
    ci.add_argument("--known", action="append", metavar="PATTERN", help="edges known to belong to the "
                    "circuit (names or patterns, repeatable): report the circuit's precision and recall "
                    "against them")
    ci.set_defaults(func=cmd_circuit, edges=None)
