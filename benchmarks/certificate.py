"""How well EAP, EAP-IG and eap-dest agree with exact patching on trained induction models: the certificate's
spread over training seeds, prompt spans and pair sets, one table (gptlab.inspection.attribution).

Each seed trains the `induction` preset on `repeats` (about 11 s on a 2-core CPU; kept under --out and
reused); each cell scores every edge over --pairs `repeat_pairs` prompts (a span of distinct letters, then
its start again) by exact patching, EAP, EAP-IG and eap-dest (each destination recomputed for real), and
prints the Spearman correlation with exact of |score| (the order a circuit search takes edges), of the
signed scores, and the top-10 overlap.

    python benchmarks/certificate.py                        # 3 seeds x 3 spans x 3 pair sets
    python benchmarks/certificate.py --seeds 1337 --spans 16 --sets 1
"""

from __future__ import annotations

import argparse
import dataclasses
import string
from pathlib import Path

import torch

from gptlab.common import cpu_name
from gptlab.inference.loading import load
from gptlab.inspection.attribution import attribute, certify
from gptlab.inspection.ground_truth import repeat_pairs
from gptlab.model import GPT
from gptlab.training.loop import train
from gptlab.training.presets import resolve_configs


def induction_model(out: Path, seed: int) -> tuple[GPT, list[int]]:
    """The induction preset trained with this seed (once), and the letters' token ids."""
    run = out / f"induction-seed{seed}"
    if not (run / "config.json").exists():
        model_config, train_config, *rest = resolve_configs("induction")
        seeded = dataclasses.replace(train_config, seed=seed)
        train(run, "repeats", model_config, seeded, *rest, progress=False)
    lm = load(run)
    model, tokenizer = lm.model, lm.tokenizer
    return model, tokenizer.encode(string.ascii_letters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2], help="training seeds")
    parser.add_argument("--spans", type=int, nargs="+", default=[8, 16, 24], help="distinct tokens a prompt")
    parser.add_argument("--sets", type=int, default=3, help="pair sets a cell, seeds 0.. (default 3)")
    parser.add_argument("--pairs", type=int, default=64, help="pairs a set (default 64)")
    parser.add_argument("--steps", type=int, default=16, help="points of EAP-IG's integral (default 16)")
    parser.add_argument("--out", default="runs/certificate", help="where the trained models are kept")
    args = parser.parse_args()
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; induction preset, "
          f"{args.pairs} pairs a set, EAP-IG with {args.steps} points\n")
    print("| training seed | span | pair set | EAP \\|score\\| | EAP signed | EAP-IG \\|score\\| "
          "| EAP-IG signed | EAP-IG top-10 | eap-dest \\|score\\| | eap-dest signed | eap-dest top-10 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lowest = {"eap": 1.0, "eap-ig": 1.0, "eap-dest": 1.0}
    for seed in args.seeds:
        model, letters = induction_model(Path(args.out), seed)
        for span in args.spans:
            for pair_set in range(args.sets):
                pairs = repeat_pairs(letters, args.pairs, span=span, seed=pair_set)
                exact = attribute(model, pairs, "exact")
                eap = certify(attribute(model, pairs, "eap"), exact)
                ig = certify(attribute(model, pairs, "eap-ig", args.steps), exact)
                dest = certify(attribute(model, pairs, "eap-dest"), exact)
                for name, certificate in (("eap", eap), ("eap-ig", ig), ("eap-dest", dest)):
                    lowest[name] = min(lowest[name], certificate.spearman)
                print(f"| {seed} | {span} | {pair_set} | {eap.spearman:.3f} | {eap.signed_spearman:.3f} "
                      f"| {ig.spearman:.3f} | {ig.signed_spearman:.3f} | {ig.overlap:.1f} "
                      f"| {dest.spearman:.3f} | {dest.signed_spearman:.3f} | {dest.overlap:.1f} |",
                      flush=True)
    print(f"\nlowest Spearman of |score|: EAP {lowest['eap']:.3f}, EAP-IG {lowest['eap-ig']:.3f}, "
          f"eap-dest {lowest['eap-dest']:.3f}")


if __name__ == "__main__":
    main()
