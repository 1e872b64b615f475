"""Edge attribution on this CPU: exact patching against EAP, EAP-IG and eap-dest, seconds and edges per
second, side by side in one run (gptlab.inspection.attribution).

The model has the demo preset's shape (4 layers x 4 heads, width 128, context 64, the exact GELU, a
65-character vocabulary): 21 sources (embed, 16 heads, 4 MLPs), 53 destinations, 479 edges. By default its
weights are GPT-2's random initialisation (the timing does not depend on them); --run scores a trained
run instead (`runs/demo` from `make demo`), where the certificate (Spearman of |score| and signed, top-10
overlap against exact) means something. Each pair is a random prompt of --length tokens and a copy with
one token changed; each method scores every edge over --pairs pairs; each figure is the best of
--repeats runs, the methods taking turns (the machine may be shared).

    python benchmarks/attribution.py                       # random weights, the demo shape
    python benchmarks/attribution.py --run runs/demo       # a trained demo model
"""

from __future__ import annotations

import argparse
import time

import torch

from gptlab.common import cpu_name
from gptlab.config import ModelConfig
from gptlab.inference.loading import load
from gptlab.inspection.attribution import Attribution, Pair, attribute, certify
from gptlab.model import GPT

DEMO_SHAPE = ModelConfig(vocab_size=65, n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0,
                         ffn="gelu_exact")
METHODS = {"exact": 0, "eap": 0, "eap-ig": 16, "eap-dest": 0}  # method -> steps


def random_pairs(vocab_size: int, length: int, count: int, seed: int) -> list[Pair]:
    """Random prompts and copies with one token changed; target and foil two random tokens."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        clean = torch.randint(vocab_size, (length,), generator=generator).tolist()
        corrupt = list(clean)
        where = int(torch.randint(length, (1,), generator=generator))
        corrupt[where] = (clean[where] + 1) % vocab_size
        target, foil = torch.randperm(vocab_size, generator=generator)[:2].tolist()
        pairs.append(Pair(tuple(clean), tuple(corrupt), target, foil))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="score this trained run instead of the random demo-shaped model")
    parser.add_argument("--pairs", type=int, default=4, help="pairs scored by each method (default 4)")
    parser.add_argument("--length", type=int, default=64, help="tokens per prompt (default 64, the context)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each method; the best counts (3)")
    args = parser.parse_args()
    if args.run:
        model = load(args.run).model
    else:
        torch.manual_seed(0)
        model = GPT(DEMO_SHAPE).eval()
    length = min(args.length, model.config.block_size)
    pairs = random_pairs(model.config.vocab_size, length, args.pairs, seed=0)
    best: dict[str, float] = {}
    results: dict[str, Attribution] = {}
    for _ in range(args.repeats):
        for method, steps in METHODS.items():
            begin = time.perf_counter()
            results[method] = attribute(model, pairs, method, steps=max(steps, 1))
            best[method] = min(best.get(method, float("inf")), time.perf_counter() - begin)
    config = model.config
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.run or 'random weights'}: {config.n_layer} x {config.n_head} heads, width {config.n_embd}, "
          f"{len(results['exact'].names)} edges, {args.pairs} pairs of {len(pairs[0].clean)} tokens\n")
    print("| method | seconds | edges/s | Spearman of \\|score\\| vs exact | signed | top-10 overlap |")
    print("|---|---:|---:|---:|---:|---:|")
    for method, seconds in best.items():
        edges = len(results[method].names) * args.pairs
        if method == "exact":
            agreement = "| - | - | - |"
        else:
            c = certify(results[method], results["exact"])
            agreement = f"| {c.spearman:.3f} | {c.signed_spearman:.3f} | {c.overlap:.2f} |"
        label = f"{method} ({METHODS[method]} steps)" if METHODS[method] else method
        print(f"| {label} | {seconds:.2f} | {edges / seconds:,.0f} {agreement}")


if __name__ == "__main__":
    main()
