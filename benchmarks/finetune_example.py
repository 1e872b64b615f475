"""The README's fine-tuning worked example: teach a small character model to write numbers as Roman
numerals, fully and with LoRA, and score both on numbers they never saw.

The task is exact and checkable: the prompt is a number from 1 to 999 in English words and a colon, the
completion a space, its Roman numeral and a line break ("three hundred and twelve:" -> " CCCXII\\n").
Every number appears once: a fixed shuffle holds out --test of them, the rest are the fine-tuning file
(from which `gptlab finetune` holds out its own validation share). Roman numerals use only letters, so
any English character model can learn them, a `make demo` Shakespeare run included (--base RUN).

Without --base, a base model is first pre-trained for a short while on a generated corpus of the task's
language, number words and numerals counted in separate lines, never side by side: it can spell both but
has never seen the mapping. Then, through the real command line (python -m gptlab), it is fine-tuned
fully and with LoRA on the same examples, each timed, and the base and both runs are scored by exact
match of their greedy completions (gptlab.generate, batched). The script prints a markdown table
(accuracy, time, trainable parameters, checkpoint size, the CPU), the `gptlab masks` view of the first
example, and draws the validation loss of both runs into docs/finetune-loss.png.

    python benchmarks/finetune_example.py                       # about 5 minutes on 2 cores
    python benchmarks/finetune_example.py --base runs/demo-...  # start from a make-demo run instead
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gptlab.checkpoint import BEST, load_checkpoint
from gptlab.common import cpu_name
from gptlab.config import SamplingConfig
from gptlab.generate import generate
from gptlab.inference.loading import load
from gptlab.lora import is_lora_tensor

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
       "sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
ROMAN = ((900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"), (10, "X"),
         (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))
PLOT = Path(__file__).resolve().parent.parent / "docs" / "finetune-loss.png"


def words(n: int) -> str:
    """1 <= n <= 999 in British English words: "three hundred and forty-two"."""
    hundreds, rest = divmod(n, 100)
    below = ONES[rest] if rest < 20 else TENS[rest // 10] + ("-" + ONES[rest % 10] if rest % 10 else "")
    if not hundreds:
        return below
    return f"{ONES[hundreds]} hundred" + (f" and {below}" if rest else "")


def roman(n: int) -> str:
    """1 <= n <= 3999 as a Roman numeral, subtractive forms included (CDXLIV)."""
    out = []
    for value, letters in ROMAN:
        count, n = divmod(n, value)
        out.append(letters * count)
    return "".join(out)


def example(n: int) -> dict[str, str]:
    """One prompt/completion record: the number in words and a colon; a space, its numeral, a line break."""
    return {"prompt": f"{words(n)}:", "completion": f" {roman(n)}\n"}


def write_task(folder: Path, test: int, seed: int) -> tuple[Path, list[dict[str, str]]]:
    """The fine-tuning file (folder/train.jsonl) and the held-out examples (also folder/test.jsonl)."""
    numbers = list(range(1, 1000))
    random.Random(seed).shuffle(numbers)
    held, kept = numbers[:test], numbers[test:]
    for name, part in (("train", kept), ("test", held)):
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(example(n)) + "\n" for n in part)
    return folder / "train.jsonl", [example(n) for n in held]


def write_corpus(path: Path, lines: int, seed: int) -> Path:
    """Pre-training text in the task's alphabet: runs of consecutive numbers, in words on some lines and
    as numerals on others, never paired (so the mapping itself is left to fine-tuning)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(lines):
            start = rng.randint(1, 990)
            run = range(start, start + rng.randint(3, 9))
            if rng.random() < 0.5:
                f.write("counting: " + ", ".join(words(n) for n in run) + ".\n")
            else:
                f.write("numerals: " + " ".join(roman(n) for n in run) + ".\n")
    return path


def gptlab(*args: str) -> tuple[float, str]:
    """Run one gptlab command in a fresh process, echoing its output; the wall time and the output."""
    command = [sys.executable, "-m", "gptlab", *args]
    print("$ gptlab " + " ".join(args), flush=True)
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - begin
    print(done.stdout + done.stderr, flush=True)
    if done.returncode:
        raise SystemExit(f"gptlab {args[0]} failed (exit {done.returncode}); its output is above")
    return seconds, done.stdout


@torch.no_grad()
def exact_match(run: Path, examples: list[dict[str, str]], batch: int = 100) -> float:
    """The share of examples whose greedy completion, up to its line break, is exactly the expected one."""
    lm = load(run)
    model, tokenizer = lm.model, lm.tokenizer
    longest = max(len(e["completion"]) for e in examples)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=longest + 2)
    right = 0
    for start in range(0, len(examples), batch):
        part = examples[start:start + batch]
        rows = [tokenizer.encode(e["prompt"]) for e in part]
        tokens = generate(model, rows, sampling, vocab_size=tokenizer.vocab_size)  # (B, 1) a step
        steps = torch.cat(list(tokens), dim=1)  # (B, N)
        for e, ids in zip(part, steps.tolist(), strict=True):
            answer = tokenizer.decode(ids).split("\n")[0] + "\n"
            right += answer == e["completion"]
    return right / len(examples)


@dataclass
class Row:
    """One line of the results table."""

    name: str
    accuracy: float
    training: float | None  # the run's own training clock (metrics.csv), when it has one
    seconds: float | None  # the gptlab command's wall time, when this script ran it
    trainable: int
    weight_bytes: int  # the model's (or the adapters') tensors in its best checkpoint
    file_bytes: int  # the whole best checkpoint: weights, optimiser state and random-number state


def metrics(run: Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv (one per evaluation), or none for a run without one."""
    if not (run / "metrics.csv").is_file():
        return []
    with (run / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def training_seconds(run: Path) -> float | None:
    """The seconds a run spent training (its last elapsed_s: evaluations excluded), if it logged any."""
    rows = metrics(run)
    return float(rows[-1]["elapsed_s"]) if rows else None


def describe(name: str, run: Path, examples: list[dict[str, str]], seconds: float | None) -> Row:
    """Score a run and read what it trains and stores: adapter tensors only for a LoRA run."""
    model = load_checkpoint(run).build_model()
    lora = [p for key, p in model.named_parameters() if is_lora_tensor(key)]
    trainable = sum(p.numel() for p in lora) if lora else sum(p.numel() for p in model.parameters())
    with safe_open(run / BEST, "pt") as f:
        tensors = [f.get_tensor(key) for key in f.keys() if key.startswith("model.")]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    return Row(name, exact_match(run, examples), training_seconds(run), seconds, trainable, weights,
               (run / BEST).stat().st_size)


def plot(runs: dict[str, Path], png: Path) -> None:
    """Validation loss against step for each run, from its metrics.csv, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for label, run in runs.items():
        rows = metrics(run)
        ax.plot([int(r["step"]) for r in rows], [float(r["val_loss"]) for r in rows], marker="o",
                markersize=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per trained token)")
    ax.set_title("Words to Roman numerals: fine-tuning a character model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parser.add_argument("--out", type=Path, default=Path(f"runs/finetune-example-{stamp}"),
                        help="new folder for the data and the runs (default runs/finetune-example-TIME)")
    parser.add_argument("--base", type=Path, help="start from this run instead of pre-training one")
    parser.add_argument("--base-steps", type=int, default=300, help="pre-training steps without --base")
    parser.add_argument("--steps", type=int, default=400, help="fine-tuning steps of each run")
    parser.add_argument("--batch-size", type=int, default=32, help="fine-tuning examples per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of full fine-tuning")
    parser.add_argument("--lora", type=int, default=8, metavar="R", help="the LoRA run's rank")
    parser.add_argument("--lora-lr", type=float, default=3e-3, help="peak learning rate of the LoRA run")
    parser.add_argument("--test", type=int, default=100, help="numbers held out for the exact-match score")
    parser.add_argument("--plot", type=Path, default=PLOT, help="where to draw the validation losses")
    args = parser.parse_args()
    if not 1 <= args.test <= 900:
        raise SystemExit(f"--test {args.test} must be between 1 and 900 (the rest of 1-999 is trained on)")
    if args.out.exists():
        raise SystemExit(f"{args.out} already exists: give a new --out")
    args.out.mkdir(parents=True)
    data, test = write_task(args.out, args.test, seed=0)
    base, base_seconds = args.base, None
    if base is None:
        base = args.out / "base"
        corpus = write_corpus(args.out / "corpus.txt", lines=4000, seed=1)
        base_seconds, _ = gptlab("train", "--preset", "demo", "--data", str(corpus), "--out", str(base),
                                 "--max-steps", str(args.base_steps), "--warmup-steps", "30",
                                 "--eval-interval", str(args.base_steps // 3), "--samples", "0",
                                 "--no-progress")
    _, masks = gptlab("masks", str(base), "--data", str(data), "--n", "1")
    shared = ("--data", str(data), "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--eval-interval", str(max(1, args.steps // 10)), "--warmup-steps", str(args.steps // 20),
              "--no-progress")
    runs = {"full": args.out / "full", f"LoRA r={args.lora}": args.out / "lora"}
    full_seconds, _ = gptlab("finetune", str(base), "--out", str(runs["full"]), "--lr", str(args.lr), *shared)
    lora_seconds, _ = gptlab("finetune", str(base), "--out", str(runs[f"LoRA r={args.lora}"]), "--lora",
                             str(args.lora), "--lr", str(args.lora_lr), *shared)
    plot(runs, args.plot)
    base_name = "base (no fine-tuning)" if args.base else "base (pre-trained here, no fine-tuning)"
    rows = [describe(base_name, base, test, base_seconds),
            describe("full fine-tuning", runs["full"], test, full_seconds),
            describe(f"LoRA r={args.lora}", runs[f"LoRA r={args.lora}"], test, lora_seconds)]
    print(f"\nWords to Roman numerals, {len(test)} held-out numbers, greedy decoding; {cpu_name()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
          "training: the run's own clock (metrics.csv elapsed_s, evaluations excluded); command: the whole "
          "gptlab command, start-up and evaluations included\n")
    print("| model | exact match | training (s) | command (s) | trainable parameters | weights saved | "
          "best.safetensors (with optimiser state) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        training = "-" if row.training is None else f"{row.training:.0f}"
        command = "-" if row.seconds is None else f"{row.seconds:.0f}"
        print(f"| {row.name} | {row.accuracy:.0%} | {training} | {command} | {row.trainable:,} | "
              f"{row.weight_bytes / 1e6:.2f} MB | {row.file_bytes / 1e6:.2f} MB |")
    print(f"\n`gptlab masks {base} --data {data} --n 1`:\n\n{masks}\nvalidation loss curves: {args.plot}")


if __name__ == "__main__":
    main()
