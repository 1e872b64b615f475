"""Fine-tuning step time and memory: full fine-tuning against LoRA (gptlab.lora), on this machine.

For each shape it times training steps (forward, backward, fused AdamW step) on random tokens, in
float32, for every weight trained and for LoRA adapters of rank 8 on the attention and FFN projections
(base frozen), and prints a markdown table: trainable parameters, the fastest and the median step
time (the fastest is the one least disturbed by other work on a shared machine), the peak resident
memory of the process (VmHWM) beside its resident memory once the model was built, and the bytes of
AdamW's state (its two moments per trained number). Each row runs in a fresh process, so its peak is
its own; glibc is told to give every block over 64 kB straight back to the system when freed
(MALLOC_MMAP_THRESHOLD_), so the peak is of live tensors, not of a heap that kept freed memory.

Shapes: the README's demo model (4 x 128, context 64, batch 48, a 65-character vocabulary) and a
SmolLM2-135M-shaped Llama (30 x 576, 9 heads sharing 3 key/value heads, RMSNorm, SwiGLU 1536, RoPE,
vocabulary 49152, tied head; context 512, batch 4) with random weights.

    python benchmarks/finetune_step.py                  # both shapes (a few minutes on 2 cores)
    python benchmarks/finetune_step.py --shapes demo    # the demo shape only
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from gptlab.common import cpu_name
from gptlab.config import ModelConfig, TrainConfig
from gptlab.lora import LoraConfig, add_lora, trainable_parameters
from gptlab.model import GPT
from gptlab.training.optim import adamw


@dataclass(frozen=True)
class Shape:
    model: dict[str, Any]
    batch_size: int
    warmup: int  # untimed steps first (allocator and kernel warm-up)
    steps: int  # timed steps


SHAPES = {
    "demo": Shape(dict(vocab_size=65, n_layer=4, n_head=4, n_embd=128, block_size=64, ffn="gelu_exact"),
                  batch_size=48, warmup=5, steps=40),
    "smollm2-135m": Shape(dict(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                               ffn_mult=1536 / 576, block_size=512, norm="rmsnorm", ffn="swiglu",
                               positions="rope", bias=False, tied=True, rope_base=100000.0),
                          batch_size=4, warmup=1, steps=4),
}
LORA = LoraConfig(r=8, alpha=16)


def resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak so far) of this process, from /proc (Linux)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} is not in /proc/self/status")


def measure(shape_name: str, lora: bool) -> dict[str, float]:
    """One row, run in its own process: build, optionally add LoRA, step, and read the counters."""
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    model = GPT(ModelConfig(**shape.model)).train()
    if lora:
        add_lora(model, LORA)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, TrainConfig(lr=1e-4, weight_decay=0.1))
    tokens = torch.randint(0, model.config.vocab_size, (shape.batch_size, model.config.block_size + 1))
    built = resident_bytes("VmRSS")
    times = []
    for step in range(shape.warmup + shape.steps):
        begin = time.perf_counter()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= shape.warmup:
            times.append(time.perf_counter() - begin)
    state = sum(t.numel() * t.element_size() for slots in optimizer.state.values()
                for t in slots.values() if torch.is_tensor(t))
    return {"trainable": trainable_parameters(model), "total": model.num_parameters(),
            "best_ms": 1000 * min(times), "median_ms": 1000 * statistics.median(times),
            "built": built, "peak": resident_bytes("VmHWM"), "optimizer": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    print(f"float32, fused AdamW, {torch.get_num_threads()} threads; LoRA r={LORA.r} alpha={LORA.alpha:g} "
          f"on {', '.join(LORA.targets)}; {cpu_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| shape | training | trainable params | step ms (best) | step ms (median) | RSS once built (MB) "
          "| peak RSS (MB) | AdamW state (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc when each row's process starts
    spawn = multiprocessing.get_context("spawn")  # a fresh process per row: its own peak memory
    for name in args.shapes:
        shape = SHAPES[name]
        for lora in (False, True):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                row = pool.submit(measure, name, lora).result()
            mb = 1e6
            label = f"LoRA r={LORA.r}" if lora else "full"
            print(f"| {name} (batch {shape.batch_size} x {shape.model['block_size']}) | {label} | "
                  f"{row['trainable']:,.0f} of {row['total']:,.0f} | "
                  f"{row['best_ms']:.1f} | {row['median_ms']:.1f} | "
                  f"{row['built'] / mb:.0f} | {row['peak'] / mb:.0f} | {row['optimizer'] / mb:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
