"""Time to a validation loss on this CPU, timed as a user times it: nanoGPT's CPU recipe beside gptlab's
presets, in one run, on one character corpus.

It prepares the corpus (--corpus) with nanoGPT's split (the first 90% of the text trains, the last 10%
validates) in both projects' formats (the ids are the same: both number the sorted set of the text's
characters), then runs, one after the other with the same thread count:
- nanoGPT's CPU recipe, exactly as its README gives it, from a checkout named with --nanogpt PATH
  (plus --always_save_checkpoint=True, so that its final weights are saved to be scored, and the
  dataset and output folder of this run);
- gptlab's presets (default: nanogpt-cpu, the same recipe in gptlab, and speedrun), through the
  `gptlab train` command (with `--samples 0`: nanoGPT's train.py prints no samples either).
The headline time is each command's whole process, from its start to its exit: start-up, training,
the closing evaluation, checkpoints and plot. Beside it are the time to the end of training (nanoGPT:
its exit; gptlab: its `finished at step` line, before the closing evaluation: the clock of the records
up to 2026-12-03) and the start-up (until the trainer is ready; nanoGPT: its optimiser is built).

Losses are compared two ways. Every final model is scored by one evaluator, gptlab's `evaluate_tokens`,
on the whole validation split: nanoGPT's checkpoint is read with `torch.load(weights_only=True)` (no
code is unpickled) into a gptlab GPT of the same shape (nanoGPT's exact-erf GELU is `ffn="gelu_exact"`).
And each run's own printed figure is kept: nanoGPT's last `val loss` line (its estimate over 20
batches), gptlab's closing evaluation. A gptlab seed counts as under nanoGPT's loss "both ways" when its
whole-split score is under nanoGPT's whole-split score and under nanoGPT's printed estimate (means over
nanoGPT's runs). With `--seeds N` every gptlab recipe runs with seeds 1..N and nanoGPT N times (its seed
is fixed in its train.py), and each column gives mean +- sd. The model's arithmetic rate (the products
of the forward and backward pass, attention included) is given as a fraction of a float32 product's
rate at the step's own largest shape, measured in the same run; the last line is a records row for the
last recipe. `--max-steps N` cuts every run to N steps: a smoke test of this script, never a record.

Corpora (--corpus): `shakespeare`, gptlab's built-in complete works (5.1 M characters, 84 symbols; the
speedrun was tuned on it); `tinyshakespeare`, char-rnn's 1.1 M characters (65 symbols), the text of
nanoGPT's own recipe, downloaded once from a pinned commit, refused unless its SHA-256 is the pinned one,
and cached beside gptlab's shakespeare (offline, put the file there yourself); `python-stdlib`, this
interpreter's standard-library source (about 10 M characters and 215 symbols on Python 3.11; no
download); or the path of a text file.

    git clone https://github.com/karpathy/nanoGPT ~/nanoGPT    # MIT licensed; not part of gptlab
    python benchmarks/time_to_loss.py --nanogpt ~/nanoGPT        # about 4 minutes on 2 cores
    python benchmarks/time_to_loss.py --nanogpt ~/nanoGPT --presets speedrun --seeds 3 \
        --corpus tinyshakespeare
    python benchmarks/time_to_loss.py --nanogpt ~/nanoGPT --presets speedrun --max-steps 20   # smoke test
    python benchmarks/time_to_loss.py --presets speedrun "trapezoid=--preset speedrun --schedule trapezoid"
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
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
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptlab.checkpoint import LAST, load_checkpoint
from gptlab.common import cpu_name
from gptlab.config import ModelConfig
from gptlab.data.corpora import cache_dir, load_text
from gptlab.data.prepare import prepare
from gptlab.data.tokens import TokenData
from gptlab.evaluation.heldout import evaluate_tokens
from gptlab.files import atomic_write
from gptlab.inference.loading import load
from gptlab.model import GPT

# nanoGPT's README, "I only have a macbook" (CPU): its command line, unchanged.
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                      "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
                      "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                      "--lr_decay_iters=2000", "--dropout=0.0"]
# char-rnn's tiny Shakespeare at a fixed commit (the file nanoGPT's shakespeare_char/prepare.py fetches).
TINY_SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/"
                        "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/data/tinyshakespeare/input.txt")
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

ITERATION = re.compile(r"iter \d+: loss [\d.]+, time ([\d.]+)ms")  # nanoGPT's per-step log line
FINISHED = re.compile(r"finished at step (\d+): ([\d,]+) tokens/s")  # gptlab's last training line
# A run's own validation figure: nanoGPT's evaluation line, gptlab's closing evaluation.
PRINTED = re.compile(r"step \d+: train loss [\d.]+, val loss ([\d.]+)|on the val split: loss ([\d.]+) nats")


@dataclass
class Run:
    """One training run: its times, step rate, its own last printed validation loss, its final score."""

    name: str
    wall_s: float = 0.0  # the whole process, from its start to its exit
    train_s: float = 0.0  # from the start to the end of training
    startup_s: float = float("nan")  # from the start until the trainer is ready to step
    tokens_per_s: float = float("nan")  # while training
    printed: float = float("nan")
    score: float = float("nan")


def corpus_text(name: str) -> str:
    """The text of --corpus: `tinyshakespeare` (pinned and hash-checked), a gptlab corpus, or a path."""
    if name != "tinyshakespeare":
        return load_text(name)
    path = cache_dir() / "tinyshakespeare.txt"
    if not path.is_file():
        try:
            with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=60) as response:
                data = response.read()
        except OSError as exc:
            sys.exit(f"could not download tiny shakespeare ({exc}): put the file of {TINY_SHAKESPEARE_URL} "
                     f"at {path}, or give --corpus PATH")
        check_tiny_shakespeare(data, TINY_SHAKESPEARE_URL)
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
    data = path.read_bytes()
    check_tiny_shakespeare(data, str(path))
    return data.decode("utf-8")


def check_tiny_shakespeare(data: bytes, source: str) -> None:
    """Exit unless `data` is the pinned tiny Shakespeare."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        sys.exit(f"{source} is not the pinned tiny shakespeare (SHA-256 {digest[:16]}..., expected "
                 f"{TINY_SHAKESPEARE_SHA256[:16]}...): remove it and run again")


def prepare_corpus(text: str, work: Path) -> Path:
    """The corpus with nanoGPT's split, as a gptlab folder (returned) and as nanoGPT's data/bench_char."""
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
    return gptlab_dir


def timed(name: str, command: list[str], cwd: Path, env: dict[str, str], ready: str) -> Run:
    """Run a training command to its exit, noting when it prints a line containing `ready` (start-up),
    when training ends (gptlab's `finished at step` line, else the exit) and its last printed loss."""
    run = Run(name)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    assert process.stdout is not None
    log, step_ms = [], []
    for line in process.stdout:
        now = time.perf_counter() - start
        log.append(line)
        if ready in line and math.isnan(run.startup_s):
            run.startup_s = now
        if match := PRINTED.search(line):
            run.printed = float(match[1] or match[2])
        if match := ITERATION.search(line):
            step_ms.append(float(match[1]))
        if match := FINISHED.search(line):
            run.tokens_per_s, run.train_s = float(match[2].replace(",", "")), now
    process.wait()
    run.wall_s = time.perf_counter() - start
    if process.returncode != 0:
        sys.exit(f"{name} failed ({process.returncode}):\n{''.join(log[-20:])}")
    run.train_s = run.train_s or run.wall_s
    if step_ms:  # nanoGPT: batch 12 x 64 tokens per step; its first step includes warm-up, so the median
        run.tokens_per_s = 12 * 64 / (statistics.median(step_ms) / 1000)
    return run


def nanogpt_run(checkout: Path, work: Path, env: dict[str, str], repeat: int,
                steps: int | None) -> tuple[Run, Path]:
    """nanoGPT's CPU recipe in a folder holding its data and a link to its configurator (its seed is
    fixed at 1337 in its train.py, so repeats differ only in time); `steps` shortens it, evaluating at
    the end (its later options win)."""
    cwd = work / "nanogpt"
    for name in ("configurator.py", "config"):
        if not (cwd / name).exists():
            (cwd / name).symlink_to(checkout / name)
    out = cwd / f"out-{repeat}"
    shorter = ([f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}"]
               if steps else [])
    command = [sys.executable, str(checkout / "train.py"), *NANOGPT_CPU_RECIPE, *shorter,
               "--dataset=bench_char", f"--out_dir={out}", "--always_save_checkpoint=True"]
    return timed("nanoGPT CPU recipe", command, cwd, env, ready="using fused AdamW"), out / "ckpt.pt"


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


def gptlab_run(variant: Variant, seed: int, data_dir: Path, work: Path, env: dict[str, str],
               steps: int | None) -> tuple[Run, Path]:
    """One `gptlab train` command of a recipe and seed, timed whole; `steps` shortens it."""
    out = work / f"gptlab-{re.sub(r'[^A-Za-z0-9_.-]', '_', variant.name)}-{seed}"
    shorter = ["--max-steps", str(steps)] if steps else []
    command = [sys.executable, "-m", "gptlab", "train", *variant.options, *shorter, "--seed", str(seed),
               "--data", str(data_dir), "--out", str(out), "--no-progress", "--samples", "0",
               "--device", "cpu"]
    return timed(f"gptlab {variant.name}", command, work, env, ready="parameters on"), out


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
    """Every seed of one recipe: its runs, its parameters and the model shape its steps multiply."""

    name: str
    runs: list[Run]
    parameters: int
    flops_per_token: float
    rows: int  # sequences x context per step: the products' row count
    width: int

    def mean(self, figure: str) -> float:
        """The mean of one Run field over the runs."""
        return statistics.mean(getattr(r, figure) for r in self.runs)

    def column(self, figure: str, digits: int) -> str:
        """One Run field over the runs, as mean ± sd."""
        return mean_sd([getattr(r, figure) for r in self.runs], digits)


def side_of(name: str, runs: list[Run], model: GPT, batch_size: int) -> Side:
    """A recipe's runs with the shape of its (last) model."""
    c = model.config
    return Side(name, runs, sum(p.numel() for p in model.parameters()), matmul_flops_per_token(model),
                batch_size * c.block_size, c.n_embd)


def nanogpt_side(args: argparse.Namespace, work: Path, env: dict[str, str], val: np.ndarray) -> Side:
    """nanoGPT's recipe, run --seeds times, each final model scored on the whole validation split."""
    runs = []
    for repeat in range(args.seeds):
        run, ckpt = nanogpt_run(args.nanogpt.resolve(), work, env, repeat, args.max_steps)
        model = nanogpt_model(ckpt)
        run.score = score(model, val)
        runs.append(run)
        print(f"nanoGPT repeat {repeat + 1}: {run.wall_s:.1f} s whole, loss {run.score:.4f} "
              f"(printed {run.printed:.4f})", flush=True)
    return side_of("nanoGPT CPU recipe", runs, model, 12)


def gptlab_side(variant: Variant, args: argparse.Namespace, data_dir: Path, work: Path,
                env: dict[str, str], val: np.ndarray) -> Side:
    """A gptlab recipe with seeds 1..--seeds, each last checkpoint scored on the whole validation split."""
    runs = []
    for seed in range(1, args.seeds + 1):
        run, out = gptlab_run(variant, seed, data_dir, work, env, args.max_steps)
        checkpoint = load_checkpoint(out, prefer=LAST)
        model = load(out, prefer=LAST).model
        run.score = score(model, val)
        runs.append(run)
        print(f"{run.name} seed {seed}: {run.wall_s:.1f} s whole ({run.train_s:.1f} s to the end of "
              f"training), loss {run.score:.4f}", flush=True)
    return side_of(runs[0].name, runs, model, checkpoint.train_config.batch_size)


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


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (without it, its row is skipped)")
    parser.add_argument("--corpus", default="shakespeare", help="shakespeare (default), tinyshakespeare, "
                        "python-stdlib, or a text file")
    parser.add_argument("--presets", nargs="+", default=["nanogpt-cpu", "speedrun"],
                        help="gptlab recipes: a preset name, or NAME=OPTIONS such as "
                             "'qk=--preset speedrun --qk-norm true'")
    parser.add_argument("--seeds", type=int, default=1, help="runs of each recipe: gptlab seeds 1..N, and N "
                        "repeats of nanoGPT (its seed is fixed in its train.py)")
    parser.add_argument("--max-steps", type=int, help="cut every run to this many steps (a smoke test of "
                        "this script: no records row)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for every run")
    parser.add_argument("--change", default="", help="the one-line change this measurement is for, printed "
                        "in its records row")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    torch.set_num_threads(args.threads)
    text = corpus_text(args.corpus)
    sides: list[Side] = []
    with tempfile.TemporaryDirectory(prefix="gptlab-time-to-loss-") as tmp:
        work = Path(tmp)
        gptlab_dir = prepare_corpus(text, work)
        val = TokenData(gptlab_dir).split("val")
        if args.nanogpt:
            sides.append(nanogpt_side(args, work, env, val))
        else:
            print("nanoGPT: skipped (give --nanogpt PATH to a checkout to measure it side by side)")
        for variant in args.presets:
            sides.append(gptlab_side(parse_variant(variant), args, gptlab_dir, work, env, val))
    print(f"\n{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads; "
          f"corpus {args.corpus}: {len(text):,} characters, {len(set(text))} symbols, {len(val):,} "
          f"validation characters (the last 10%); {args.seeds} run(s) each"
          + (f"; cut to {args.max_steps} steps (a smoke test)" if args.max_steps else "") + "\n")
    report(sides, args)


def report(sides: list[Side], args: argparse.Namespace) -> None:
    """The side-by-side table, and the records row of the last recipe against nanoGPT."""
    nanogpt = sides[0] if args.nanogpt else None
    print("| run | runs | parameters | start-up, s | to end of training, s | whole command, s | whole vs "
          "nanoGPT | val loss (whole val split) | its own printed val loss | under nanoGPT's: whole split, "
          "printed | model GFLOP/s | of the float32 matmul rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for side in sides:
        ratio = f"{side.mean('wall_s') / nanogpt.mean('wall_s'):.3f}x" if nanogpt else ""
        under = under_both(side, nanogpt) if nanogpt and side is not nanogpt else ""
        rate = statistics.median(r.tokens_per_s for r in side.runs) * side.flops_per_token
        peak = matmul_rate(side.rows, side.width)
        print(f"| {side.name} | {len(side.runs)} | {side.parameters:,} | {side.column('startup_s', 1)} | "
              f"{side.column('train_s', 1)} | {side.column('wall_s', 1)} | {ratio} | "
              f"{side.column('score', 4)} | {side.column('printed', 4)} | {under} | {rate / 1e9:.0f} | "
              f"{rate / peak:.0%} of {peak / 1e9:.0f} |")
    if len(sides) > 1:
        print("\nper seed, whole-split loss: " + "; ".join(
            f"{side.name} " + ", ".join(f"{r.score:.4f}" for r in side.runs) for side in sides))
    if nanogpt and len(sides) > 1 and not args.max_steps:
        best = sides[-1]
        print("\nrecords row: | date | CPU | cores | corpus | nanoGPT, s | gptlab, s | ratio | loss | "
              "nanoGPT's: whole split, printed | under both | parameters | runs | commit | change |")
        print(f"| {datetime.date.today()} | {cpu_name()} | {os.cpu_count()} | {args.corpus} | "
              f"{nanogpt.column('wall_s', 1)} | {best.column('wall_s', 1)} | "
              f"{best.mean('wall_s') / nanogpt.mean('wall_s'):.3f}x | {best.column('score', 4)} | "
              f"{nanogpt.mean('score'):.4f}, {nanogpt.mean('printed'):.4f} | {under_both(best, nanogpt)} | "
              f"{best.parameters:,} | {len(best.runs)} each | {commit()} | {args.change} |")
    elif args.max_steps:
        print(f"\n(cut to {args.max_steps} steps: a smoke test of this script, no records row)")


def under_both(side: Side, nanogpt: Side) -> str:
    """How many of a recipe's runs ended under nanoGPT's whole-split score, and under its printed loss."""
    whole = sum(r.score <= nanogpt.mean("score") for r in side.runs)
    printed = sum(r.score <= nanogpt.mean("printed") for r in side.runs)
    return f"{whole}/{len(side.runs)}, {printed}/{len(side.runs)}"


if __name__ == "__main__":
    main()
