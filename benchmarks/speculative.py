"""Prompt-lookup speculative decoding on this CPU: tokens/s with and without it, where it pays and where it
cannot, in one run.

1. A model that copies: the `induction` preset (2 attention-only layers, RoPE, a 64-token window)
   trained on the generated `repeats` corpus, whose induction head continues a repeated span. It is
   trained first (`gptlab train --preset induction --data repeats`, 800 steps; the head forms after
   about 450) unless --run names such a run. Prompts: the first 40 characters of five lines of
   `repeats_text` drawn with other seeds than the training text's; 256 new tokens each, batch 1, greedy
   (the tokens are compared with plain greedy's) and once sampled at temperature 0.8 (where only the
   distribution is the same, so the tokens are not compared).
2. The cost when nothing is accepted: SmolLM2-135M's shape (30 x 576, 9 query heads on 3 key/value
   heads, V 49152) with random weights in float32, in the weight layout `gptlab sample` would measure
   and choose, a prompt of 64 random tokens, 32 new tokens, greedy. "every draft rejected" makes each
   step verify k random tokens beside the newest one (the model rejects them: one token per pass, the
   worst case); "ngram" is prompt lookup as it is on that model (random weights soon repeat a token,
   which prompt lookup then drafts right: not a sign of what real text gives).

Every figure is the best of --repeats runs, which take turns (the machine may be shared). The copying
model runs on one thread (its operations are tiny), SmolLM2's shape on torch's default count.

    python benchmarks/speculative.py                      # trains the copying model first (minutes)
    python benchmarks/speculative.py --run /tmp/induction # a run of `gptlab train --preset induction`
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gptlab.common import cpu_name
from gptlab.config import ModelConfig, SamplingConfig
from gptlab.data.corpora import repeats_text
from gptlab.generate import Decoder, generate
from gptlab.inference.layouts import decoding_layout
from gptlab.inference.loading import load
from gptlab.model import GPT
from gptlab.sampling import next_token
from gptlab.speculative import SpeculationConfig, SpeculationStats, accept_draft

SMOLLM2_SHAPE = ModelConfig(vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                            ffn_mult=1536 / 576, norm="rmsnorm", ffn="swiglu", positions="rope", bias=False,
                            rope_base=100000.0, norm_eps=1e-5)
Run = Callable[[], tuple[list[int], SpeculationStats]]  # one decoding: its tokens and its counters


def induction_run(folder: Path) -> Path:
    """Train the copying model into `folder` with the gptlab command, and say how long it took."""
    begin = time.perf_counter()
    command = [sys.executable, "-m", "gptlab", "train", "--preset", "induction", "--data", "repeats",
               "--out", str(folder), "--no-progress"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    print(f"trained the induction preset on repeats in {time.perf_counter() - begin:.0f} s: {folder}")
    return folder


def best_of(repeats: int, runs: dict[str, Run]) -> dict[str, tuple[float, list[int], SpeculationStats]]:
    """Each run's fastest time of `repeats`, with its tokens and counters. The runs take turns, so that a
    load on a shared machine falls on all of them alike."""
    results: dict[str, tuple[float, list[int], SpeculationStats]] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            begin = time.perf_counter()
            tokens, stats = run()
            seconds = time.perf_counter() - begin
            results[name] = (min(seconds, results.get(name, (seconds,))[0]), tokens, stats)
    return results


def decoding(model: GPT, prompts: list[list[int]], sampling: SamplingConfig,
             speculation: SpeculationConfig | None, vocab_size: int | None = None) -> Run:
    """Every prompt in turn, each one's generation seeded alike; the tokens of all, the counters summed."""

    def run() -> tuple[list[int], SpeculationStats]:
        stats, tokens = SpeculationStats(), []
        for prompt in prompts:
            generator = torch.Generator().manual_seed(0)
            tokens += [int(t) for t in generate(model, [prompt], sampling, generator=generator, stats=stats,
                                                vocab_size=vocab_size, speculation=speculation)]
        return tokens, stats

    return run


def rejected_drafts(model: GPT, prompt: list[int], n_new: int, draft_tokens: int) -> Run:
    """Greedy decoding where every step verifies `draft_tokens` random tokens beside the newest one: the
    model keeps none of them (a chance of 1 in V each), so each pass yields one token: the worst case."""

    def run() -> tuple[list[int], SpeculationStats]:
        rng, stats, greedy = random.Random(0), SpeculationStats(), SamplingConfig(temperature=0)
        decoder = Decoder(model, [prompt], max_new_tokens=n_new, spare=draft_tokens)
        decoder.append(next_token(decoder.logits(), greedy))
        while len(decoder.rows[0]) - len(prompt) < n_new:
            room = min(decoder.draft_room(), draft_tokens, n_new - (len(decoder.rows[0]) - len(prompt)) - 1)
            draft = [rng.randrange(model.config.vocab_size) for _ in range(room)]
            if not draft:
                decoder.append(next_token(decoder.logits(), greedy))
                continue
            tokens = accept_draft(decoder.verify(draft), draft, greedy)
            decoder.keep(tokens, len(draft))
            stats.record(len(draft), len(tokens) - 1)
        return decoder.rows[0][len(prompt):], stats

    return run


def table(model: str, threads: int, results: dict[str, tuple[float, list[int], SpeculationStats]],
          plain: str, compare: bool) -> list[str]:
    """One markdown row per run, its speed beside the `plain` run's (and with `compare`, its tokens)."""
    plain_seconds, reference, _ = results[plain]
    rows = []
    for name, (seconds, tokens, stats) in results.items():
        counts = "- | - | -"
        if stats.drafted:
            counts = f"{stats.drafted} | {stats.accepted} | {stats.acceptance:.0%}"
        same = "yes" if tokens == reference else "NO"
        same = "-" if name == plain else same if compare else "n/a (sampled)"
        rows.append(f"| {model} | {threads} | {name} | {len(tokens)} | {len(tokens) / seconds:,.0f} | "
                    f"{plain_seconds / seconds:.2f}x | {counts} | {same} |")
    return rows


def copying_tables(run_dir: Path, repeats: int) -> list[str]:
    """Rows for the copying model, on one thread (its operations are tiny: a second one only adds
    hand-over time): plain and prompt lookup with k = 4, 6, 8 greedy; plain and k = 4 sampled."""
    lm = load(run_dir, torch.device("cpu"), "float32", "none")
    model, tokenizer = lm.model, lm.tokenizer
    prompts = [tokenizer.encode(repeats_text(lines=1, seed=seed)[:40]) for seed in range(101, 106)]
    name, vocab = "induction (2x64, ctx 64)", tokenizer.vocab_size
    greedy = SamplingConfig(temperature=0, max_new_tokens=256)
    sampled = SamplingConfig(temperature=0.8, max_new_tokens=256)
    four = SpeculationConfig(draft_tokens=4, ngram=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {"plain, greedy": decoding(model, prompts, greedy, None, vocab)}
        for k in (4, 6, 8):
            speculation = SpeculationConfig(draft_tokens=k, ngram=3)
            runs[f"ngram k={k} n=3, greedy"] = decoding(model, prompts, greedy, speculation, vocab)
        rows = table(name, 1, best_of(repeats, runs), "plain, greedy", compare=True)
        runs = {"plain, T 0.8": decoding(model, prompts, sampled, None, vocab),
                "ngram k=4 n=3, T 0.8": decoding(model, prompts, sampled, four, vocab)}
        return rows + table(name, 1, best_of(repeats, runs), "plain, T 0.8", compare=False)
    finally:
        torch.set_num_threads(threads)


def rejection_table(repeats: int) -> list[str]:
    """Rows for SmolLM2-135M's shape with random weights: plain, prompt lookup, every draft rejected."""
    torch.manual_seed(0)
    model = decoding_layout(GPT(SMOLLM2_SHAPE).eval())  # the weight layout `gptlab sample` would choose
    prompt = torch.randint(SMOLLM2_SHAPE.vocab_size, (64,)).tolist()
    greedy = SamplingConfig(temperature=0, max_new_tokens=32)
    four = SpeculationConfig(draft_tokens=4, ngram=3)
    runs = {"plain, greedy": decoding(model, [prompt], greedy, None),
            "ngram k=4 n=3, greedy": decoding(model, [prompt], greedy, four)}
    for k in (1, 2, 4, 6):
        runs[f"every draft rejected, k={k}"] = rejected_drafts(model, prompt, 32, k)
    return table("SmolLM2-135M shape, random", torch.get_num_threads(), best_of(repeats, runs),
                 "plain, greedy", compare=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a run of `gptlab train --preset induction --data repeats` "
                        "(default: train one first, in a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3, help="each figure is the best of this many runs")
    args = parser.parse_args()
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run or induction_run(Path(tmp) / "induction")
        rows = copying_tables(run_dir, args.repeats)
    rows += rejection_table(args.repeats)
    print("| model | threads | decoding | new tokens | tokens/s | vs plain | drafted | accepted | "
          "acceptance | same tokens as plain |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
