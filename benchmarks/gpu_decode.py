"""Batch-1 decoding speed on one CUDA GPU: gptlab's KV-cache decoder on GPT-2 small's shape.

The model has random weights and GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024,
vocabulary 50,257, tied head); decoding is greedy, after a one-token prompt, for `--new` new tokens,
with the weights held in float32 and then in bfloat16 (`model.to(dtype)`, as `gptlab sample --dtype`
holds them), each rate the best of `--repeats` runs after one untimed run. Beside each rate is the bound
no batch-1 decoder can beat: the device's copy bandwidth (bytes read and written per second, a 1 GiB
tensor copied) over the bytes of the weights one step reads. A model this small decodes one kernel
launch after another, so on a GPU its rate is far under that bound: the rate is the figure to follow.

    python benchmarks/gpu_decode.py
    python benchmarks/gpu_decode.py --device cpu --tiny    # a tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import time

import torch

from gptlab.common import cpu_name
from gptlab.config import ModelConfig, SamplingConfig
from gptlab.generate import generate
from gptlab.model import GPT

GPT2_SMALL = ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
TINY = ModelConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Bytes per second moved by copying one tensor into another (read + write), best of `repeats`."""
    source = torch.rand(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy also faults the target's pages in
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def decode_seconds(model: GPT, new_tokens: int, device: torch.device) -> float:
    """Wall seconds from the call until the last of `new_tokens` greedy tokens after a one-token prompt."""
    sampling = SamplingConfig(temperature=0, max_new_tokens=new_tokens)
    synchronize(device)
    start = time.perf_counter()
    for _ in generate(model, [[0]], sampling):
        pass
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a check")
    parser.add_argument("--new", type=int, default=512, help="new tokens per run (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the best is shown")
    parser.add_argument("--tiny", action="store_true", help="a 2 x 64 model and a small copy: a quick check")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"torch {torch.__version__} sees no CUDA GPU: run where one is (or --device cpu)")
    config = TINY if args.tiny else GPT2_SMALL
    new_tokens = min(args.new, config.block_size - 1)
    bandwidth = copy_bandwidth(device, 64 if args.tiny else 1024)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"device: {name}; torch {torch.__version__}, CUDA {torch.version.cuda or '-'}; copy bandwidth "
          f"{bandwidth / 1e9:,.0f} GB/s (read + write)\n")
    print("| model | weights | new tokens | tokens/s | ms/token | bound: bandwidth / weight bytes, "
          "tokens/s |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        decode_seconds(model, new_tokens, device)  # untimed: kernels chosen, caches warm
        best = min(decode_seconds(model, new_tokens, device) for _ in range(args.repeats))
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"| {config.n_layer}x{config.n_embd}, V {config.vocab_size:,} | "
              f"{str(dtype).removeprefix('torch.')} | {new_tokens} | {new_tokens / best:,.0f} | "
              f"{best / new_tokens * 1e3:.2f} | {bandwidth / weight_bytes:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
