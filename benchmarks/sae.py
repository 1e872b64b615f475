"""Sparse autoencoders on this CPU: how long `gptlab sae train` takes on the demo model, and its figures.

1. The demo model: a run of the `demo` preset on shakespeare (`gptlab train --preset demo --data
   shakespeare`, about 3-5 minutes on 2 cores; trained first unless --run names one). For each --sites
   entry, a TopK SAE (`train_sae` with the default settings unless --tokens, --k, --expansion say
   otherwise) is trained on the run's activations there; the table gives the training time and speed
   (activations read through the model and SAE steps together), then on held-out windows of the val
   split: L0, explained variance, dead features, and the next-token loss clean, with the SAE spliced in
   and with the site zero-ablated, and the share of that damage the SAE repairs.
2. The planted-feature toy (`sae_toy`, the test's settings): 48 known features in 32 dimensions, about 2
   active per token, an SAE of 96 features with k = 3 trained on 76,800 tokens; the mean over the true
   features of the best cosine with a decoder row and of the best correlation with a feature's activation.

    python benchmarks/sae.py                         # trains the demo preset first (minutes)
    python benchmarks/sae.py --run runs/demo --tokens 500000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gptlab.checkpoint import load_header
from gptlab.common import cpu_name
from gptlab.sae.config import SAEConfig
from gptlab.sae.model import SAETrainer, SparseAutoencoder
from gptlab.sae.toy import PlantedFeatures, planted_features, recovery
from gptlab.sae.training import train_sae


def demo_run(folder: Path) -> Path:
    """Train the demo preset into `folder` with the gptlab command, and say how long it took."""
    begin = time.perf_counter()
    command = [sys.executable, "-m", "gptlab", "train", "--preset", "demo", "--data", "shakespeare",
               "--out", str(folder), "--no-progress"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    print(f"trained the demo preset in {time.perf_counter() - begin:.0f} s: {folder}")
    return folder


def demo_table(run: Path, sites: list[str], config: SAEConfig, scratch: Path) -> list[str]:
    """One row per site: SAE training time and its held-out figures."""
    rows = [f"{'site':<16} {'features':>8} {'k':>3} {'tokens':>9} {'train s':>8} {'tokens/s':>9} {'L0':>5} "
            f"{'expl.var':>8} {'dead':>6} {'clean':>7} {'spliced':>7} {'zeroed':>7} {'recovered':>9}"]
    for site in sites:
        result = train_sae(run, config.replace(site=site), scratch / site)
        m = result.metrics
        rows.append(f"{site:<16} {result.config.width:>8} {config.k:>3} {result.tokens:>9,} "
                    f"{result.seconds:>8.1f} {result.trained_now / result.seconds:>9,.0f} {m.l0:>5.1f} "
                    f"{m.explained_variance:>8.3f} {100 * m.dead:>5.1f}% {m.loss_clean:>7.4f} "
                    f"{m.loss_spliced:>7.4f} {m.loss_zero:>7.4f} {100 * m.loss_recovered:>8.1f}%")
    return rows


def toy_row() -> str:
    """The planted-feature toy of tests/inspection/test_sae.py: time and recovery."""
    toy = planted_features(300 * 256 + 8192, 32, 48, 2.0, seed=1)
    trainer = SAETrainer(SparseAutoencoder(32, 96, 3, seed=0), lr=5e-3)
    begin = time.perf_counter()
    for batch in toy.activations[:-8192].split(256):
        trainer.step(batch)
    seconds = time.perf_counter() - begin
    held_out = PlantedFeatures(toy.activations[-8192:], toy.directions, toy.coefficients[-8192:])
    found = recovery(trainer.sae, held_out)
    return (f"planted toy: 48 features in 32 dimensions, SAE of 96 with k = 3, 300 steps of 256 in "
            f"{seconds:.1f} s: mean max cosine {found.cosine:.3f}, mean max correlation "
            f"{found.correlation:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run of the demo preset (default: train one first)")
    parser.add_argument("--sites", default="h.1.resid_post", help="comma-separated hook points")
    defaults = SAEConfig()
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="SAE training tokens per site")
    parser.add_argument("--k", type=int, default=defaults.k, help="features active per token")
    parser.add_argument("--expansion", type=int, default=defaults.expansion, help="features per dimension")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run = args.run or demo_run(Path(scratch) / "demo")
        header = load_header(run)
        config = SAEConfig(tokens=args.tokens, k=args.k, expansion=args.expansion)
        print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
        print(f"model: {run} (step {header.state.get('step')} of the {header.model_config.n_layer} x "
              f"{header.model_config.n_embd} demo preset); SAE batch {config.batch_size}, lr {config.lr}; "
              "losses in nats per token")
        print("\n".join(demo_table(run, args.sites.split(","), config, Path(scratch))))
    print(toy_row())


if __name__ == "__main__":
    main()
