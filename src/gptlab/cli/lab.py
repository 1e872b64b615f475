"""The lab and model commands: the handout's numbers reproduced, and a model's parameter count."""

from __future__ import annotations

import argparse
from typing import Any

from gptlab.cli.common import (
    add_config_arguments,
    config_overrides,
)
from gptlab.config import ModelConfig, parameter_count


def cmd_lab(args: argparse.Namespace) -> int:
    """Run every worked example and property of the handout; non-zero exit if any fails."""
    from gptlab.handout.lab import run_lab
    from gptlab.handout.properties import failed

    results = run_lab()
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"{r.verdict}  {r.section:<6} {r.name:<{width}}  expected {r.expected}  computed {r.computed}")
    bad = failed(results)
    print(f"\n{len(results) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


def cmd_model(args: argparse.Namespace) -> int:
    """Build a model from options, run one forward pass, and print its parameter arithmetic."""
    import torch

    from gptlab.model import GPT

    config = ModelConfig.from_dict(config_overrides(args, ModelConfig))
    model = GPT(config)
    idx = torch.zeros(1, config.block_size, dtype=torch.long)
    logits, _ = model(idx)
    for name, value in config.to_dict().items():
        print(f"{name:>12} = {value}")
    print(f"\nforward pass: tokens (1, {config.block_size}) -> logits {tuple(logits.shape)}")
    print("\nparameters (handout arithmetic):")
    for part, count in parameter_count(config).items():
        print(f"{part:>16}  {count:>12,}")
    print(f"{'counted':>16}  {model.num_parameters():>12,}  (sum over the built model's tensors)")
    return 0


def add_model_commands(sub: Any) -> None:
    """The lab / model commands."""
    lab = sub.add_parser(
        "lab",
        help="check every worked number and property of the handout",
        description="Run the handout's worked examples (§2-§8) with gptlab's own modules and print "
        "expected vs computed values, one line per check. Exits 1 if any check fails.",
    )
    lab.set_defaults(func=cmd_lab)

    model = sub.add_parser(
        "model",
        help="build a model from options and print its parameter count",
        description="Build a GPT from the given options (defaults otherwise), run a forward pass "
        "and print the parameter count of each part, e.g. `gptlab model --n-embd 8 --n-head 2`.",
    )
    add_config_arguments(model, ModelConfig, "model options", exclude=("causal",))
    model.set_defaults(func=cmd_model)
