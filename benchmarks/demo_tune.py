"""`make demo`'s recipe against candidates, side by side: the demo command (`gptlab train --preset demo
--data shakespeare`) with each candidate's extra options, seeds 1..N, the candidates alternating within
each seed so that a drift of this machine's speed reaches them all alike.

Each row gives the training time (the trainer's own clock, what `finished at step` reports), the whole
command's wall time (process start to exit: start-up, training, the closing evaluation, plot), the
validation loss `make demo` prints (the best checkpoint on the first 262,144 characters of the val split),
and the parameter count; mean +- sd over the seeds, and each candidate's time as a fraction of the
first row's. Runs are kept under --out; a finished one is read back, not trained again.

    python benchmarks/demo_tune.py --seeds 3 "demo=" "ngram-700=--ngram-embeddings 2 3 4 --max-steps 700"
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from time_to_loss import mean_sd

LOSS = re.compile(r"on the val split: loss ([\d.]+) nats")


def run_once(out: Path, options: list[str], seed: int) -> dict[str, float]:
    """Train the demo with `options` and `seed` into `out` (unless done), returning its figures."""
    done = out / "figures.json"
    if done.is_file():
        return dict(json.loads(done.read_text()))
    command = [sys.executable, "-m", "gptlab", "train", "--preset", "demo", "--data", "shakespeare",
               *options, "--seed", str(seed), "--out", str(out), "--no-progress", "--samples", "0"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{shlex.join(command)} failed:\n{result.stderr[-2000:]}")
    loss = LOSS.search(result.stdout)
    if loss is None:
        sys.exit(f"no closing evaluation in the output of {shlex.join(command)}")
    figures = {"wall_s": wall, "train_s": last_elapsed(out), "loss": float(loss.group(1)),
               "parameters": float(parameter_count(out))}
    done.write_text(json.dumps(figures))
    return figures


def last_elapsed(run: Path) -> float:
    """The trainer's clock at the run's last evaluation (metrics.csv's elapsed_s)."""
    lines = (run / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    return float(lines[-1].split(",")[header.index("elapsed_s")])


def parameter_count(run: Path) -> int:
    """Parameters of the run's model, from its checkpoint's header."""
    from gptlab.checkpoint import load_header
    from gptlab.model import GPT

    return sum(p.numel() for p in GPT(load_header(run).model_config).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("candidates", nargs="+", help="NAME=OPTIONS, options added to the demo command; "
                        "the first is the baseline (\"demo=\" for the preset as it is)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N for every candidate (default 3)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo-tune"), help="where the runs are kept")
    args = parser.parse_args()
    split = (candidate.partition("=") for candidate in args.candidates)
    candidates = [(name, shlex.split(options)) for name, _, options in split]
    figures: dict[str, list[dict[str, float]]] = {name: [] for name, _ in candidates}
    for seed in range(1, args.seeds + 1):
        for name, options in candidates:
            row = run_once(args.out / f"{name}-seed{seed}", options, seed)
            figures[name].append(row)
            print(f"{name} seed {seed}: {row['train_s']:.1f} s of training, {row['wall_s']:.1f} s whole, "
                  f"loss {row['loss']:.4f}", file=sys.stderr, flush=True)
    base = statistics.mean(r["train_s"] for r in figures[candidates[0][0]])
    print("\n| candidate | options | parameters | training, s | vs first | whole command, s | val loss "
          "(262,144 characters) | per seed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, options in candidates:
        rows = figures[name]
        train = [r["train_s"] for r in rows]
        per_seed = ", ".join(f"{r['loss']:.4f}" for r in rows)
        print(f"| {name} | `{shlex.join(options)}` | {int(rows[0]['parameters']):,} | {mean_sd(train, 1)} | "
              f"{statistics.mean(train) / base:.2f}x | {mean_sd([r['wall_s'] for r in rows], 1)} | "
              f"{mean_sd([r['loss'] for r in rows], 4)} | {per_seed} |")


if __name__ == "__main__":
    main()
