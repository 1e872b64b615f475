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
exits; gptlab: it prints where it finished, before its own final evaluation), its start-up from process
start until the trainer is ready (nanoGPT: its optimiser is built). The final weights of every run
are then scored by one evaluator, gptlab's `evaluate_tokens`, on the whole validation 10%: nanoGPT's
checkpoint is read with `torch.load(weights_only=True)` (no code is unpickled) into a gptlab GPT of the
same shape (nanoGPT's exact-erf GELU is `ffn="gelu_exact"`). A gptlab recipe counts as at or under
nanoGPT's loss when that final score is. With `--seeds N` every gptlab recipe runs with seeds 1..N and
nanoGPT N times (its seed is fixed in its train.py), and each column gives mean +- sd. The model's
arithmetic rate (the products of the forward and backward pass, attention included) is given as a
fraction of a float32 product's rate at the step's own largest shape, measured in the same run; the
last line is a records row for the last recipe.

    git clone https://github.com/karpathy/nanoGPT ~/nanoGPT    # MIT licensed; not part of gptlab
    python benchmarks/time_to_loss.py --nanogpt ~/nanoGPT        # about 4 minutes on 2 cores
    python benchmarks/time_to_loss.py --nanogpt ~/nanoGPT --presets speedrun --seeds 3
    python benchmarks/time_to_loss.py --presets speedrun "trapezoid=--preset speedrun --schedule trapezoid"
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pickle
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gptlab.checkpoint import LAST, load_checkpoint, load_run
from gptlab.common import cpu_name
from gptlab.config import ModelConfig
from gptlab.data.corpora import load_text
from gptlab.data.prepare import prepare
from gptlab.data.tokens import TokenData
from gptlab.evaluation.heldout import evaluate_tokens
from gptlab.model import GPT

# nanoGPT's README, "I only have a macbook" (CPU): its command line, unchanged.
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                      "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
                      "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                      "--lr_decay_iters=2000", "--dropout=0.0"]
EVALUATION = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


ITERATION = re.compile(r"iter \d+: loss [\d.]+, time ([\d.]+)ms")  # nanoGPT's per-step log line
FINISHED = re.compile(r"finished at step (\d+): ([\d,]+) tokens/s")  # gptlab's last training line


@dataclass
class Run:
    """One training run: its wall time, start-up, step rate, its own evaluations, its final score."""

    name: str
    wall_s: float = 0.0
    startup_s: float = float("nan")  # process start until the trainer is ready to step
    tokens_per_s: float = float("nan")  # while training
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


def timed(name: str, command: list[str], cwd: Path, env: dict[str, str], finished: str | None,
          ready: str | None = None) -> Run:
    """Run a training command; its wall time ends when it exits or prints a line starting `finished`,
    its start-up when it prints a line containing `ready`."""
    run = Run(name)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    assert process.stdout is not None
    log, step_ms = [], []
    for line in process.stdout:
        now = time.perf_counter() - start
        log.append(line)
        if match := EVALUATION.search(line):
            run.evaluations.append((now, int(match[1]), float(match[3])))
        if ready and ready in line and math.isnan(run.startup_s):
            run.startup_s = now
        if match := ITERATION.search(line):
            step_ms.append(float(match[1]))
        if match := FINISHED.search(line):
            run.tokens_per_s = float(match[2].replace(",", ""))
        if finished and line.startswith(finished) and not run.wall_s:
            run.wall_s = now
    process.wait()
    if process.returncode != 0:
        sys.exit(f"{name} failed ({process.returncode}):\n{''.join(log[-20:])}")
    run.wall_s = run.wall_s or time.perf_counter() - start
    if step_ms:  # nanoGPT: batch 12 x 64 tokens per step; its first step includes warm-up, so the median
        run.tokens_per_s = 12 * 64 / (statistics.median(step_ms) / 1000)
    return run


def nanogpt_run(checkout: Path, work: Path, env: dict[str, str], repeat: int) -> tuple[Run, Path]:
    """nanoGPT's CPU recipe in a folder holding its data and a link to its configurator (its seed is
    fixed at 1337 in its train.py, so repeats differ only in time)."""
    cwd = work / "nanogpt"
    for name in ("configurator.py", "config"):
        if not (cwd / name).exists():
            (cwd / name).symlink_to(checkout / name)
    out = cwd / f"out-{repeat}"
    command = [sys.executable, str(checkout / "train.py"), *NANOGPT_CPU_RECIPE, "--dataset=bench_char",
               f"--out_dir={out}", "--always_save_checkpoint=True"]
    run = timed("nanoGPT CPU recipe", command, cwd, env, finished=None, ready="using fused AdamW")
    return run, out / "ckpt.pt"


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


@dataclass(frozen=True)
class Variant:
    """A gptlab recipe: a name and the `gptlab train` options that make it (a preset and overrides)."""

    name: str
    options: tuple[str, ...]


def parse_variant(text: str) -> Variant:
    """NAME=OPTIONS, e.g. "qk-norm=--preset speedrun --qk-norm true"; a bare preset name is itself."""
    name, _, options = text.partition("=")
    return Variant(name.strip(), tuple(shlex.split(options)) if options else ("--preset", name.strip()))


def gptlab_run(variant: Variant, seed: int, data_dir: Path, work: Path,
               env: dict[str, str]) -> tuple[Run, Path]:
    out = work / f"gptlab-{re.sub(r'[^A-Za-z0-9_.-]', '_', variant.name)}-{seed}"
    command = [sys.executable, "-m", "gptlab", "train", *variant.options, "--seed", str(seed), "--data",
               str(data_dir), "--out", str(out), "--no-progress", "--samples", "0", "--device", "cpu"]
    return timed(f"gptlab {variant.name}", command, work, env, finished="finished at step",
                 ready="parameters on"), out


def score(model: GPT, val: np.ndarray) -> float:
    """Mean loss per character over the whole validation split (the same evaluator for every run)."""
    return evaluate_tokens(model, val, batch_size=64).loss


def matmul_flops_per_token(model: GPT) -> float:
    """Training FLOPs of the products per token: 6 per weight of every nn.Linear (forward, and the two
    products of the backward pass; the tied head included) and attention's 12 L T D (scores and mixing)."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    return 6 * weights + 12 * c.n_layer * c.block_size * c.n_embd


def matmul_rate(rows: int, width: int, repeats: int = 20) -> float:
    """FLOP/s of a float32 product at a step's own largest shape: (rows, D) @ (D, 4D), best of `repeats`."""
    a, b = torch.randn(rows, width), torch.randn(width, 4 * width)
    best = float("inf")
    for _ in range(repeats + 3):
        begin = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - begin)
    return 2 * rows * width * 4 * width / best


def mean_sd(values: list[float], digits: int) -> str:
    """"mean ± sd" (the sample standard deviation), or the one value."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


@dataclass
class Side:
    """Every seed of one recipe: its runs, and the model shape whose arithmetic its steps do."""

    name: str
    runs: list[Run]
    flops_per_token: float
    rows: int  # sequences x context per step: the products' row count
    width: int


def commit() -> str:
    """The short commit of this checkout, with + when it has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (without it, its row is skipped)")
    parser.add_argument("--text", help="the corpus (default: the built-in shakespeare)")
    parser.add_argument("--presets", nargs="+", default=["nanogpt-cpu", "speedrun"],
                        help="gptlab recipes: a preset name, or NAME=OPTIONS such as "
                             "'qk=--preset speedrun --qk-norm true'")
    parser.add_argument("--seeds", type=int, default=1, help="runs of each recipe: gptlab seeds 1..N, and N "
                        "repeats of nanoGPT (its seed is fixed in its train.py)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for every run")
    parser.add_argument("--change", default="", help="the one-line change this measurement is for, printed "
                        "in its records row")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    torch.set_num_threads(args.threads)
    text = load_text(args.text or "shakespeare")
    variants = [parse_variant(v) for v in args.presets]
    sides: list[Side] = []
    with tempfile.TemporaryDirectory(prefix="gptlab-time-to-loss-") as tmp:
        work = Path(tmp)
        gptlab_dir, nanogpt_root = prepare_corpus(text, work)
        val = TokenData(gptlab_dir).split("val")
        if args.nanogpt:
            runs = []
            for repeat in range(args.seeds):
                run, ckpt = nanogpt_run(args.nanogpt.resolve(), work, env, repeat)
                model = nanogpt_model(ckpt)
                run.score = score(model, val)
                runs.append(run)
                print(f"nanoGPT repeat {repeat + 1}: {run.wall_s:.1f} s, loss {run.score:.4f}", flush=True)
            sides.append(Side("nanoGPT CPU recipe", runs, matmul_flops_per_token(model), 12 * 64, 128))
        else:
            print("nanoGPT: skipped (give --nanogpt PATH to a checkout to measure it side by side)")
        for variant in variants:
            runs = []
            for seed in range(1, args.seeds + 1):
                run, out = gptlab_run(variant, seed, gptlab_dir, work, env)
                checkpoint = load_checkpoint(out, prefer=LAST)
                model = load_run(out, prefer=LAST)[0]
                run.score = score(model, val)
                runs.append(run)
                print(f"{run.name} seed {seed}: {run.wall_s:.1f} s, loss {run.score:.4f}", flush=True)
            train = checkpoint.train_config
            sides.append(Side(runs[0].name, runs, matmul_flops_per_token(model),
                              train.batch_size * model.config.block_size, model.config.n_embd))
    report(sides, args, len(text), len(val))


def report(sides: list[Side], args: argparse.Namespace, characters: int, validation: int) -> None:
    """The side-by-side table, and the records row of the last recipe against nanoGPT."""
    print(f"\n{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads; "
          f"{characters:,} characters, {validation:,} validation characters (the last 10%); "
          f"{args.seeds} run(s) each\n")
    target = statistics.mean(r.score for r in sides[0].runs) if args.nanogpt else None
    print("| run | runs | start-up, s | wall time, s | val loss (whole val split) | at or under nanoGPT's | "
          "time vs nanoGPT | model GFLOP/s | of the float32 matmul rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for side in sides:
        walls = [r.wall_s for r in side.runs]
        under = sum(r.score <= (target or 0) for r in side.runs)
        reached = f"{under}/{len(side.runs)}" if target and side is not sides[0] else ""
        ratio = (f"{statistics.mean(walls) / statistics.mean(r.wall_s for r in sides[0].runs):.3f}x"
                 if target else "")
        rate = statistics.median(r.tokens_per_s for r in side.runs) * side.flops_per_token
        peak = matmul_rate(side.rows, side.width)
        print(f"| {side.name} | {len(side.runs)} | {mean_sd([r.startup_s for r in side.runs], 1)} | "
              f"{mean_sd(walls, 1)} | {mean_sd([r.score for r in side.runs], 4)} | {reached} | {ratio} | "
              f"{rate / 1e9:.0f} | {rate / peak:.0%} of {peak / 1e9:.0f} |")
    if target and len(sides) > 1:
        best, nanogpt = sides[-1].runs, sides[0].runs
        ratio = statistics.mean(r.wall_s for r in best) / statistics.mean(r.wall_s for r in nanogpt)
        print("\nrecords row: | date | CPU | cores | nanoGPT, s | gptlab, s | ratio | loss (nanoGPT's) | "
              "commit | change |")
        print(f"| {datetime.date.today()} | {cpu_name()} | {os.cpu_count()} | "
              f"{mean_sd([r.wall_s for r in nanogpt], 1)} | {mean_sd([r.wall_s for r in best], 1)} | "
              f"{ratio:.3f}x | {mean_sd([r.score for r in best], 4)} ({target:.4f}) | {commit()} | "
              f"{args.change} |")


if __name__ == "__main__":
    main()
