"""`gptlab sae train`: a sparse autoencoder on a run's activations at one hook point, exported for SAELens."""

from __future__ import annotations

import argparse
from typing import Any

from gptlab.cli.common import OutputFolder, RunPath, add_config_arguments, add_device_option, config_overrides
from gptlab.sae.config import SAEConfig


def cmd_sae_train(args: argparse.Namespace) -> int:
    """Train, continue or find done the SAE of --site on RUN's activations in --out; print its figures."""
    from gptlab.common import on_terminal
    from gptlab.sae.training import train_sae

    overrides = config_overrides(args, SAEConfig)
    if "width" in overrides and "expansion" in overrides:
        raise ValueError("give --width (features) or --expansion (features per dimension), not both")
    config = SAEConfig(**overrides)  # --site among them
    progress = on_terminal() and not args.no_progress
    result = train_sae(args.run, config, args.out, data=args.data, device=args.device, progress=progress)
    print("\n".join(report(result)))
    return 0


def report(result: Any) -> list[str]:
    """The lines `gptlab sae train` prints about an `SAERun`."""
    config, m = result.config, result.metrics
    if result.trained_now == 0:
        done = f"nothing to train: {result.folder} holds this SAE, trained on {result.tokens:,} tokens"
    else:
        earlier = result.tokens - result.trained_now
        since = f", continuing from {earlier:,}" if earlier else ""
        speed = result.trained_now / max(result.seconds, 1e-9)
        done = (f"trained on {result.trained_now:,} tokens{since} in {result.seconds:.0f} s "
                f"({speed:,.0f} tokens/s)")
    recovered = ("loss recovered undefined: ablating the site barely changes the loss"
                 if m.loss_recovered is None else f"loss recovered {100 * m.loss_recovered:.1f}%")
    return [
        f"{config.width} features at {config.site}, k = {config.k}: {done}",
        f"on {m.tokens:,} held-out tokens:",
        f"  L0 (features active per token)  {m.l0:.1f}",
        f"  explained variance              {m.explained_variance:.3f}",
        f"  dead features                   {100 * m.dead:.1f}%",
        f"  next-token loss (nats): clean {m.loss_clean:.4f}, SAE spliced in {m.loss_spliced:.4f}, "
        f"site zero-ablated {m.loss_zero:.4f} ({recovered})",
        f"wrote {result.folder}: cfg.json and sae_weights.safetensors (SAELens: SAE.load_from_disk), "
        "sae.json, features.html (each feature's top contexts)",
    ]


def add_sae_commands(sub: Any) -> None:
    """`gptlab sae train`."""
    group = sub.add_parser(
        "sae", help="sparse autoencoders on a run's activations (SAELens files)",
        description="Train a TopK sparse autoencoder on the activations of a run at one hook point, and "
        "write it as files SAELens loads (sae_lens.SAE.load_from_disk(DIR)).")
    commands = group.add_subparsers(dest="sae_command", metavar="COMMAND", required=True)
    tr = commands.add_parser(
        "train", help="train a TopK SAE on a run's activations at one hook point",
        description="Stream activations at --site from random windows of the run's training data through "
        "a TopK sparse autoencoder (k features active per token), then report on held-out windows: L0, "
        "explained variance, dead features and the next-token loss with the SAE spliced in, against "
        "clean and with the site zero-ablated. --out receives cfg.json and sae_weights.safetensors "
        "(SAELens's files), sae.json (the settings, the model and data, the figures) and features.html "
        "(each feature's top-activating contexts, offline). The same command again continues an "
        "interrupted run or, when done, only prints the figures; a larger --tokens trains on. A folder "
        "holding an SAE of other settings, another model or other data is refused.",
        epilog="example: gptlab sae train runs/demo --site h.2.resid_post --out runs/demo-sae")
    tr.add_argument("run", type=RunPath(),
                    help="run folder or checkpoint file (from gptlab train or import-hf)")
    tr.add_argument("--site", required=True, help="the hook point to read, e.g. h.1.resid_post: embed or "
                    "h.N.resid_pre, attn.in, attn.out, mlp.out, resid_post")
    tr.add_argument("--out", required=True, metavar="DIR", type=OutputFolder(), help="the SAE's folder")
    tr.add_argument("--data", help="the text to read activations from: a prepared folder (made with the "
                    "run's tokenizer) or a text file, folder or built-in corpus (its last tenth held out); "
                    "default: the run's own data, which an imported model does not have")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_option(tr)
    add_config_arguments(tr, SAEConfig, "SAE options", exclude=("site",),
                         defaults={"width": "expansion times the site's width"})
    tr.set_defaults(func=cmd_sae_train)
