"""Time to a validation loss on this CPU: nanoGPT's CPU recipe beside gptlab's presets, in one run.

It prepares one character corpus with nanoGPT's split (the first 90% of the text trains, the last
10% validates) in both projects' formats (the ids are the same: both number the sorted set of the
text's characters), then runs, one after the other with the same thread count:
- nanoGPT's CPU recipe, exactly as its README gives it, from a checkout named with --nanogpt PATH
  (plus --always_save_checkpoint=True, so that its final weights are saved to be scored, and the
  dataset and output folder of this run);
- gptlab's presets (default: nanogpt-cpu, the same recipe in gptlab, and speedrun), through the
  `gptlab train` command.
Each run's wall time is measured from process start to the end of training (nanoGPT: the process
exits; gptlab: it prints where it finished, before its own final evaluation). The final weights
of every run are then scored by one evaluator, gptlab's `evaluate_tokens`, on the whole validation
10%: nanoGPT's checkpoint is read with `torch.load(weights_only=True)` (no code is unpickled) into a
gptlab GPT of the same shape (nanoGPT's exact-erf GELU is `ffn="gelu_exact"`). "Reached" is the
wall time at which a gptlab run's own evaluation first showed a validation loss at or below
nanoGPT's final score (an estimate on its evaluation batches; the score itself is exact).

    git clone https://github.com/karpathy/nanoGPT ~/nanoGPT    # MIT licensed; not part of gptlab
    python benchmarks/time_to_loss.py --nanogpt ~/nanoGPT        # about 4 minutes on 2 cores
    python benchmarks/time_to_loss.py --text notes.txt --presets speedrun
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gptlab.checkpoint import LAST, load_run
from gptlab.config import ModelConfig
from gptlab.data import TokenData, load_text, prepare
from gptlab.evaluate import evaluate_tokens
from gptlab.model import GPT

# nanoGPT's README, "I only have a macbook" (CPU): its command line, unchanged.
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                      "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
                      "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                      "--lr_decay_iters=2000", "--dropout=0.0"]
EVALUATION = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


@dataclass
class Run:
    """One training run: its wall time, its own evaluations as they were printed, its final score."""

    name: str
    wall_s: float = 0.0
    evaluations: list[tuple[float, int, float]] = field(default_factory=list)  # (wall s, step, val loss)
    score: float = float("nan")


def prepare_corpus(text: str, work: Path) -> tuple[Path, Path]:
    """The corpus with nanoGPT's split, as a gptlab folder and as nanoGPT's data/<name> folder."""
    (work / "corpus.txt").write_text(text, encoding="utf-8")
    gptlab_dir = work / "gptlab-data"
    prepare(str(work / "corpus.txt"), gptlab_dir, tokenizer="char", split="tail", progress=False)
    data = TokenData(gptlab_dir)
    nanogpt_data = work / "nanogpt" / "data" / "bench_char"
    nanogpt_data.mkdir(parents=True)
    for split in ("train", "val"):
        data.split(split).astype(np.uint16).tofile(nanogpt_data / f"{split}.bin")
    chars = data.tokenizer.chars
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)),
            "stoi": {c: i for i, c in enumerate(chars)}}
    with open(nanogpt_data / "meta.pkl", "wb") as f:  # what nanoGPT's train.py reads for vocab_size
        pickle.dump(meta, f)
    return gptlab_dir, nanogpt_data.parent.parent


def timed(name: str, command: list[str], cwd: Path, env: dict[str, str], finished: str | None) -> Run:
    """Run a training command; its wall time ends when it exits or prints a line starting `finished`."""
    run = Run(name)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    assert process.stdout is not None
    log = []
    for line in process.stdout:
        now = time.perf_counter() - start
        log.append(line)
        if match := EVALUATION.search(line):
            run.evaluations.append((now, int(match[1]), float(match[3])))
        if finished and line.startswith(finished) and not run.wall_s:
            run.wall_s = now
    process.wait()
    if process.returncode != 0:
        sys.exit(f"{name} failed ({process.returncode}):\n{''.join(log[-20:])}")
    run.wall_s = run.wall_s or time.perf_counter() - start
    return run


def nanogpt_run(checkout: Path, work: Path, env: dict[str, str]) -> tuple[Run, Path]:
    """nanoGPT's CPU recipe in a folder holding its data and a link to its configurator."""
    cwd = work / "nanogpt"
    for name in ("configurator.py", "config"):
        (cwd / name).symlink_to(checkout / name)
    command = [sys.executable, str(checkout / "train.py"), *NANOGPT_CPU_RECIPE, "--dataset=bench_char",
               f"--out_dir={cwd / 'out'}", "--always_save_checkpoint=True"]
    return timed("nanoGPT CPU recipe", command, cwd, env, finished=None), cwd / "out" / "ckpt.pt"


def nanogpt_model(ckpt: Path) -> GPT:
    """nanoGPT's saved weights in a gptlab GPT of the same shape (tensors only: weights_only=True)."""
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    args = saved["model_args"]
    config = ModelConfig(vocab_size=args["vocab_size"], block_size=args["block_size"],
                         n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"],
                         bias=args["bias"], ffn="gelu_exact")
    model = GPT(config)
    state = {name.removeprefix("_orig_mod."): t for name, t in saved["model"].items()}
    model.load_state_dict({name: t for name, t in state.items() if not name.endswith(".attn.bias")})
    return model.eval()


def gptlab_run(preset: str, data_dir: Path, work: Path, env: dict[str, str]) -> tuple[Run, Path]:
    out = work / f"gptlab-{preset}"
    command = [sys.executable, "-m", "gptlab", "train", "--preset", preset, "--data", str(data_dir), "--out",
               str(out), "--no-progress", "--samples", "0", "--device", "cpu"]
    return timed(f"gptlab {preset}", command, work, env, finished="finished at step"), out


def score(model: GPT, val: np.ndarray) -> float:
    """Mean loss per character over the whole validation split (the same evaluator for every run)."""
    return evaluate_tokens(model, val, batch_size=64).loss


def reached(run: Run, target: float) -> str:
    first = next((wall for wall, _, val in run.evaluations if val <= target), None)
    return "-" if first is None else f"{first:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (without it, its row is skipped)")
    parser.add_argument("--text", help="the corpus (default: the built-in shakespeare)")
    parser.add_argument("--presets", nargs="+", default=["nanogpt-cpu", "speedrun"], help="gptlab presets")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for every run")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    torch.set_num_threads(args.threads)
    text = load_text(args.text or "shakespeare")
    with tempfile.TemporaryDirectory(prefix="gptlab-time-to-loss-") as tmp:
        work = Path(tmp)
        gptlab_dir, nanogpt_root = prepare_corpus(text, work)
        val = TokenData(gptlab_dir).split("val")
        runs: list[Run] = []
        if args.nanogpt:
            run, ckpt = nanogpt_run(args.nanogpt.resolve(), work, env)
            run.score = score(nanogpt_model(ckpt), val)
            runs.append(run)
        else:
            print("nanoGPT: skipped (give --nanogpt PATH to a checkout to measure it side by side)")
        for preset in args.presets:
            run, out = gptlab_run(preset, gptlab_dir, work, env)
            run.score = score(load_run(out, prefer=LAST)[0], val)
            runs.append(run)
    print(f"\ntorch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cores; "
          f"{len(text):,} characters, {len(val):,} validation characters (the last 10%)\n")
    target = runs[0].score if args.nanogpt else None
    print("| run | steps | wall time, s | val loss (whole val split) | reached nanoGPT's loss at | "
          "time vs nanoGPT |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        steps = run.evaluations[-1][1] if run.evaluations else "?"
        when = reached(run, target) if target is not None and run is not runs[0] else ""
        ratio = f"{run.wall_s / runs[0].wall_s:.2f}x" if target is not None else ""
        print(f"| {run.name} | {steps} | {run.wall_s:.1f} | {run.score:.4f} | {when} | {ratio} |")


if __name__ == "__main__":
    main()
