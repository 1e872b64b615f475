"""Serving memory: the resident memory of `gptlab serve` at start-up and under 16 concurrent requests.

Builds random-weight runs of SmolLM2-135M's shape (576 wide, 9 heads sharing 3 key/value heads, RMSNorm,
SwiGLU 1536, RoPE, tied head, context 8192, vocabulary 49152) with 4 layers and with its real 30,
written with gptlab's own checkpoint functions and a char tokenizer of 49,152 characters (so the
vocabulary is the model's, and every id decodes). For each, `python -m gptlab serve RUN --port 0` runs
as its own process; the script reads its VmRSS and peak VmHWM from /proc/PID/status at start-up, then
sends 16 concurrent completions of 512 prompt tokens and 256 new tokens (temperature 0.8, a seed
each) and reads them again, polling VmRSS meanwhile for the largest value seen. It prints a markdown
table with the CPU, the date and the time the 16 requests took.

`--before PATH` (or $GPTLAB_BEFORE) also runs another checkout's src (e.g. a worktree of HEAD:
`git worktree add /tmp/before HEAD`) on the 4-layer run, so before and after are measured in one
script run; the 30-layer run is left out there, since a cache allocated for 64 rows x 8192 tokens of
30 layers (24 GB) does not fit. Only flags both versions know are passed (--port, --max-batch).

    python benchmarks/serve_memory.py --before /tmp/before      # a few minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.common import cpu_name
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.text.tokenizer import CharTokenizer

HERE = Path(__file__).resolve().parents[1] / "src"
VOCAB = 49152
FIRST_CHAR = 0x100  # 49,152 code points from here end at U+C0FF, before the surrogates
REQUESTS, PROMPT_TOKENS, NEW_TOKENS = 16, 512, 256


def smollm2_shape(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, block_size=8192, n_layer=layers, n_head=9, n_kv_head=3, n_embd=576,
                       norm="rmsnorm", ffn="swiglu", ffn_mult=1536 / 576, positions="rope", tied=True,
                       bias=False)


def write_run(folder: Path, layers: int) -> Path:
    """A run folder with random weights of SmolLM2-135M's shape and `layers` layers."""
    tokenizer = CharTokenizer("".join(chr(FIRST_CHAR + i) for i in range(VOCAB)))
    torch.manual_seed(0)
    model = GPT(smollm2_shape(layers))
    save_checkpoint(folder / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    return folder


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024  # reported in kB
    return fields


def start_server(run: Path, src: Path, max_batch: int | None) -> tuple[subprocess.Popen, str]:
    """`gptlab serve RUN --port 0` with `src` first on the path; its URL from the line it prints."""
    flags = [] if max_batch is None else ["--max-batch", str(max_batch)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    process = subprocess.Popen([sys.executable, "-m", "gptlab", "serve", str(run), "--port", "0", *flags],
                               stdout=subprocess.PIPE, text=True, env=env)
    for line in process.stdout:
        if " at http://" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # never block its prints
            return process, line.split(" at ")[1].split()[0]
    process.wait()
    raise SystemExit(f"the server from {src} did not start (exit code {process.returncode})")


def prompt(i: int) -> str:
    """512 characters (tokens) of the run's alphabet, different for each request."""
    return "".join(chr(FIRST_CHAR + (i * 7919 + 31 * k) % VOCAB) for k in range(PROMPT_TOKENS))


async def sixteen(url: str) -> float:
    """Send the 16 requests at once; seconds until the last one ended."""
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=REQUESTS + 1)) as client:
        async def one(i: int) -> None:
            reply = await client.post(f"{url}/v1/completions", json={
                "prompt": prompt(i), "max_tokens": NEW_TOKENS, "temperature": 0.8, "seed": i})
            reply.raise_for_status()
            assert reply.json()["usage"]["completion_tokens"] == NEW_TOKENS, reply.text[:200]

        begin = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        return time.perf_counter() - begin


def measure(label: str, run: Path, src: Path, layers: int, max_batch: int | None) -> str:
    """One table row: memory at start-up, the largest seen under load, the peak, and the time taken."""
    process, url = start_server(run, src, max_batch)
    try:
        started = memory(process.pid)
        largest, done = [started["VmRSS"]], threading.Event()

        def poll() -> None:
            while not done.wait(0.05):
                largest.append(memory(process.pid)["VmRSS"])

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        seconds = asyncio.run(sixteen(url))
        done.set()
        poller.join()
        after = memory(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)
    gb = 1e9
    return (f"| {label} | {layers} | {started['VmRSS'] / gb:.2f} | {max(largest) / gb:.2f} | "
            f"{after['VmHWM'] / gb:.2f} | {seconds:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=os.environ.get("GPTLAB_BEFORE"),
                        help="another checkout (its src/ is run) to measure on the 4-layer run too")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 30])
    parser.add_argument("--max-batch", type=int, help="passed to both servers (default: theirs)")
    args = parser.parse_args()
    print(f"{REQUESTS} concurrent requests of {PROMPT_TOKENS} prompt and {NEW_TOKENS} new tokens, "
          f"SmolLM2-135M's shape with random weights; {cpu_name()}, {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| code | layers | VmRSS at start-up (GB) | largest VmRSS under load (GB) | peak VmHWM (GB) | "
          "16 requests (s) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            run = write_run(Path(tmp) / f"smollm2-{layers}", layers)
            if args.before is not None and layers == 4:  # 30 layers do not fit before the change
                print(measure("before", run, args.before / "src", layers, args.max_batch), flush=True)
            print(measure("after", run, HERE, layers, args.max_batch), flush=True)


if __name__ == "__main__":
    main()
