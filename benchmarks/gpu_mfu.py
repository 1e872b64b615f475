"""Model FLOP utilisation of a GPT-2-124M-shaped training step on one CUDA GPU, in bfloat16 autocast.

A step is what `gptlab train` does with each batch: forward and loss under bfloat16 autocast (float32
weights), backward, gradient clipping at 1.0 and gptlab's fused AdamW update, on B x T random token ids.
The model is GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024, tied head) with the
vocabulary padded to 50,304 as nanoGPT and llm.c pad it. Model FLOPs per token are 6 per weight of every
nn.Linear (the tied head once) plus 12 L T D for attention's scores and mixing (the count of PaLM's
appendix B and nanoGPT's `estimate_mfu`, causal half included). MFU divides the achieved rate by the
GPU's dense bfloat16 peak from its data sheet (PEAK_BF16_TFLOPS, matched on the device's name;
`--peak-tflops` for another GPU), and the last column divides it by a bfloat16 8192^3 product's rate
measured in the same run. llm.c reports about 40% of peak on such a step. Each figure is the mean of
`--steps` timed steps after `--warmup` untimed ones (torch.compile compiles in those).

    python benchmarks/gpu_mfu.py                                   # eager, then torch.compile
    python benchmarks/gpu_mfu.py --device cpu --tiny --no-compile  # tiny, on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from gptlab.common import autocast, cpu_name
from gptlab.config import ModelConfig, TrainConfig
from gptlab.model import GPT
from gptlab.training.optim import make_optimizer

# Dense (no sparsity) bfloat16 tensor-core peaks from NVIDIA's data sheets, TFLOP/s; the first name
# contained in the device's name wins, so the PCIe H100 comes before the SXM one.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0,
                    "L40S": 362.0, "A10G": 70.0, "L4": 121.0}
GPT2_SMALL = ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0)
TINY = ModelConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0)


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token: 6 per nn.Linear weight (forward and the two backward products) + 12 L T D."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    return 6 * weights + 12 * c.n_layer * c.block_size * c.n_embd


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(work: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Mean wall seconds of `work()` over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        work()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def product_tflops(device: torch.device, size: int) -> float:
    """TFLOP/s of a bfloat16 (size x size) @ (size x size) product on the device."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * size**3 / seconds_per_call(lambda: a @ b, device, warmup=3, repeats=10) / 1e12


def training_step(model: torch.nn.Module, config: ModelConfig, device: torch.device,
                  batch: int) -> Callable[[], None]:
    """One of gptlab's training steps on a fixed random batch: bfloat16 forward, backward, clip, AdamW."""
    tokens = torch.randint(config.vocab_size, (batch, config.block_size + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    optimizer = make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4))

    def step() -> None:
        with autocast(device, torch.bfloat16):
            _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(config: ModelConfig, device: torch.device, batch: int, compiled: bool, warmup: int,
            steps: int) -> tuple[float, float]:
    """(seconds per step, model FLOPs per step) of a fresh model, eager or under torch.compile."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    flops = flops_per_token(model) * batch * config.block_size
    runnable = torch.compile(model) if compiled else model
    seconds = seconds_per_call(training_step(runnable, config, device, batch), device, warmup, steps)
    del model, runnable
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds, flops


def device_name(device: torch.device) -> str:
    """The GPU's name as CUDA reports it, or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def peak_tflops(name: str, given: float | None) -> float | None:
    """The dense bfloat16 peak: --peak-tflops, else the data-sheet figure of the first name it contains."""
    if given:
        return given
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a check")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (default 32 x 1024 tokens)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--tiny", action="store_true", help="a 2 x 64 model and a 512^3 product: a "
                        "quick check")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bfloat16 peak, when not "
                        "in the table")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"torch {torch.__version__} sees no CUDA GPU: run where one is (or --device cpu)")
    config = TINY if args.tiny else GPT2_SMALL
    name = device_name(device)
    peak = peak_tflops(name, args.peak_tflops)
    measured = product_tflops(device, 512 if args.tiny else 8192)
    print(f"device: {name}; torch {torch.__version__}, CUDA {torch.version.cuda or '-'}; dense bf16 peak "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'unknown (give --peak-tflops)'}; a bf16 product measured "
          f"{measured:.3g} TFLOP/s\n")
    print(f"| model | step | batch x context | ms/step | tokens/s | model TFLOP/s | MFU (of "
          f"{f'{peak:.0f}' if peak else '?'}) | of the measured product ({measured:.3g}) |")
    print("|---|---|---|---|---|---|---|---|")
    shape = f"{config.n_layer}x{config.n_embd}, V {config.vocab_size:,}"
    for compiled in (False, True)[: 1 if args.no_compile else 2]:
        seconds, flops = measure(config, device, args.batch, compiled, args.warmup, args.steps)
        rate = flops / seconds / 1e12
        mfu = f"{rate / peak:.1%}" if peak else "-"
        tokens = args.batch * config.block_size
        print(f"| {shape} | bf16 autocast, {'torch.compile' if compiled else 'eager'} | {args.batch} x "
              f"{config.block_size} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {rate:.3g} | {mfu} | "
              f"{rate / measured:.1%} |", flush=True)

if __name__ == "__main__":
    main()
