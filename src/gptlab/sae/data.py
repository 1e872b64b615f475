"""What an SAE reads: the tokens it is trained and evaluated on, and the activations a model writes at a
hook point over windows of them.

By default a run's SAE reads the run's own prepared data: random windows of its train split for training,
consecutive windows of its val split for the reported figures. `data` may name another prepared folder
(made with the run's tokenizer) or any text (a built-in corpus, a file, a folder), encoded with the run's
tokenizer, its last tenth held out; an imported model, trained elsewhere, has no data of its own and
needs one.

Shape legend: B windows, T positions (the model's block_size), D the site's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.checkpoint import data_folder
from gptlab.config import SettingError
from gptlab.data.corpora import load_text
from gptlab.data.tokens import TokenData
from gptlab.inspection.hooks import hooked, parse_point
from gptlab.model import GPT
from gptlab.text.tokenizer import Tokenizer

HELD_OUT = 0.1  # the share of a text given as `data` kept for the reported figures
EVAL_TOKENS = 2**15  # tokens of the held-out ids the figures are measured on (fewer when there are fewer)
WIDE_POINTS = ("embed", "resid_pre", "attn.in", "attn.out", "mlp.out", "resid_post")  # values (B, T, D)


@dataclass(frozen=True)
class SAEText:
    """The token ids an SAE trains on and is measured on."""

    name: str  # the prepared folder or the text, as sae.json records it
    train: np.ndarray  # ids that training windows are drawn from
    val: np.ndarray  # held-out ids, read in consecutive windows for the figures


def check_site(model: GPT, site: str) -> None:
    """Refuse a hook point whose value is not one D-wide vector per token (scores, weights, heads)."""
    _, point = parse_point(model, site)
    if point not in WIDE_POINTS:
        raise SettingError(f"{{site}} {site} is not one vector of width n_embd per token: an SAE reads "
                           f"embed or h.N.POINT with POINT one of {', '.join(WIDE_POINTS[1:])}",
                           site="SAEConfig.site")


def sae_text(run_dir: Path, state: dict[str, Any], tokenizer: Tokenizer, data: str | None) -> SAEText:
    """The ids of `data` (None: the run's own prepared folder, whose path `state` records), checked to
    fit the run's tokenizer; an imported run without `data` is refused in one line."""
    if data is None:
        if "data_dir" not in state:
            raise SettingError(f"{run_dir} was not trained by gptlab on text (an imported model has no data "
                               "of its own): give the text to read activations from with {data} (a "
                               "prepared folder, a text file or a built-in corpus)", data="data")
        folder = data_folder(run_dir, state)
    elif (Path(data) / "meta.json").is_file():
        folder = Path(data)
    else:
        ids = tokenizer.encode_array(load_text(data))
        cut = round(len(ids) * (1 - HELD_OUT))
        return SAEText(data, ids[:cut], ids[cut:])
    prepared = TokenData(folder)
    if prepared.tokenizer.to_dict() != tokenizer.to_dict():
        raise SettingError(f"{folder} was prepared with another tokenizer than {run_dir}'s: give a folder "
                           "prepared with the run's tokenizer, or a text, as {data}", data="data")
    return SAEText(str(folder.resolve()), prepared.train, prepared.val)


def check_length(text: SAEText, block_size: int) -> None:
    """Refuse ids too short for one window (block_size + 1 tokens) in either part."""
    for part, ids in (("training", text.train), ("held-out", text.val)):
        if len(ids) < block_size + 1:
            raise SettingError(f"the {part} part of {text.name} has {len(ids)} tokens, fewer than one "
                               f"window of block_size + 1 = {block_size + 1}: give more text as {{data}}",
                               data="data")


def random_windows(ids: np.ndarray, count: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """`count` windows (B, T) of block_size tokens from random starts in `ids`, drawn with `generator`."""
    starts = torch.randint(len(ids) - block_size, (count,), generator=generator).numpy()
    return torch.from_numpy(ids[starts[:, None] + np.arange(block_size)].astype(np.int64))  # (B, T)


def held_out_windows(ids: np.ndarray, block_size: int,
                     tokens: int = EVAL_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (B, T) of consecutive windows over the first `tokens` held-out ids."""
    count = max(1, (min(tokens, len(ids) - 1)) // block_size)
    stream = torch.from_numpy(ids[: count * block_size + 1].astype(np.int64))
    return stream[:-1].view(count, block_size), stream[1:].view(count, block_size)


class SiteReached(Exception):
    """Raised by `site_activations`' hook to end a forward pass once the site's value is in hand."""


@torch.no_grad()
def site_activations(model: GPT, site: str, windows: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """The values (B, T, D) the model writes at `site` over `windows` (B, T), float32 on the CPU.

    Each forward pass stops at the site: the later blocks and the head (most of a large vocabulary's cost)
    are never run."""
    device = next(model.parameters()).device
    parts: list[torch.Tensor] = []

    def keep(value: torch.Tensor, name: str) -> None:
        parts.append(value.detach().float().cpu())
        raise SiteReached

    with hooked(model, {site: keep}):
        for start in range(0, len(windows), batch):
            try:
                model(windows[start : start + batch].to(device))
            except SiteReached:
                pass
    return torch.cat(parts)
