"""Tokens/s and memory per process of `gptlab train` under torchrun: 1, 2 and 4 processes, DDP and FSDP.

FSDP on several processes runs twice: saving sharded checkpoints (each process writes its shards, the
default) and saving one gathered file (--checkpoint-format file). Each cell
trains the same model for the same steps with the global batch split over the processes,
each process given cores / processes threads (at least one), and reports the training rate that
`gptlab train` prints and the largest resident memory any worker reached (sampled every 50 ms with
psutil, installed with gptlab[hf]). On a machine with fewer cores than processes this shows the cost
of the collectives, not a speed-up. The last table is an estimate on paper for GPT-2 124M on 8 GPUs
from the per-step arithmetic and the bytes each strategy moves.

    python benchmarks/scaling.py                  # 6 x 384, context 256, batch 8: a few minutes
    python benchmarks/scaling.py --steps 10 --processes 1 2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from gptlab.common import cpu_name
from gptlab.data.prepare import prepare

FINISHED = re.compile(r"finished at step \d+: ([\d,]+) tokens/s")


def peak_worker_rss(agent: psutil.Process, stop: threading.Event, peak: list[int]) -> None:
    """Sample the resident memory of the agent's worker processes until `stop`; keep the largest."""
    while not stop.is_set():
        try:
            sizes = [child.memory_info().rss for child in agent.children()]
        except psutil.Error:
            sizes = []
        peak[0] = max([peak[0], *sizes])
        time.sleep(0.05)


def cell(processes: int, parallel: str, checkpoints: str, args: argparse.Namespace,
         work: Path) -> tuple[float, float]:
    """Train one configuration; its tokens/s while training and the largest worker's memory in MiB."""
    threads = max(1, (os.cpu_count() or 1) // processes)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "gptlab", "train", "--preset", "small", "--dropout", "0", "--data", str(work / "data"),
               "--out", str(work / f"{parallel}-{checkpoints}-{processes}"),
               "--batch-size", str(args.batch_size),
               "--block-size", str(args.block_size), "--max-steps", str(args.steps), "--eval-interval",
               str(args.steps), "--eval-batches", "1", "--warmup-steps", "1", "--parallel", parallel,
               "--precision", "float32", "--device", "cpu", "--samples", "0", "--no-progress",
               "--checkpoint-format", checkpoints]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=peak_worker_rss, args=(psutil.Process(agent.pid), stop, peak))
    sampler.start()
    out, _ = agent.communicate()
    stop.set()
    sampler.join()
    match = FINISHED.search(out)
    if agent.returncode != 0 or match is None:
        sys.exit(f"{parallel} x {processes} failed:\n{out[-3000:]}")
    return float(match[1].replace(",", "")), peak[0] / 2**20


def paper_estimate() -> None:
    """GPT-2 124M on 8 GPUs: compute and communication per step, from the arithmetic and the bytes."""
    params, tokens = 124e6, 8 * 12 * 1024  # 8 GPUs x 12 sequences x 1,024 tokens
    flops = 6 * params * tokens + 12 * 12 * 1024 * 768 * tokens  # products, forward and backward
    gpu, link = 312e12 * 0.4, 300e9  # A100 bf16 peak at 40% of it; NVLink, bytes/s each way per GPU
    grads = params * 4  # float32 gradients (bytes)
    volumes = {"DDP": 2 * 7 / 8 * grads,  # ring all-reduce: each GPU sends 2 (N-1)/N of the buffer
               "FSDP": 3 * 7 / 8 * grads}  # all-gather (forward), all-gather (backward), reduce-scatter
    print("\nOn paper, GPT-2 124M on 8 A100s (bf16 at 40% of 312 TFLOP/s, NVLink 300 GB/s), global batch "
          "8 x 12 x 1,024 tokens:\n")
    print("| strategy | compute per step, ms | bytes sent per GPU per step | communication, ms | "
          "if not overlapped |")
    print("|---|---|---|---|---|")
    compute = flops / 8 / gpu * 1000
    for name, volume in volumes.items():
        comm = volume / link * 1000
        print(f"| {name} | {compute:.0f} | {volume / 2**20:,.0f} MiB | {comm:.1f} | "
              f"{comm / (compute + comm):.0%} of the step |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    parser.add_argument("--block-size", type=int, default=256)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gptlab-scaling-") as tmp:
        prepare("shakespeare", Path(tmp) / "data", tokenizer="char", progress=False)
        for parallel, checkpoints in (("ddp", "auto"), ("fsdp", "auto"), ("fsdp", "file")):
            for processes in args.processes:
                if processes == 1 and checkpoints == "file":
                    continue  # one process saves a file either way (auto)
                rate, rss = cell(processes, parallel, checkpoints, args, Path(tmp))
                rows.append((parallel, checkpoints, processes, rate, rss))
                print(f"{parallel} x {processes}, {checkpoints}: {rate:,.0f} tokens/s, {rss:,.0f} MiB",
                      flush=True)
    print(f"\n{cpu_name()}, {os.cpu_count()} cores; `small` preset (6 x 384, {args.block_size} context), "
          f"global batch {args.batch_size}, {args.steps} steps, float32\n")
    print("| strategy | checkpoints | processes | tokens/s | largest worker's memory, MiB |")
    print("|---|---|---|---|---|")
    for parallel, checkpoints, processes, rate, rss in rows:
        saved = "sharded" if parallel == "fsdp" and checkpoints == "auto" and processes > 1 else "one file"
        print(f"| {parallel.upper()} | {saved} | {processes} | {rate:,.0f} | {rss:,.0f} |")
    paper_estimate()


if __name__ == "__main__":
    main()
