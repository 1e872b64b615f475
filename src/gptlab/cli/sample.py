"""The sample command: continue a prompt with a trained run, streaming the text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.cli.common import (
    COUNT,
    InputFile,
    RunPath,
    add_config_arguments,
    add_device_option,
    add_weight_options,
    config_overrides,
    note_long_prompt,
    speculation_of,
)
from gptlab.config import SAMPLE_DEFAULTS, SamplingConfig

if TYPE_CHECKING:  # these import torch, which --help must not wait for
    from gptlab.inference.lm import LM
    from gptlab.speculative import SpeculationConfig, SpeculationStats

def print_samples(lm: LM, prompt: str, num_samples: int, sampling: SamplingConfig, *,
                  use_cache: bool = True, as_json: bool = False, save: Path | None = None,
                  constraint: dict[str, Any] | None = None, speculation: SpeculationConfig | None = None,
                  stats: SpeculationStats | None = None) -> None:
    """Stream `num_samples` continuations of `prompt` to stdout, or print one JSON line per sample. A prompt
    longer than the context window is read from its last block_size tokens, after a note on stderr saying
    so. With `save`, what was printed is also written to that file, crash-safely. `constraint` holds the
    structured output asked for (`LM.grammar`'s json_schema, regex or choice); `speculation` drafts tokens
    by prompt lookup, counted in `stats` over all the samples."""
    import time

    from gptlab.files import atomic_write_text
    from gptlab.sampling import sampler

    if num_samples < 1:
        raise ValueError(f"--num-samples={num_samples} must be at least 1")
    grammar = lm.grammar(**(constraint or {}))  # compiled once, and checked before the prompt
    window, length = lm.model.config.block_size, len(lm.encode(prompt))
    if length > window:  # generate keeps the last block_size tokens of a prompt
        note_long_prompt(length, window)
    generator = sampler(sampling, lm.device)  # one stream for all samples, so each one differs
    printed: list[str] = []

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        printed.append(text)

    for n in range(num_samples):
        begin = time.perf_counter()
        # The prompt is checked before anything of the sample is printed.
        chunks = lm.chunks(prompt, sampling, generator=generator, use_cache=use_cache, grammar=grammar,
                           speculation=speculation, stats=stats)
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


def cmd_sample(args: argparse.Namespace) -> int:
    """Print continuations of a prompt (or of a file's text) from a trained checkpoint.

    Options not given take the run's own defaults (an imported model's generation_config.json), then
    `gptlab sample`'s.
    """
    from gptlab.data.corpora import read_utf8
    from gptlab.inference.loading import load
    from gptlab.speculative import SpeculationStats

    prompt = args.prompt if args.prompt_file is None else read_utf8(args.prompt_file)
    overrides = config_overrides(args, SamplingConfig)
    SamplingConfig.from_dict({**SAMPLE_DEFAULTS, **overrides})  # a bad option is refused before loading
    speculation, stats = speculation_of(args), SpeculationStats()
    if speculation is not None and (not args.use_cache or constraint_given(args)):
        raise ValueError("--speculative verifies drafts through the KV cache, without structured output: "
                         "drop --no-kv-cache, --json-schema, --regex and --choice, or --speculative")
    constraint = constraint_of(args)
    lm = load(args.run, device=args.device, dtype=args.dtype, quantize=args.quantize)
    print_samples(lm, prompt, args.num_samples, lm.sampling(**overrides), use_cache=args.use_cache,
                  as_json=args.json, constraint=constraint, speculation=speculation, stats=stats)
    if speculation is not None:
        print(f"note: speculative decoding: {stats.accepted} of {stats.drafted} drafted tokens accepted "
              f"({stats.acceptance:.0%}) in {stats.passes} verifying passes", file=sys.stderr)
    return 0


def constraint_given(args: argparse.Namespace) -> bool:
    """Whether --json-schema, --regex or --choice was given."""
    return any(v is not None for v in (args.json_schema, args.regex, args.choice))


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
    sa.add_argument("run", type=RunPath(), help="run folder or checkpoint file")
    source = sa.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="\n", help="text to continue (one longer than the context window "
                        "is read from its last block_size tokens, and a note on stderr says so)")
    source.add_argument("--prompt-file", type=InputFile(), metavar="FILE",
                        help="continue the text of this UTF-8 file instead")
    sa.add_argument("--num-samples", type=COUNT, default=1, metavar="N", help="continuations (default 1)")
    sa.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                    help="recompute every step without the KV cache (the slow reference loop)")
    sa.add_argument("--json", action="store_true", help="print one JSON object per sample: prompt, "
                    "completion, tokens, stop_reason, tokens_per_s")
    add_config_arguments(sa, SamplingConfig, "sampling options", defaults=SAMPLE_DEFAULTS)
    structured = sa.add_argument_group(
        "structured output", "the text is guaranteed to follow one of these (needs the structured extra: pip "
        "install 'gptlab[structured]'); the stop reason is eot or stop only when it is complete")
    grammar = structured.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", type=InputFile(), metavar="FILE",
                         help="compact JSON valid under the JSON schema in "
                         "FILE")
    grammar.add_argument("--regex", metavar="R", help="text that the regular expression R matches whole")
    grammar.add_argument("--choice", metavar="A,B,...", help="exactly one of these comma-separated strings")
    speculative = sa.add_argument_group(
        "speculative decoding", "draft tokens by finding the last n tokens earlier in the prompt and output, "
        "and verify them in one forward pass: greedy output is unchanged, sampled output keeps the model's "
        "distribution (but a seed gives other samples than without it)")
    speculative.add_argument("--speculative", choices=["ngram"], help="prompt lookup (one prompt at a time, "
                             "with the KV cache); the acceptance rate goes to --json or a note on stderr")
    speculative.add_argument("--draft-tokens", type=COUNT, metavar="K",
                             help="tokens drafted and verified per "
                             "step (default 4)")
    speculative.add_argument("--ngram", type=COUNT, metavar="N",
                             help="longest n-gram looked up, falling back "
                             "to shorter ones (default 3)")
    add_device_option(sa)
    add_weight_options(sa)
    sa.set_defaults(func=cmd_sample)
