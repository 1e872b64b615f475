"""Serving speed: `gptlab serve` driven over HTTP: throughput under 1 to 64 concurrent streaming clients, the
cost of structured output, the prefix cache over a chat, and prompt-lookup speculative decoding.

Every server runs as its own process (`python -m gptlab serve RUN --port 0`), as a user runs it. For
each number of clients C, C clients each stream one completion at the same moment (POST
/v1/completions, stream=true, temperature 0.8, a seed per client, --max-tokens new tokens, prompts of
8 to 32 characters); then the very same C requests are sent one at a time. For both it prints
requests/s and tokens/s over the wall time, the time to first token (request sent to the first
token's chunk) and the request latency, at the median and the 95th percentile, as a markdown table
with the CPU, the date and the load average.

Without --run the model is the `demo` preset's shape (4 layers, 4 heads, 128 wide, context 64) with
random weights and a char tokenizer of printable ASCII, written to a temporary run folder: serving
speed does not depend on what the weights learned, and nothing needs training.

The other tables (`--only` picks among them), one request at a time (batch 1):
- structured: tokens/s of free and JSON-schema-constrained decoding (temperature 0.8, the same seeds)
  on the demo shape and on SmolLM2-135M's shape (30 x 576, 9 query heads on 3 key/value heads, context
  8192) with random weights and a byte-level BPE of 49,152 tokens (49,148 trained on the Python standard
  library's sources, plus the chat template's 4 markers; the tables name the size it reached).
  Tokens/s counts from the first token to the last, so the prefill is left out.
- prefix: a chat of --turns turns on SmolLM2's shape (a system prompt, then each turn a user message
  and the reply, greedy, resent whole the next turn) against a server without the prefix cache
  (--prefix-cache-mb 0) and one with it: the time to the first token of every turn.
- speculative: prompt lookup (--speculative ngram, k 4, n 3) on a model that copies, the `induction`
  preset trained on `repeats` (trained first unless --induction-run names such a run), greedy, with
  `"speculative": false` and true on the same server (tokens compared); and on SmolLM2's random shape
  its cost when drafts are made every step and almost never accepted: the prompt cycles through 64
  token ids that logit_bias favours by 100, sampled at temperature 1, so prompt lookup always finds
  the last token earlier and the model keeps a drafted token with probability about 1/64.

    python benchmarks/serve.py                         # several minutes on a 2-core CPU
    python benchmarks/serve.py --run runs/demo --clients 1 16 --only throughput
    python benchmarks/serve.py --only structured prefix --smol-layers 4 --bpe-chars 2000000   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
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
from grammar_engines import stdlib_text
from prometheus_client.parser import text_string_to_metric_families

from gptlab.adapt.chat import add_chat_tokens
from gptlab.checkpoint import BEST, Checkpoint, model_tensors, save_checkpoint
from gptlab.common import cpu_name
from gptlab.config import ModelConfig
from gptlab.data.corpora import repeats_text
from gptlab.model import GPT
from gptlab.text.chat_template import NativeTemplate
from gptlab.text.tokenizer import BPETokenizer, CharTokenizer
from gptlab.training.presets import PRESETS

TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."
SMOLLM2 = dict(block_size=8192, n_head=9, n_kv_head=3, n_embd=576, ffn_mult=1536 / 576, norm="rmsnorm",
               ffn="swiglu", positions="rope", bias=False, rope_base=100000.0, norm_eps=1e-5)
# Eight bounded strings: a random model fills each to its bound, so the output runs to max_tokens.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 8, "maxItems": 8,
                                                     "items": {"type": "string", "maxLength": 40}}},
          "required": ["notes"], "additionalProperties": False}


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


def smol_run(folder: Path, layers: int, bpe_chars: int) -> str:
    """A run folder of SmolLM2-135M's shape (`layers` deep) with random weights and a byte-level BPE of (up
    to) 49,148 tokens trained on the standard library's sources, plus the native chat template's 4
    markers; the name the tables give it, with the vocabulary it reached."""
    begin = time.perf_counter()
    bpe = BPETokenizer.train(stdlib_text(bpe_chars), 49152 - len(NativeTemplate().special_tokens))
    torch.manual_seed(0)
    model, tokenizer = add_chat_tokens(GPT(ModelConfig(vocab_size=bpe.vocab_size, n_layer=layers, **SMOLLM2)),
                                       bpe, NativeTemplate())
    save_checkpoint(folder / BEST, Checkpoint(model.config, tokenizer.to_dict(), model_tensors(model)))
    print(f"SmolLM2-shaped run: {layers} layers, {tokenizer.vocab_size:,} tokens, built in "
          f"{time.perf_counter() - begin:.0f} s", flush=True)
    return f"SmolLM2 shape ({layers} layers), BPE V {tokenizer.vocab_size:,}"


def induction_run(folder: Path) -> Path:
    """The copying model: `gptlab train --preset induction --data repeats` into `folder`."""
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gptlab", "train", "--preset", "induction", "--data", "repeats",
                    "--out", str(folder), "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    print(f"trained the induction preset on repeats in {time.perf_counter() - begin:.0f} s", flush=True)
    return folder


def start_server(run: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`gptlab serve RUN --port 0 FLAGS` in a new process; its URL from the line it prints. Its stderr goes
    to a file, shown when it does not start (stopped, it only says so)."""
    errors = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([sys.executable, "-m", "gptlab", "serve", str(run), "--port", "0",
                                "--max-tokens", "4096", *flags], stdout=subprocess.PIPE, stderr=errors,
                               text=True)
    line = process.stdout.readline()
    if " at http://" not in line:
        process.kill()
        errors.seek(0)
        raise SystemExit(f"the server did not start: {line!r}\n{errors.read()[-2000:]}")
    return process, line.split(" at ")[1].split()[0]


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)  # Ctrl-C: the server stops as a user stops it
    process.wait(timeout=30)


def body(i: int, max_tokens: int) -> dict:
    start = (7 * i) % (len(TEXT) - 32)
    return {"prompt": TEXT[start:start + 8 + (i * 5) % 25], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": i, "stream": True, "stream_options": {"include_usage": True}}


async def one(client: httpx.AsyncClient, url: str, request: dict, route: str = "completions") -> Result:
    begin = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/{route}", json=request) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - begin
            if chunk.get("usage"):  # the last chunk, asked for with stream_options
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


def streamed(url: str, request: dict, route: str = "completions") -> Result:
    """One streamed request (its usage asked for), alone."""
    async def send() -> Result:
        async with httpx.AsyncClient(timeout=600) as client:
            return await one(client, url, request, route)

    return asyncio.run(send())


def decode_rate(result: Result) -> float:
    """Tokens/s from the first token to the last (the prefill left out)."""
    return (result.tokens - 1) / max(result.latency_s - result.first_token_s, 1e-9)


def counters(url: str) -> dict[str, float]:
    """The server's /metrics samples without labels, by name (prometheus-client's parser)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


def structured_rows(name: str, url: str, prompt: str, max_tokens: int, repeats: int) -> list[str]:
    """Free and constrained decoding on one server, `repeats` requests each, taking turns."""
    rates: dict[str, list[float]] = {"free": [], "JSON schema": []}
    tokens: dict[str, int] = {"free": 0, "JSON schema": 0}
    for seed in range(repeats + 1):  # the first round warms up (the grammar's view of the vocabulary)
        for kind in rates:
            request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
                       "stream": True, "stream_options": {"include_usage": True}}
            if kind != "free":
                request["structured_outputs"] = {"json": SCHEMA}
            result = streamed(url, request)
            if seed:
                rates[kind].append(decode_rate(result))
                tokens[kind] += result.tokens
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["JSON schema"])
    return [f"| {name} | free | {tokens['free']} | {free:,.1f} | - |",
            f"| {name} | JSON schema | {tokens['JSON schema']} | {constrained:,.1f} | "
            f"{1 - constrained / free:.1%} |"]


def chat_rows(urls: dict[str, str], turns: int, reply_tokens: int) -> list[str]:
    """A conversation of `turns` turns, sent whole every turn to each server: each turn's first token."""
    system = " ".join(TEXT for _ in range(12))  # about 1,100 characters
    ttft: dict[str, list[float]] = {name: [] for name in urls}
    sizes: list[int] = []
    for name, url in urls.items():
        messages = [{"role": "system", "content": system}]
        for turn in range(turns):
            user = f"Turn {turn + 1}. " + " ".join(TEXT[turn:] + TEXT[:turn] for _ in range(4))
            messages.append({"role": "user", "content": user})
            result, reply = chat_turn(url, messages, reply_tokens)
            messages.append({"role": "assistant", "content": reply})
            ttft[name].append(result.first_token_s)
            if len(sizes) < turns:
                sizes.append(result.tokens)
    without, with_cache = ttft.values()
    return [f"| {turn + 1} | {sizes[turn]:,} | {without[turn] * 1000:,.0f} | {with_cache[turn] * 1000:,.0f} "
            f"| {without[turn] / with_cache[turn]:.1f}x |" for turn in range(turns)]


def chat_turn(url: str, messages: list[dict], max_tokens: int) -> tuple[Result, str]:
    """One streamed greedy chat turn: its timing (tokens = the prompt's tokens) and the reply's text."""
    request = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, "speculative": False}
    begin, first, text, prompt_tokens = time.perf_counter(), None, "", 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                content = choice["delta"].get("content") or ""
                if content and first is None:
                    first = time.perf_counter() - begin
                text += content
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return Result(first or time.perf_counter() - begin, time.perf_counter() - begin, prompt_tokens), text


def speculative_rows(name: str, url: str, requests: list[dict], compare: bool) -> list[str]:
    """The same requests, one at a time, with `"speculative": false` and then true; tokens/s over the whole
    requests, the drafted and accepted tokens (/metrics), whether the texts are the same."""
    rows, texts, plain_rate = [], {}, 0.0
    for speculative in (False, True):
        before, begin, produced, texts[speculative] = counters(url), time.perf_counter(), 0, []
        for request in requests:
            answer = httpx.post(f"{url}/v1/completions", json={**request, "speculative": speculative},
                                timeout=600)
            reply = answer.raise_for_status().json()
            produced += reply["usage"]["completion_tokens"]
            texts[speculative].append(reply["choices"][0]["text"])
        rate, after = produced / (time.perf_counter() - begin), counters(url)
        names = ("gptlab_speculative_draft_tokens_total", "gptlab_speculative_accepted_tokens_total")
        drafted, accepted = (after[name] - before[name] for name in names)
        plain_rate = plain_rate or rate
        same = "-" if not speculative else ("yes" if texts[True] == texts[False] else "NO") if compare \
            else "n/a (sampled)"
        counts = f"{drafted:.0f} | {accepted:.0f} | {accepted / drafted:.0%}" if drafted else "- | - | -"
        rows.append(f"| {name} | {'ngram k=4 n=3' if speculative else 'plain'} | {produced} | {rate:,.1f} | "
                    f"{rate / plain_rate:.2f}x | {counts} | {same} |")
    return rows


def throughput_table(run: Path, shown: str, clients_counts: list[int], max_tokens: int) -> None:
    """The first table: C concurrent streaming clients, then the same C requests one at a time."""
    process, url = start_server(run)
    try:
        asyncio.run(sequential(url, [body(0, 8)]))  # warm up
        print(f"\n`gptlab serve {shown}`, {max_tokens} new tokens per request\n")
        print("| clients | served | requests/s | tokens/s | speed-up | TTFT p50 (ms) | TTFT p95 (ms) | "
              "latency p50 (ms) | latency p95 (ms) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for clients in clients_counts:
            requests = [body(i, max_tokens) for i in range(clients)]
            together, wall = asyncio.run(concurrent(url, requests))
            alone, alone_wall = asyncio.run(sequential(url, requests))
            rate = sum(r.tokens for r in together) / wall
            alone_rate = sum(r.tokens for r in alone) / alone_wall
            print(row(clients, "concurrently", together, wall, f"{rate / alone_rate:.1f}x"), flush=True)
            print(row(clients, "one at a time", alone, alone_wall, "1.0x"), flush=True)
    finally:
        stop_server(process)


def structured_table(demo: Path, smol: Path, smol_name: str, args: argparse.Namespace) -> None:
    """Free and constrained decoding at batch 1, on the demo shape and on SmolLM2's."""
    print(f"\nStructured output at batch 1 (temperature 0.8, median of {args.repeats} requests each; the "
          "JSON schema: an object of 8 strings of at most 40 characters)\n")
    print("| model | decoding | tokens | tokens/s | mask cost |")
    print("|---|---|---:|---:|---:|")
    for name, run, max_tokens in (("demo shape, char V 95", demo, args.max_tokens),
                                  (smol_name, smol, args.smol_tokens)):
        process, url = start_server(run, "--prefix-cache-mb", "0")
        try:
            rows = structured_rows(name, url, "ROMEO: But soft", max_tokens, args.repeats)
            print("\n".join(rows), flush=True)
        finally:
            stop_server(process)


def prefix_table(smol: Path, smol_name: str, args: argparse.Namespace) -> None:
    """A chat on SmolLM2's shape, without the prefix cache and with it: each turn's time to first token."""
    print(f"\nA chat of {args.turns} turns on {smol_name}, each reply {args.reply_tokens} greedy tokens, "
          "the conversation resent whole every turn\n")
    print("| turn | prompt tokens | TTFT without prefix cache (ms) | TTFT with it (ms) | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    servers = [start_server(smol, "--prefix-cache-mb", "0"), start_server(smol)]
    try:
        urls = {"without": servers[0][1], "with": servers[1][1]}
        for url in urls.values():
            chat_turn(url, [{"role": "user", "content": "hi"}], 2)  # warm up
        print("\n".join(chat_rows(urls, args.turns, args.reply_tokens)), flush=True)
    finally:
        for process, _ in servers:
            stop_server(process)


def speculative_table(induction: Path, smol: Path, smol_name: str, args: argparse.Namespace) -> None:
    """Prompt lookup on the copying model (greedy) and its worst case on SmolLM2's random shape."""
    print("\nPrompt-lookup speculative decoding at batch 1 (the same server, `\"speculative\": false` then "
          "true; tokens/s over whole requests)\n")
    print("| model | decoding | new tokens | tokens/s | vs plain | drafted | accepted | acceptance | "
          "same text |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    copying = [{"prompt": repeats_text(lines=1, seed=seed)[:40], "max_tokens": args.max_tokens,
                "temperature": 0} for seed in range(101, 101 + args.repeats + 2)]
    ids = (256 + torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:64]).tolist()  # merges
    rejected = [{"prompt": ids * 4, "max_tokens": args.smol_tokens, "temperature": 1.0, "seed": seed,
                 "logit_bias": {str(i): 100 for i in ids}} for seed in range(args.repeats)]
    greedy = [{"prompt": ids, "max_tokens": args.smol_tokens, "temperature": 0}]
    cases = [("induction (2x64, ctx 64), greedy", induction, copying, True),
             (f"{smol_name}, random, greedy", smol, greedy, True),
             (f"{smol_name}, random, drafts rejected, T 1", smol, rejected, False)]
    for name, run, requests, compare in cases:
        process, url = start_server(run, "--speculative", "ngram", "--prefix-cache-mb", "0")
        try:
            httpx.post(f"{url}/v1/completions", json={**requests[0], "max_tokens": 4}, timeout=600)  # warm up
            print("\n".join(speculative_rows(name, url, requests, compare)), flush=True)
        finally:
            stop_server(process)


TABLES = ("throughput", "structured", "prefix", "speculative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run folder (default: the demo shape, random weights)")
    parser.add_argument("--only", nargs="+", choices=TABLES, default=list(TABLES),
                        help="the tables to measure (default all)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="new tokens per request of the demo shape and the copying model (default 128)")
    parser.add_argument("--smol-tokens", type=int, default=64,
                        help="new tokens per request of SmolLM2's shape (default 64)")
    parser.add_argument("--smol-layers", type=int, default=30,
                        help="layers of SmolLM2's shape (default its 30; fewer: quicker)")
    parser.add_argument("--bpe-chars", type=int, default=16_000_000, help="characters of the standard "
                        "library's sources the BPE is trained on (default 16,000,000, which reaches 49,152 "
                        "tokens; fewer: a smaller vocabulary, sooner)")
    parser.add_argument("--turns", type=int, default=8, help="turns of the chat (default 8)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens of each chat reply (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="requests per row of the batch-1 tables")
    parser.add_argument("--induction-run", type=Path, help="a run of `gptlab train --preset induction --data "
                        "repeats` (default: train one first)")
    args = parser.parse_args()
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average before: {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        demo = args.run or demo_run(Path(tmp) / "demo-shape")
        if "throughput" in args.only:
            shown = str(args.run) if args.run else "demo-shaped run (random weights)"
            throughput_table(demo, shown, args.clients, args.max_tokens)
        smol, smol_name = Path(tmp) / "smol", ""
        if {"structured", "prefix", "speculative"} & set(args.only):
            smol_name = smol_run(smol, args.smol_layers, args.bpe_chars)
        if "structured" in args.only:
            structured_table(demo, smol, smol_name, args)
        if "prefix" in args.only:
            prefix_table(smol, smol_name, args)
        if "speculative" in args.only:
            induction = args.induction_run or induction_run(Path(tmp) / "induction")
            speculative_table(induction, smol, smol_name, args)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
