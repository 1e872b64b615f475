"""The sample command: continue a prompt with a trained run, streaming the text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.cli.common import (
    add_config_arguments,
    add_device_option,
    add_weight_options,
    config_overrides,
    note_long_prompt,
)
from gptlab.config import SamplingConfig

if TYPE_CHECKING:  # these import torch, which --help must not wait for
    from collections.abc import Iterator

    import torch

    from gptlab.generate import Chunk
    from gptlab.model import GPT
    from gptlab.speculative import SpeculationConfig, SpeculationStats
    from gptlab.structured.grammar import Grammar
    from gptlab.text.tokenizer import Tokenizer

SAMPLE_DEFAULTS = {"temperature": 0.8, "seed": 1337}  # `gptlab sample`'s own, over SamplingConfig's


def print_samples(run: str | Path, prompt: str, num_samples: int, sampling: SamplingConfig, *, device: str,
                  use_cache: bool = True, as_json: bool = False, dtype: str = "float32",
                  quantize: str = "none", save: Path | None = None,
                  constraint: dict[str, Any] | None = None, speculation: SpeculationConfig | None = None,
                  stats: SpeculationStats | None = None) -> None:
    """Stream `num_samples` continuations of `prompt` to stdout, or print one JSON line per sample, from
    the run's model with its weights held as `dtype` and `quantize` say (gptlab.quantize). A prompt longer
    than the context window is read from its last block_size tokens, after a note on stderr saying so.
    With `save`, what was printed is also written to that file, crash-safely. `constraint` holds the
    structured output asked for, as `grammar_for`'s json_schema, regex or choice (gptlab.structured).
    `speculation` drafts tokens by prompt lookup, counted in `stats` over all the samples."""
    import time

    from gptlab.checkpoint import load_for_inference
    from gptlab.common import resolve_device
    from gptlab.files import atomic_write_text
    from gptlab.sampling import check_logit_bias, sampler
    from gptlab.structured.grammar import grammar_for

    if num_samples < 1:
        raise ValueError(f"--num-samples={num_samples} must be at least 1")
    torch_device = resolve_device(device)
    model, tokenizer = load_for_inference(run, torch_device, dtype, quantize)
    check_logit_bias(sampling.logit_bias, tokenizer.vocab_size)
    grammar = grammar_for(tokenizer, **(constraint or {}))  # checked before anything is printed
    window, length = model.config.block_size, len(tokenizer.encode(prompt))
    if length > window:  # generate keeps the last block_size tokens of a prompt
        note_long_prompt(length, window)
    generator = sampler(sampling, torch_device)  # one stream for all samples, so each one differs
    printed: list[str] = []

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        printed.append(text)

    for n in range(num_samples):
        begin = time.perf_counter()
        chunks = sample_chunks(model, tokenizer, prompt, sampling, grammar, generator=generator,
                               use_cache=use_cache, speculation=speculation, stats=stats)
        if not as_json:
            show(f"--- sample {n + 1} ---\n{prompt}")
        completion, tokens = "", []
        for chunk in chunks:
            completion += chunk.text
            tokens += [] if chunk.token is None else [chunk.token]
            if not as_json:
                show(chunk.text)
        if not as_json:
            show("\n")
            continue
        record = {"sample": n + 1, "prompt": prompt, "completion": completion, "tokens": tokens,
                  "stop_reason": chunk.stop_reason,  # the last chunk carries it
                  "tokens_per_s": round(len(tokens) / (time.perf_counter() - begin), 1)}
        show(json.dumps(record) + "\n")
    if save is not None:
        atomic_write_text(save, "".join(printed))


def sample_chunks(model: GPT, tokenizer: Tokenizer, prompt: str, sampling: SamplingConfig,
                  grammar: Grammar | None, *, generator: torch.Generator | None, use_cache: bool,
                  speculation: SpeculationConfig | None,
                  stats: SpeculationStats | None) -> Iterator[Chunk]:
    """One continuation's chunks, structured when there is a grammar (either checks the prompt first)."""
    from gptlab.generate import stream_text
    from gptlab.structured.generation import stream_structured

    if grammar is not None:
        return stream_structured(model, tokenizer, prompt, sampling, grammar, generator=generator,
                                 use_cache=use_cache)
    return stream_text(model, tokenizer, prompt, sampling, generator=generator, use_cache=use_cache,
                       speculation=speculation, stats=stats)


def cmd_sample(args: argparse.Namespace) -> int:
    """Print continuations of a prompt (or of a file's text) from a trained checkpoint.

    Options not given take the run's own defaults (an imported model's generation_config.json), then
    `gptlab sample`'s.
    """
    from gptlab.checkpoint import generation_defaults
    from gptlab.data.corpora import read_utf8
    from gptlab.speculative import SpeculationStats

    prompt = args.prompt if args.prompt_file is None else read_utf8(args.prompt_file)
    sampling = SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **generation_defaults(args.run),
                                         **config_overrides(args, SamplingConfig)})
    speculation, stats = speculation_of(args), SpeculationStats()
    print_samples(args.run, prompt, args.num_samples, sampling, device=args.device, use_cache=args.use_cache,
                  as_json=args.json, dtype=args.dtype, quantize=args.quantize, constraint=constraint_of(args),
                  speculation=speculation, stats=stats)
    if speculation is not None:
        print(f"note: speculative decoding: {stats.accepted} of {stats.drafted} drafted tokens accepted "
              f"({stats.acceptance:.0%}) in {stats.passes} verifying passes", file=sys.stderr)
    return 0


def speculation_of(args: argparse.Namespace) -> SpeculationConfig | None:
    """The SpeculationConfig the --speculative options describe, or None without --speculative."""
    from gptlab.speculative import SpeculationConfig

    given = {name: value for name in ("draft_tokens", "ngram") if (value := getattr(args, name)) is not None}
    if args.speculative is None:
        if given:
            raise ValueError(f"--{next(iter(given)).replace('_', '-')} needs --speculative ngram")
        return None
    if not args.use_cache or any(v is not None for v in (args.json_schema, args.regex, args.choice)):
        raise ValueError("--speculative verifies drafts through the KV cache, without structured output: "
                         "drop --no-kv-cache, --json-schema, --regex and --choice, or --speculative")
    return SpeculationConfig(**given)


def constraint_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """The structured output the options ask for (`grammar_for`'s keyword), or None."""
    from gptlab.data.corpora import read_utf8

    if args.json_schema is not None:
        try:
            return {"json_schema": json.loads(read_utf8(args.json_schema))}
        except json.JSONDecodeError as err:
            raise ValueError(f"--json-schema {args.json_schema}: the file is not JSON ({err})") from None
    if args.regex is not None:
        return {"regex": args.regex}
    return None if args.choice is None else {"choice": args.choice.split(",")}


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
    source.add_argument("--prompt", default="\n", help="text to continue (one longer than the context window "
                        "is read from its last block_size tokens, and a note on stderr says so)")
    source.add_argument("--prompt-file", metavar="FILE", help="continue the text of this UTF-8 file instead")
    sa.add_argument("--num-samples", type=int, default=1, metavar="N", help="continuations (default 1)")
    sa.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                    help="recompute every step without the KV cache (the slow reference loop)")
    sa.add_argument("--json", action="store_true", help="print one JSON object per sample: prompt, "
                    "completion, tokens, stop_reason, tokens_per_s")
    add_config_arguments(sa, SamplingConfig, "sampling options", defaults=SAMPLE_DEFAULTS)
    structured = sa.add_argument_group(
        "structured output", "the text is guaranteed to follow one of these (needs the structured extra: pip "
        "install 'gptlab[structured]'); the stop reason is eot or stop only when it is complete")
    grammar = structured.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", metavar="FILE", help="compact JSON valid under the JSON schema in "
                         "FILE")
    grammar.add_argument("--regex", metavar="R", help="text that the regular expression R matches whole")
    grammar.add_argument("--choice", metavar="A,B,...", help="exactly one of these comma-separated strings")
    speculative = sa.add_argument_group(
        "speculative decoding", "draft tokens by finding the last n tokens earlier in the prompt and output, "
        "and verify them in one forward pass: greedy output is unchanged, sampled output keeps the model's "
        "distribution (but a seed gives other samples than without it)")
    speculative.add_argument("--speculative", choices=["ngram"], help="prompt lookup (one prompt at a time, "
                             "with the KV cache); the acceptance rate goes to --json or a note on stderr")
    speculative.add_argument("--draft-tokens", type=int, metavar="K", help="tokens drafted and verified per "
                             "step (default 4)")
    speculative.add_argument("--ngram", type=int, metavar="N", help="longest n-gram looked up, falling back "
                             "to shorter ones (default 3)")
    add_device_option(sa)
    add_weight_options(sa)
    sa.set_defaults(func=cmd_sample)
