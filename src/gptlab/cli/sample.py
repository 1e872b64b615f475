"""The sample command: continue a prompt with a trained run, streaming the text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gptlab.cli.common import (
    add_config_arguments,
    add_device_option,
    add_weight_options,
    config_overrides,
)
from gptlab.config import SamplingConfig

SAMPLE_DEFAULTS = {"temperature": 0.8, "seed": 1337}  # `gptlab sample`'s own, over SamplingConfig's


def print_samples(run: str | Path, prompt: str, num_samples: int, sampling: SamplingConfig, *, device: str,
                  use_cache: bool = True, as_json: bool = False, dtype: str = "float32",
                  quantize: str = "none") -> None:
    """Stream `num_samples` continuations of `prompt` to stdout, or print one JSON line per sample, from
    the run's model with its weights held as `dtype` and `quantize` say (gptlab.quantize)."""
    import time

    from gptlab.checkpoint import load_for_inference
    from gptlab.common import resolve_device
    from gptlab.generate import stream_text
    from gptlab.sampling import sampler

    if num_samples < 1:
        raise ValueError(f"--num-samples={num_samples} must be at least 1")
    torch_device = resolve_device(device)
    model, tokenizer = load_for_inference(run, torch_device, dtype, quantize)
    generator = sampler(sampling, torch_device)  # one stream for all samples, so each one differs
    for n in range(num_samples):
        begin = time.perf_counter()
        # stream_text checks the prompt before anything is printed
        chunks = stream_text(model, tokenizer, prompt, sampling, generator=generator, use_cache=use_cache)
        if not as_json:
            sys.stdout.write(f"--- sample {n + 1} ---\n{prompt}")
        completion, tokens = "", []
        for chunk in chunks:
            completion += chunk.text
            tokens += [] if chunk.token is None else [chunk.token]
            if not as_json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        if not as_json:
            print()
            continue
        record = {"sample": n + 1, "prompt": prompt, "completion": completion, "tokens": tokens,
                  "stop_reason": chunk.stop_reason,  # the last chunk carries it
                  "tokens_per_s": round(len(tokens) / (time.perf_counter() - begin), 1)}
        print(json.dumps(record))


def cmd_sample(args: argparse.Namespace) -> int:
    """Print continuations of a prompt (or of a file's text) from a trained checkpoint.

    Options not given take the run's own defaults (an imported model's generation_config.json), then
    `gptlab sample`'s.
    """
    from gptlab.checkpoint import generation_defaults
    from gptlab.data.corpora import read_utf8

    prompt = args.prompt if args.prompt_file is None else read_utf8(args.prompt_file)
    sampling = SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **generation_defaults(args.run),
                                         **config_overrides(args, SamplingConfig)})
    print_samples(args.run, prompt, args.num_samples, sampling, device=args.device, use_cache=args.use_cache,
                  as_json=args.json, dtype=args.dtype, quantize=args.quantize)
    return 0


def add_sample_command(sub: Any) -> None:
    """The sample command."""
    sa = sub.add_parser("sample", help="generate text from a checkpoint",
                        description="Continue a prompt with a trained model, streaming the text. Generation "
                        "stops at the end-of-text token, a --stop string (not printed) or --max-new-tokens. "
                        "An imported model's generation_config.json settings (temperature, top-p, top-k, "
                        "max new tokens) are the defaults of the options not given.",
                        epilog="example: gptlab sample runs/demo --prompt ROMEO: --top-p 0.9 "
                        "--stop $'\\n\\n'")
    sa.add_argument("run", help="run folder or checkpoint file")
    source = sa.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="\n", help="text to continue (cropped to the context window)")
    source.add_argument("--prompt-file", metavar="FILE", help="continue the text of this UTF-8 file instead")
    sa.add_argument("--num-samples", type=int, default=1, metavar="N", help="continuations (default 1)")
    sa.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                    help="recompute every step without the KV cache (the slow reference loop)")
    sa.add_argument("--json", action="store_true", help="print one JSON object per sample: prompt, "
                    "completion, tokens, stop_reason, tokens_per_s")
    add_config_arguments(sa, SamplingConfig, "sampling options", defaults=SAMPLE_DEFAULTS)
    add_device_option(sa)
    add_weight_options(sa)
    sa.set_defaults(func=cmd_sample)
