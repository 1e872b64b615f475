"""Generation speed on this machine: gptlab's KV-cache decoder against naive recompute, beside the bound.

Batch-1 decoding reads every weight once per new token, so no decoder can beat
    tokens/s <= memory bandwidth / weight bytes,
with the bandwidth measured here by a large tensor copy (bytes read + bytes written, per second).
For each model (random weights, float32, greedy: the demo, GPT-2 small, and SmolLM2-135M's Llama shape
with grouped-query attention) it prints a markdown table: the first-token latency
for a prompt of half the window, and the rate of 128, 512 and 1024 new tokens after a one-token
prompt (n divided by the time until the n-th token, prefill included), beside that bound.

Recompute on the two larger shapes costs seconds per step at long contexts, so its rows are
estimated: one naive step is timed at a few context lengths and the per-step times, interpolated
linearly, are summed over the run; those cells are marked with ~. Every other cell is measured.

Each decoder is one function (model, prompt, n_new) -> seconds until each new token. The KV-cache
decoder runs on both weight layouts: column-major, (in, out) contiguous, and nn.Linear's (out, in).
`gptlab sample` loads a model in whichever one `faster_layout` measures to be faster on the running
CPU; the row "layout chosen at load" shows its choice for that model, here and now.

A second table sets gptlab's cached decoder beside Hugging Face transformers' `generate` (its own
KV cache, greedy) on the very same weights (converted with
`gptlab.interop.huggingface.to_transformers`): 200 new tokens after a one-token prompt, batch 1, in
the same run. transformers cannot go past its
`n_positions`, so the demo shape is compared with a 256-token window there. It needs the `hf`
extra (`pip install 'gptlab[hf]'`); without it the table is skipped.

    python benchmarks/generate.py            # all three models (about ten minutes on a 2-core CPU)
    python benchmarks/generate.py --quick    # the demo model only
    python benchmarks/generate.py --batches  # batched throughput on the GPT-2-small shape
    python benchmarks/generate.py --int8     # float32 against int8 weights (gptlab.inference.quantize)
    python benchmarks/generate.py --int8-rows  # one int8 layer's product for 1 to 64 rows, each way
    python benchmarks/generate.py --lm       # the demo shape through gptlab.load's LM, beside transformers

`--batches` decodes 64 new tokens for batches of 1, 4, 16 and 64 prompts (all of 16 tokens, or of 1
to 32 tokens, left-padded), and prints total and per-sequence tokens/s for gptlab's batched KV-cache
decoder and for transformers' `generate` on the same weights.

`--int8` decodes 128 new tokens after a one-token prompt (batch 1, greedy) with each model in float32,
as `gptlab sample` loads it, and with a quantised copy of the same weights (`quantize_int8`: int8
weights, bfloat16 activations into each product), beside each one's bound: copy bandwidth / the bytes
a step reads.

`--int8-rows` times one layer's product (SmolLM2-135M's FFN, 576 -> 1536) for a batch of 1 to 64 rows,
the way a batched decoding step (`gptlab serve`) runs it: int8 weights through torch's int8 kernel in
one call, the same kernel on groups of 16 rows, `Int8Linear`'s own choice (the kernel up to
PACKED_MAX_ROWS rows, else dequantise and multiply), and the same weights held in bfloat16 and float32.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from gptlab.config import ModelConfig, SamplingConfig
from gptlab.generate import Decoder, generate
from gptlab.inference.layouts import decoding_layout, faster_layout
from gptlab.inference.quantize import PACKED_MAX_ROWS, Int8Linear, quantize_int8
from gptlab.model import GPT

LENGTHS = (128, 512, 1024)
HF_NEW_TOKENS = 200
Decoding = Callable[[GPT, list[int], int], list[float]]


@dataclass(frozen=True)
class Size:
    name: str
    config: ModelConfig
    estimate_recompute: bool  # time a few naive steps and sum an interpolation, instead of running it
    repeats: int  # each figure is the best of this many runs (the machine may be shared)


SIZES = [
    Size("demo (4x128, ctx 64, V 84)",
         ModelConfig(vocab_size=84, block_size=64, n_layer=4, n_head=4, n_embd=128), False, 3),
    Size("GPT-2 small (12x768, ctx 1024, V 50257)",
         ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768), True, 2),
    # SmolLM2-135M's shape: a Llama with 9 query heads on 3 key/value heads and a tied head
    Size("SmolLM2-135M (30x576, 9 heads on 3, V 49152)",
         ModelConfig(vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                     ffn_mult=1536 / 576, norm="rmsnorm", ffn="swiglu", positions="rope", bias=False,
                     rope_base=100000.0, norm_eps=1e-5), True, 2),
]


def copy_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by copying a tensor far larger than any CPU cache (read + write)."""
    source = torch.rand(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy also faults the target's pages in
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def product_bandwidth(device: torch.device, transposed: bool, repeats: int = 5) -> float:
    """Bytes per second a batch-1 product reads of a weight as large as GPT-2's vocabulary head:
    F.linear on nn.Linear's (out, in) layout, or x @ W on an (in, out) copy (GPT-2's Conv1D)."""
    weight, x = torch.rand(50257, 768, device=device), torch.rand(1, 768, device=device)
    stored = weight.t().contiguous() if transposed else weight
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        _ = x @ stored if transposed else torch.nn.functional.linear(x, stored)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return weight.nbytes / best


def weight_bytes(model: GPT) -> int:
    """Bytes of every parameter, a tied embedding/head counted once: what one decoding step reads."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def token_times(tokens: Iterator[torch.Tensor]) -> list[float]:
    """Seconds from the call until each token of the stream was chosen (the stream starts lazily)."""
    start = time.perf_counter()
    return [time.perf_counter() - start for _ in tokens]


def gptlab_cached(model: GPT, prompt: list[int], n_new: int) -> list[float]:
    return token_times(generate(model, [prompt], greedy(n_new)))


def gptlab_recompute(model: GPT, prompt: list[int], n_new: int) -> list[float]:
    return token_times(generate(model, [prompt], greedy(n_new), use_cache=False))


def greedy(n_new: int) -> SamplingConfig:
    return SamplingConfig(temperature=0, max_new_tokens=n_new)


# name -> (decoder, whether it runs on the decoding layout)
DECODERS: dict[str, tuple[Decoding, bool]] = {
    "gptlab KV cache, column-major": (gptlab_cached, True),
    "gptlab KV cache, nn.Linear layout": (gptlab_cached, False),
    "gptlab recompute": (gptlab_recompute, True),
}


def estimated_recompute(model: GPT, prompt: list[int], n_new: int, points: int = 7) -> list[float]:
    """Recompute's token times from one timed naive step at `points` context lengths, interpolated.

    Step i runs the model on len(prompt) + i tokens, so the run must stay inside the window.
    """
    last = len(prompt) + n_new - 1
    assert last <= model.config.block_size, "the estimate assumes the window never moves"
    contexts = np.unique(np.linspace(len(prompt), last, points).astype(int))
    step_seconds = []
    for context in contexts:
        decoder = Decoder(model, [[0] * int(context)], use_cache=False)
        start = time.perf_counter()
        decoder.logits()
        step_seconds.append(time.perf_counter() - start)
    every_step = np.interp(np.arange(len(prompt), len(prompt) + n_new), contexts, step_seconds)
    return np.cumsum(every_step).tolist()


def best_of(repeats: int, decoding: Decoding, model: GPT, prompt: list[int], n_new: int) -> np.ndarray:
    """For every n, the shortest time until the n-th token over `repeats` runs."""
    return np.min([decoding(model, prompt, n_new) for _ in range(repeats)], axis=0)


def rows_for(size: Size, bandwidths: tuple[float, float], device: torch.device) -> list[str]:
    """The table rows of one model: one per decoder, then the cache's speedup."""
    torch.manual_seed(0)
    usual = GPT(size.config).to(device).eval()
    laid_out = decoding_layout(GPT(size.config).to(device).eval(), "column")
    laid_out.load_state_dict(usual.state_dict())  # copies values, keeps the layout
    bound, linear_bound = (bandwidth / weight_bytes(usual) for bandwidth in bandwidths)  # tokens/s
    prompt = [0] * (size.config.block_size // 2)
    rates: dict[str, list[float]] = {}
    rows = []
    for name, (decoding, layout) in DECODERS.items():
        model = laid_out if layout else usual
        estimate = size.estimate_recompute and decoding is gptlab_recompute
        decoding(model, [0], 8)  # warm-up
        first_ms = 1e3 * best_of(size.repeats, decoding, model, prompt, 1)[0]
        times = best_of(size.repeats, estimated_recompute if estimate else decoding, model, [0], max(LENGTHS))
        rates[name] = [n / times[n - 1] for n in LENGTHS]
        cells = " | ".join(f"{'~' if estimate else ''}{rate:,.1f}" for rate in rates[name])
        rows.append(f"| {size.name} | {name} | {first_ms:,.0f} (prompt {len(prompt)}) | {cells} | "
                    f"{bound:,.1f} | {linear_bound:,.1f} | {rates[name][0] / bound:.0%} |")
    cached = [max(pair) for pair in zip(rates["gptlab KV cache, column-major"],
                                        rates["gptlab KV cache, nn.Linear layout"], strict=True)]
    speedups = " | ".join(f"x{c / n:.1f}" for c, n in zip(cached, rates["gptlab recompute"], strict=True))
    rows.append(f"| {size.name} | speedup of the cache (faster layout) | | {speedups} | | | |")
    rows.append(f"| {size.name} | layout chosen at load: {faster_layout(usual)} | | | | | | | |")
    return rows


def best_seconds(run: Callable[[], list[int]], repeats: int) -> tuple[float, list[int]]:
    """The shortest of `repeats` timed calls after one warm-up, and the tokens it produced."""
    run()
    times, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - start)
    return min(times), tokens


def transformers_row(name: str, config: ModelConfig, device: torch.device, repeats: int = 3) -> str:
    """One row of the gptlab-vs-transformers table: both decode the same weights greedily."""
    from gptlab.interop.huggingface import to_transformers

    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    hf = to_transformers(model)
    decoding_layout(model)  # as `gptlab sample` loads it
    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    ours, our_tokens = best_seconds(
        lambda: [int(t) for t in generate(model, [[0]], greedy(HF_NEW_TOKENS))], repeats)
    theirs, their_tokens = best_seconds(
        lambda: hf.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, use_cache=True,
                            max_new_tokens=HF_NEW_TOKENS, min_new_tokens=HF_NEW_TOKENS,
                            pad_token_id=0)[0, 1:].tolist(), repeats)
    rates = f"{HF_NEW_TOKENS / ours:,.1f} | {HF_NEW_TOKENS / theirs:,.1f} | x{theirs / ours:.2f}"
    return f"| {name} | {rates} | {our_tokens == their_tokens} |"


def transformers_comparison(device: torch.device) -> list[str]:
    """The table's rows; none when transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    rows = []
    for size in SIZES:
        config, name = size.config, size.name
        if config.block_size <= HF_NEW_TOKENS:  # transformers stops at n_positions: widen the window
            config, name = config.replace(block_size=256), name.replace("ctx 64", "ctx 256")
        rows.append(transformers_row(name, config, device))
    return rows


def lm_rows(device: torch.device, repeats: int = 5) -> list[str]:
    """The demo shape (context 256) decoded greedily three ways on the same weights: gptlab's `generate`
    (token ids), `LM.generate` (text, as `gptlab.load(run).generate` and `gptlab sample` decode it) and
    transformers' `generate`; each the best of `repeats` after a warm-up."""
    from gptlab.inference.lm import LM
    from gptlab.interop.huggingface import to_transformers
    from gptlab.text.tokenizer import CharTokenizer

    torch.manual_seed(0)
    model = GPT(SIZES[0].config.replace(block_size=256)).to(device).eval()
    hf = to_transformers(model)
    decoding_layout(model)  # as `gptlab.load` lays it out
    lm = LM.from_model(model, CharTokenizer("".join(chr(33 + i) for i in range(model.config.vocab_size))))
    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    runs = {
        "gptlab `generate` (token ids)": lambda: [int(t) for t in
                                                  generate(model, [[0]], greedy(HF_NEW_TOKENS))],
        "`LM.generate` (text)": lambda: lm.encode(lm.generate(lm.decode([0]), max_new_tokens=HF_NEW_TOKENS,
                                                              temperature=0)),
        "transformers `generate`": lambda: hf.generate(
            idx, attention_mask=torch.ones_like(idx), do_sample=False, use_cache=True,
            max_new_tokens=HF_NEW_TOKENS, min_new_tokens=HF_NEW_TOKENS, pad_token_id=0)[0, 1:].tolist(),
    }
    timed = {name: best_seconds(run, repeats) for name, run in runs.items()}
    theirs, their_tokens = timed["transformers `generate`"]
    return [f"| {name} | {HF_NEW_TOKENS / seconds:,.1f} | x{theirs / seconds:.2f} | "
            f"{tokens == their_tokens} |" for name, (seconds, tokens) in timed.items()]


BATCHES = (1, 4, 16, 64)
BATCH_NEW_TOKENS = 64


def batch_prompts(batch: int, same_lengths: bool) -> list[list[int]]:
    """`batch` prompts of 16 tokens each, or of 1 to 32 tokens (spread evenly), from a fixed seed."""
    generator = torch.Generator().manual_seed(batch)
    lengths = [16] * batch if same_lengths else [1 + (31 * i) // max(1, batch - 1) for i in range(batch)]
    return [torch.randint(0, 50000, (n,), generator=generator).tolist() for n in lengths]


def hf_batch_generate(hf: torch.nn.Module, prompts: list[list[int]], device: torch.device) -> None:
    """transformers' generate on left-padded prompts with their attention mask (greedy, n new each)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    hf.generate(ids, attention_mask=mask, do_sample=False, use_cache=True, max_new_tokens=BATCH_NEW_TOKENS,
                min_new_tokens=BATCH_NEW_TOKENS, pad_token_id=0)


def batched_rows(device: torch.device) -> list[str]:
    """Total and per-sequence tokens/s of GPT-2-small-shaped decoding at several batch sizes, gptlab
    beside transformers when it is installed (the same weights, best of 2 after a warm-up)."""
    torch.manual_seed(0)
    model = GPT(SIZES[1].config).to(device).eval()
    try:
        from gptlab.interop.huggingface import to_transformers

        hf = to_transformers(model)
    except ImportError:
        hf = None
    decoding_layout(model)
    rows = []
    for same in (True, False):
        for batch in BATCHES:
            prompts = batch_prompts(batch, same)
            runs = {"gptlab": lambda p=prompts: list(generate(model, p, greedy(BATCH_NEW_TOKENS)))}
            if hf is not None:
                runs["transformers"] = lambda p=prompts: hf_batch_generate(hf, p, device)
            for name, run in runs.items():
                seconds, _ = best_seconds(lambda r=run: r() or [], repeats=2)
                total = batch * BATCH_NEW_TOKENS / seconds
                lengths = "16 each" if same else "1 to 32"
                rows.append(f"| {batch} | {lengths} | {name} | {total:,.1f} | {total / batch:,.1f} |")
    return rows


INT8_NEW_TOKENS = 128


def step_bytes(model: GPT) -> int:
    """Bytes of every parameter and buffer (a shared tensor once) but a token embedding that is not also
    the head: a step reads one row of it. For a tied float32 model this is `weight_bytes`; a quantised
    one holds its head as an int8 copy of its own, beside the float32 embedding."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    if model.lm_head.weight is not model.transformer.wte.weight:
        del tensors[id(model.transformer.wte.weight)]
    return sum(t.numel() * t.element_size() for t in tensors.values())


def int8_rows(bandwidth: float, device: torch.device) -> list[str]:
    """One row per model size: float32 and int8 decoding rates of the same weights, and their bounds."""
    rows = []
    for size in SIZES:
        torch.manual_seed(0)
        float32 = decoding_layout(GPT(size.config).to(device).eval())  # as `gptlab sample` loads it
        int8 = decoding_layout(GPT(size.config).to(device).eval())
        int8.load_state_dict(float32.state_dict())
        quantize_int8(int8)
        rates, sizes = [], []
        for model in (float32, int8):
            gptlab_cached(model, [0], 8)  # warm-up
            seconds = best_of(size.repeats, gptlab_cached, model, [0], INT8_NEW_TOKENS)[-1]
            rates.append(INT8_NEW_TOKENS / seconds)
            sizes.append(step_bytes(model))
        (rate32, rate8), (bytes32, bytes8) = rates, sizes
        rows.append(f"| {size.name} | {rate32:,.1f} | {rate8:,.1f} | x{rate8 / rate32:.2f} | "
                    f"{bytes32 / 1e6:,.1f} | {bytes8 / 1e6:,.1f} | {bandwidth / bytes32:,.1f} | "
                    f"{bandwidth / bytes8:,.1f} | {rate8 / (bandwidth / bytes8):.0%} |")
    return rows


def median_microseconds(run: Callable[[], torch.Tensor], repeats: int = 50) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def product_times(x: torch.Tensor, linear: torch.nn.Linear, int8: Int8Linear) -> list[float]:
    """Microseconds of one product of rows x (N, in) with the layer's weight, each way of computing it."""
    xb, kernel = x.to(torch.bfloat16), torch.ops.aten._weight_int8pack_mm
    weight16 = linear.weight.detach().to(torch.bfloat16)
    ways = [
        lambda: kernel(xb, int8.weight, int8.scales),
        lambda: torch.cat([kernel(part, int8.weight, int8.scales) for part in xb.split(PACKED_MAX_ROWS)]),
        lambda: int8(x),
        lambda: torch.nn.functional.linear(xb, weight16),
        lambda: torch.nn.functional.linear(x, linear.weight),
    ]
    return [median_microseconds(way) for way in ways]


def int8_row_counts() -> list[str]:
    """One row per batch size: a layer's product time for each way of holding and multiplying its weight."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False).requires_grad_(False)
    int8 = Int8Linear.from_linear(linear)
    rows = []
    for n in (1, 8, 16, 17, 32, 64):
        times = product_times(torch.randn(n, 576), linear, int8)
        rows.append(f"| {n} | " + " | ".join(f"{t:,.0f}" for t in times) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the demo model only")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--batches", action="store_true", help="only the batched-throughput table")
    parser.add_argument("--int8", action="store_true", help="only the float32-against-int8 table")
    parser.add_argument("--int8-rows", action="store_true", help="only one int8 layer's product time "
                        "for 1 to 64 rows (a batched decoding step), each way of computing it")
    parser.add_argument("--lm", action="store_true", help="only the demo shape through LM.generate beside "
                        "gptlab's generate and transformers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.batches:
        print(f"{BATCH_NEW_TOKENS} new tokens per prompt, greedy, float32, GPT-2-small shape, random "
              f"weights; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
        print("| batch | prompt lengths | decoder | tokens/s in total | tokens/s per sequence |")
        print("|---|---|---|---|---|")
        for row in batched_rows(device):
            print(row, flush=True)
        return
    if args.lm:
        print(f"demo shape (4x128, ctx 256, V 84), {HF_NEW_TOKENS} new tokens, batch 1, greedy, best of 5; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}\n")
        print("| decoding | tokens/s | vs transformers | same tokens as transformers |")
        print("|---|---|---|---|")
        print("\n".join(lm_rows(device)))
        return
    if args.int8_rows:
        print(f"one 576 -> 1536 product, microseconds (median of 50); torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {device}\n")
        print("| rows | int8 kernel, one call | int8 kernel, groups of 16 | Int8Linear | bfloat16 | "
              "float32 |")
        print("|---|---|---|---|---|---|")
        for row in int8_row_counts():
            print(row, flush=True)
        return
    if args.int8:
        bandwidth = copy_bandwidth(device)
        print(f"{INT8_NEW_TOKENS} new tokens after a one-token prompt, batch 1, greedy, random weights; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; copy bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s; best of each model's repeats\n")
        print("| model | float32 tokens/s | int8 tokens/s | int8 speedup | float32 MB per step | "
              "int8 MB per step | float32 bound tokens/s | int8 bound tokens/s | int8 at bound |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in int8_rows(bandwidth, device):
            print(row, flush=True)
        return
    bandwidth = copy_bandwidth(device)
    streamed, transposed = (product_bandwidth(device, layout) for layout in (False, True))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; float32, batch 1, "
          f"greedy; copy bandwidth {bandwidth / 1e9:.1f} GB/s; a batch-1 product reads a 154 MB weight at "
          f"{streamed / 1e9:.1f} GB/s with F.linear ({streamed / bandwidth:.0%} of that), "
          f"{transposed / 1e9:.1f} GB/s stored (in, out)\n")
    lengths = " | ".join(f"tokens/s, {n} new" for n in LENGTHS)
    print(f"| model | decoder | first token, ms | {lengths} | bound tokens/s | F.linear bound | "
          "at 128 / bound |")
    print("|---|---|---|" + "---|" * len(LENGTHS) + "---|---|---|")
    for size in SIZES[:1] if args.quick else SIZES:
        for row in rows_for(size, (bandwidth, streamed), device):
            print(row, flush=True)
    print("\n" + NOTES)
    if not args.quick:
        rows = transformers_comparison(device)
        if rows:
            print(f"\n{HF_NEW_TOKENS} new tokens, batch 1, greedy, best of 3: gptlab KV cache vs "
                  "transformers `generate` on the same weights\n")
            print("| model | gptlab tokens/s | transformers tokens/s | gptlab speedup | same tokens |")
            print("|---|---|---|---|---|")
            print("\n".join(rows))


NOTES = """\
- bound: copy bandwidth / weight bytes, the rate if each step only read every weight once; at context
  T the cache adds 2 L T D x 4 bytes of keys and values per step (75 MB for GPT-2 small at T = 1024).
  F.linear bound: the same with the rate at which F.linear's batch-1 product reads a weight here.
- demo: its 3.3 MB of weights stay in the CPU caches, so the memory bound does not limit it: a step
  costs the fixed overhead of a few dozen small operations. Its window is 64 tokens, so past 64 the
  cached run re-prefills its last 32 tokens every 32 tokens (learned positions) and recompute never
  runs more than 64 positions a step: the speedup cannot grow with length there.
- ~: estimated from timed single steps (see the module docstring); every other figure is measured,
  as the best of a few runs."""


if __name__ == "__main__":
    main()
