"""Serving throughput: `gptlab serve` driven over HTTP by 1, 4, 16 and 64 concurrent streaming clients.

The server runs as its own process (`python -m gptlab serve RUN --port 0`), as a user runs it. For
each number of clients C, C clients each stream one completion at the same moment (POST
/v1/completions, stream=true, temperature 0.8, a seed per client, --max-tokens new tokens, prompts of
8 to 32 characters); then the very same C requests are sent one at a time. For both it prints
requests/s and tokens/s over the wall time, the time to first token (request sent to the first
token's chunk) and the request latency, at the median and the 95th percentile, as a markdown table
with the CPU, the date and the load average.

Without --run the model is the `demo` preset's shape (4 layers, 4 heads, 128 wide, context 64) with
random weights and a char tokenizer of printable ASCII, written to a temporary run folder: serving
speed does not depend on what the weights learned, and nothing needs training.

    python benchmarks/serve.py                         # about a minute on a 2-core CPU
    python benchmarks/serve.py --run runs/demo --clients 1 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.common import cpu_name
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer
from gptlab.training.presets import PRESETS

TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


@dataclass(frozen=True)
class Result:
    """One request: seconds to its first token and to its end, and how many tokens it got."""

    first_token_s: float
    latency_s: float
    tokens: int


def demo_run(folder: Path) -> Path:
    """A run folder holding the demo preset's shape with random weights and a printable-ASCII vocabulary."""
    tokenizer = CharTokenizer(string.printable[:95])
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**PRESETS["demo"]["model"], "vocab_size": tokenizer.vocab_size}))
    save_checkpoint(folder / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    return folder


def start_server(run: Path) -> tuple[subprocess.Popen, str]:
    """`gptlab serve RUN --port 0` in a new process; its URL from the line it prints."""
    process = subprocess.Popen([sys.executable, "-m", "gptlab", "serve", str(run), "--port", "0",
                                "--max-tokens", "4096"], stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if " at http://" not in line:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return process, line.split(" at ")[1].split()[0]


def body(i: int, max_tokens: int) -> dict:
    start = (7 * i) % (len(TEXT) - 32)
    return {"prompt": TEXT[start:start + 8 + (i * 5) % 25], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": i, "stream": True}


async def one(client: httpx.AsyncClient, url: str, request: dict) -> Result:
    begin = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=request) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - begin
            if "usage" in chunk:
                tokens = chunk["usage"]["completion_tokens"]
    return Result(first or 0.0, time.perf_counter() - begin, tokens)


async def concurrent(url: str, requests: list[dict]) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        begin = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, r) for r in requests))
        return list(results), time.perf_counter() - begin


async def sequential(url: str, requests: list[dict]) -> tuple[list[Result], float]:
    async with httpx.AsyncClient(timeout=600) as client:
        begin = time.perf_counter()
        results = [await one(client, url, r) for r in requests]
        return results, time.perf_counter() - begin


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def row(clients: int, mode: str, results: list[Result], wall: float, speedup: str) -> str:
    first = [r.first_token_s * 1000 for r in results]
    latency = [r.latency_s * 1000 for r in results]
    tokens = sum(r.tokens for r in results)
    return (f"| {clients} | {mode} | {len(results) / wall:.2f} | {tokens / wall:,.0f} | {speedup} | "
            f"{statistics.median(first):,.0f} | {p95(first):,.0f} | {statistics.median(latency):,.0f} | "
            f"{p95(latency):,.0f} |")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run folder (default: the demo shape, random weights)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or demo_run(Path(tmp) / "demo-shape")
        process, url = start_server(run)
        try:
            asyncio.run(sequential(url, [body(0, 8)]))  # warm up
            shown = run if args.run else "demo-shaped run (random weights)"
            print(f"`gptlab serve {shown}`, {args.max_tokens} "
                  f"new tokens per request; {cpu_name()}, {torch.get_num_threads()} threads, "
                  f"{time.strftime('%Y-%m-%d %H:%M')}, load average before: {load_average()}\n")
            print("| clients | served | requests/s | tokens/s | speed-up | TTFT p50 (ms) | TTFT p95 (ms) | "
                  "latency p50 (ms) | latency p95 (ms) |")
            print("|---|---|---|---|---|---|---|---|---|")
            for clients in args.clients:
                requests = [body(i, args.max_tokens) for i in range(clients)]
                together, wall = asyncio.run(concurrent(url, requests))
                alone, alone_wall = asyncio.run(sequential(url, requests))
                rate = sum(r.tokens for r in together) / wall
                alone_rate = sum(r.tokens for r in alone) / alone_wall
                print(row(clients, "concurrently", together, wall, f"{rate / alone_rate:.1f}x"), flush=True)
                print(row(clients, "one at a time", alone, alone_wall, "1.0x"), flush=True)
            print(f"\nload average after: {load_average()}")
        finally:
            process.terminate()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
