"""GGUF export measured: two small BPE models trained here, exported as f32, f16 and q8_0, read back into
gptlab and, where llama-cpp-python is installed, run by llama.cpp itself.

The models are the two shapes llama.cpp knows: a GPT-2 (learned positions, LayerNorm, the tanh GELU,
tied head) and a Llama (RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention, untied head). Both
are trained for --steps steps on a generated text with a byte-level BPE of 512 ids. For each type the
script prints the file size, whether the weights read back with `gguf` are bit-equal to the run's, the
largest logit error of the model read back (over the logits' standard deviation) and whether gptlab's
greedy continuation of it matches the run's; with llama_cpp importable, whether llama.cpp tokenises the
prompt to the same ids and continues it greedily with the same tokens, and its speed. (An f32 file's
weights are bit-equal, yet its logits may differ from the run's in the 7th digit: a run loaded from
its checkpoint keeps some matrices transposed in memory, and the products then round in another order.)

llama-cpp-python has no wheel for every platform: `pip install llama-cpp-python` builds it from its source
distribution (about 8 minutes on 2 cores); everything else runs without it.

    python benchmarks/gguf_llama_cpp.py     # about 6 minutes on 2 cores (training), without llama.cpp
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from gptlab.common import cpu_name
from gptlab.config import ModelConfig, TrainConfig
from gptlab.data.prepare import prepare
from gptlab.inference.loading import load
from gptlab.interop.gguf import GGUF_TYPES, export_gguf, load_gguf, read_gguf
from gptlab.model import GPT
from gptlab.training.loop import train

SHAPES = {
    "gpt2": {},
    "llama": {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False, "n_kv_head": 2,
              "tied": False},
}
PROMPT = "the old dog sat on"


def corpus(lines: int, seed: int = 0) -> str:
    """Short sentences from a small grammar: enough structure for a tiny model to continue them."""
    rng = random.Random(seed)
    who = ["the cat", "a dog", "my bird", "the old dog", "a small cat", "the red fox"]
    did = ["sat on", "ran to", "looked at", "jumped over", "slept under"]
    what = ["the mat", "the rug", "a chair", "the step", "a box", "the warm bed"]
    return "\n".join(f"{rng.choice(who)} {rng.choice(did)} {rng.choice(what)}." for _ in range(lines)) + "\n"


def greedy(model: GPT, ids: list[int], n: int) -> list[int]:
    """n tokens of greedy continuation, recomputed from the whole prefix (slow and obviously right)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([out[-model.config.block_size:]]))
            logits = logits[0] if isinstance(logits, tuple) else logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


def logits_of(model: GPT, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return (out[0] if isinstance(out, tuple) else out)[0]  # (T, V)


def llama_cpp_row(path: Path, ids: list[int], expected: list[int], prompt: str) -> str:
    """llama.cpp's tokenisation and greedy continuation against gptlab's, and its speed."""
    try:
        import llama_cpp
    except ImportError:
        return "llama_cpp not installed"
    llm = llama_cpp.Llama(str(path), n_ctx=128, verbose=False)
    same_ids = llm.tokenize(prompt.encode(), add_bos=False) == ids
    start, theirs = time.perf_counter(), []
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == len(expected):
            break
    speed = len(theirs) / (time.perf_counter() - start)
    agree = sum(a == b for a, b in zip(theirs, expected, strict=True))
    return f"same prompt ids: {same_ids}; greedy {agree}/{len(expected)} tokens equal; {speed:.0f} tokens/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps per model")
    parser.add_argument("--new", type=int, default=32, help="tokens of greedy continuation compared")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "text.txt").write_text(corpus(4000), encoding="utf-8")
        prepare(str(root / "text.txt"), root / "data", tokenizer="bpe", vocab_size=512, progress=False)
        print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads\n")
        print("| shape | type | file | weights bit-equal | max logit error / std | gptlab greedy equal "
              "| llama.cpp |")
        print("|---|---|---|---|---|---|---|")
        for shape, changes in SHAPES.items():
            config = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, **changes)
            steps = TrainConfig(batch_size=16, max_steps=args.steps, lr=3e-3, min_lr=3e-4, warmup_steps=20,
                                eval_interval=args.steps, eval_batches=2, device="cpu", precision="float32")
            train(root / shape, root / "data", config, steps, progress=False)
            lm = load(root / shape)
            model, tokenizer = lm.model, lm.tokenizer
            ids = tokenizer.encode(PROMPT)
            expected, reference = greedy(model, ids, args.new), logits_of(model, ids)
            for kind in GGUF_TYPES:
                written = export_gguf(root / shape, root / f"{shape}-{kind}.gguf", kind)
                loaded, _ = load_gguf(written.path)
                state = model.state_dict()
                equal = all(torch.equal(t, state[name]) for name, t in read_gguf(written.path)[1].items())
                error = (logits_of(loaded, ids) - reference).abs().max().item() / reference.std().item()
                same = greedy(loaded, ids, args.new) == expected
                size = written.path.stat().st_size / 1024
                row = llama_cpp_row(written.path, ids, expected, PROMPT)
                print(f"| {shape} | {kind} | {size:.0f} KiB | {equal} | {error:.1e} | {same} | {row} |")


if __name__ == "__main__":
    main()
