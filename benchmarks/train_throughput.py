"""Training throughput of gptlab on this machine, beside Hugging Face transformers' GPT-2 of the same shape.

For each model size it times full training steps (forward, backward, clip, AdamW) on random tokens
and prints tokens/s, milliseconds per step and MFU: the achieved FLOP/s (6 N per token for the
weights plus 12 L T D for attention) as a fraction of the matmul peak measured here, in the same
run, at the same precision. transformers' column appears when it is installed (`pip install
'gptlab[hf]'`); it runs in float32 eager mode only.

    python benchmarks/train_throughput.py            # the full table (several minutes with compile)
    python benchmarks/train_throughput.py --quick    # float32 and bf16, no compile
    python benchmarks/train_throughput.py --nanogpt ~/nanoGPT --only-nanogpt   # the step-rate race
    python benchmarks/train_throughput.py --nanogpt ~/nanoGPT --only-nanogpt --quick   # ... uncompiled

With --nanogpt PATH (a nanoGPT checkout; MIT licensed, not part of gptlab) it also races a full
float32 step of nanoGPT's own model and optimiser against gptlab's `nanogpt-cpu` preset at nanoGPT's
CPU recipe (4 x 128, no biases, exact GELU, context 64, batch 12), timing the two alternately in
rounds in this one process, and prints the ratio of their step rates. Both step on random tokens,
so neither data sampler is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.common import autocast
from gptlab.config import ModelConfig, TrainConfig
from gptlab.model import GPT
from gptlab.training.optim import make_optimizer


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch_size: int


SIZES = [
    Size("4x128 ctx64 (CPU recipe)", 4, 128, 4, 64, 12),
    Size("6x384 ctx64", 6, 384, 6, 64, 12),
    Size("6x384 ctx256", 6, 384, 6, 256, 12),
]
VOCAB = 65


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """Best FLOP/s of an n x n matmul in `dtype` (what MFU is measured against)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(model: torch.nn.Module, size: Size) -> float:
    """Training FLOPs per token: 6 per weight (forward + backward) plus attention's 12 L T D."""
    n_params = sum(p.numel() for p in model.parameters())
    return 6 * n_params + 12 * size.n_layer * size.block_size * size.n_embd


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Median seconds per call of `step` after `warmup` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gptlab_step(size: Size, dtype: torch.dtype, compile_model: bool, config: ModelConfig | None = None,
                train_config: TrainConfig | None = None) -> tuple[GPT, Callable[[], None]]:
    """A full gptlab training step on random tokens (the default model and optimiser of that size)."""
    config = config or ModelConfig(vocab_size=VOCAB, block_size=size.block_size, n_layer=size.n_layer,
                                   n_head=size.n_head, n_embd=size.n_embd)
    train_config = train_config or TrainConfig()
    model = GPT(config)
    optimizer = make_optimizer(model, train_config)
    forward = torch.compile(model) if compile_model else model
    x = torch.randint(0, VOCAB, (size.batch_size, size.block_size))
    device = torch.device("cpu")

    def step() -> None:
        with autocast(device, dtype):
            _, loss = forward(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def transformers_step(size: Size) -> tuple[torch.nn.Module, Callable[[], None]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=size.block_size, n_embd=size.n_embd,
                        n_layer=size.n_layer, n_head=size.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (size.batch_size, size.block_size))

    def step() -> None:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def nanogpt_step(checkout: Path) -> tuple[torch.nn.Module, Callable[[], None]]:
    """A full step of nanoGPT's model and optimiser (its own configure_optimizers) at its CPU recipe."""
    sys.path.insert(0, str(checkout))
    from model import GPT as NanoGPT  # nanoGPT's model.py, imported from the checkout
    from model import GPTConfig

    size = SIZES[0]
    model = NanoGPT(GPTConfig(block_size=size.block_size, vocab_size=VOCAB, n_layer=size.n_layer,
                              n_head=size.n_head, n_embd=size.n_embd, dropout=0.0, bias=False))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter counts
        optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    x = torch.randint(0, VOCAB, (size.batch_size, size.block_size))

    def step() -> None:
        _, loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def race(checkout: Path, rounds: int, steps: int, compiled: bool = False) -> None:
    """nanoGPT's step against gptlab's nanogpt-cpu preset, timed alternately in `rounds` rounds; with
    `compiled` also gptlab's step with its model under torch.compile (as `gptlab train --compile`)."""
    from gptlab.training.presets import resolve_configs

    model_config, train_config = resolve_configs("nanogpt-cpu", None, {"vocab_size": VOCAB})
    contestants = {"gptlab nanogpt-cpu": gptlab_step(SIZES[0], torch.float32, False, model_config,
                                                     train_config)[1]}
    if compiled:
        started = time.perf_counter()
        step = gptlab_step(SIZES[0], torch.float32, True, model_config, train_config)[1]
        for _ in range(3):
            step()
        print(f"torch.compile and 3 steps: {time.perf_counter() - started:.1f} s")
        contestants["gptlab nanogpt-cpu --compile"] = step
    contestants["nanoGPT"] = nanogpt_step(checkout)[1]
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, step in contestants.items():
            times[name].append(time_steps(step, warmup=2, steps=steps))
    best = {name: min(values) for name, values in times.items()}
    tokens = SIZES[0].batch_size * SIZES[0].block_size
    print(f"\nStep-rate race at nanoGPT's CPU recipe (float32), {rounds} alternating rounds of {steps} "
          "steps, best round's median:\n")
    print("| implementation | ms/step | steps/s | tokens/s |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {1 / seconds:.1f} | {tokens / seconds:,.0f} |")
    for name in contestants:
        if name != "nanoGPT":
            print(f"\n{name}: step rate {best['nanoGPT'] / best[name]:.2f}x nanoGPT's")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="skip torch.compile")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout, to race its step against gptlab's")
    parser.add_argument("--only-nanogpt", action="store_true", help="run only the race with nanoGPT")
    args = parser.parse_args()
    if args.nanogpt:
        race(args.nanogpt.resolve(), rounds=5, steps=args.steps, compiled=not args.quick)
    if args.only_nanogpt:
        return
    torch.manual_seed(0)
    peaks = {torch.float32: matmul_peak(torch.float32), torch.bfloat16: matmul_peak(torch.bfloat16)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; matmul peak 2048^2: "
          f"float32 {peaks[torch.float32] / 1e9:.0f} GFLOP/s, "
          f"bfloat16 {peaks[torch.bfloat16] / 1e9:.0f} GFLOP/s\n")
    print(f"| {'model':<26} | {'implementation':<22} | {'tokens/s':>9} | {'ms/step':>8} | {'MFU':>6} |")
    print(f"|{'-' * 28}|{'-' * 24}|{'-' * 11}|{'-' * 10}|{'-' * 8}|")
    variants = [(torch.float32, False), (torch.bfloat16, False)]
    if not args.quick:
        variants += [(torch.float32, True), (torch.bfloat16, True)]
    for size in SIZES:
        tokens = size.batch_size * size.block_size
        rows = []
        for dtype, compile_model in variants:
            model, step = gptlab_step(size, dtype, compile_model)
            precision = "bf16" if dtype == torch.bfloat16 else "fp32"
            label = f"gptlab {precision}{' compile' if compile_model else ''}"
            rows.append((label, model, step, peaks[dtype]))
        with contextlib.suppress(ImportError):
            model, step = transformers_step(size)
            rows.append(("transformers fp32", model, step, peaks[torch.float32]))
        for label, model, step, peak in rows:
            seconds = time_steps(step, warmup=3, steps=args.steps)
            mfu = flops_per_token(model, size) * tokens / seconds / peak
            print(f"| {size.name:<26} | {label:<22} | {tokens / seconds:>9,.0f} | {seconds * 1e3:>8.1f} | "
                  f"{mfu:>6.1%} |", flush=True)


if __name__ == "__main__":
    main()
