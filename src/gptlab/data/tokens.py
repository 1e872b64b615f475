"""`TokenData` memory-maps a prepared data folder and draws (x, y) batches of windows, y being x shifted by
one; a folder damaged or moved is refused with one line that says how to prepare it again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.common import perplexity
from gptlab.config import SettingError
from gptlab.text.tokenizer import (
    DamagedTokenizerError,
    Tokenizer,
    tokenizer_from_dict,
)

SPLITS = ("train", "val")


# ---------------------------------------------------------------------------------------------
# Reading a prepared folder: memory-mapped splits and random batches

REPREPARE = "prepare it again (`gptlab prepare SOURCE --out DIR`)"


def _read_json(path: Path) -> Any:
    """A JSON file's contents; an unreadable or malformed file is one ValueError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path} ({exc.strerror or exc}): {REPREPARE}") from exc
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ValueError(f"{path} is not valid JSON ({exc}): the folder is damaged, {REPREPARE}") from exc


def _read_meta(path: Path) -> dict[str, Any]:
    """meta.json, with the fields that reading the folder relies on checked."""
    meta = _read_json(path)
    tokens = meta.get("tokens") if isinstance(meta, dict) else None
    if (
        not isinstance(tokens, dict)
        or not all(isinstance(tokens.get(name), int) and tokens[name] >= 0 for name in SPLITS)
        or meta.get("dtype") not in ("uint16", "uint32")
    ):
        raise ValueError(
            f"{path} is not a gptlab meta.json (it needs \"dtype\" uint16 or uint32 and \"tokens\" "
            f"counts for {' and '.join(SPLITS)}): the folder is damaged, {REPREPARE}"
        )
    return meta


def _read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer saved in a data folder; anything but a gptlab tokenizer is one ValueError naming it."""
    saved = _read_json(path)
    try:
        return tokenizer_from_dict(saved)
    except DamagedTokenizerError as exc:  # not other ValueErrors: gpt2 without tiktoken says what to install
        raise ValueError(f"{path} is not a gptlab tokenizer ({exc}): {REPREPARE}") from exc


class TokenData:
    """A prepared data folder: its tokenizer, meta dict, and train/val ids memory-mapped from disk.

    Opening it checks everything a damaged or hand-edited folder could get wrong (meta.json,
    tokenizer.json, the files' lengths, every id below the tokenizer's vocab_size), so that a bad
    folder is one clear error here rather than an index error deep inside the model later.
    """

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        meta_path = self.data_dir / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{self.data_dir} is not a prepared data folder (no meta.json): prepare it first"
            )
        self.meta: dict[str, Any] = _read_meta(meta_path)
        self.tokenizer: Tokenizer = _read_tokenizer(self.data_dir / "tokenizer.json")
        self.train: np.ndarray = self._open_split("train")
        self.val: np.ndarray = self._open_split("val")

    def _open_split(self, name: str) -> np.ndarray:
        """The ids of one split, memory-mapped (a corpus larger than memory costs only the pages a batch
        touches), after checking the file's length against meta.json and its ids against the vocabulary."""
        path = self.data_dir / f"{name}.bin"
        dtype, expected = np.dtype(self.meta["dtype"]), self.meta["tokens"][name]
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ValueError(f"cannot read {path} ({exc.strerror or exc}): {REPREPARE}") from exc
        if size != expected * dtype.itemsize:
            tokens = f"{size // dtype.itemsize} tokens" if size % dtype.itemsize == 0 else f"{size} bytes"
            raise ValueError(
                f"{path} holds {tokens}, not the {expected} {dtype.name} tokens of meta.json: "
                f"the folder is damaged, {REPREPARE}"
            )
        if size == 0:  # prepare never writes an empty split (and an empty file cannot be memory-mapped)
            raise ValueError(f"{path} holds no tokens: the folder is damaged, {REPREPARE}")
        ids = np.memmap(path, dtype=dtype, mode="r")
        # One pass over the file: about 0.01 s per 100 MB from the page cache, the disk's speed otherwise.
        top = int(ids.max())
        if top >= self.tokenizer.vocab_size:
            raise ValueError(
                f"{path} holds token id {top}, outside the {self.tokenizer.vocab_size} ids of its "
                f"tokenizer.json: the folder is damaged or mixes two preparations, {REPREPARE}"
            )
        return ids

    def split(self, name: str) -> np.ndarray:
        """The ids of split "train" or "val"."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}: choose one of {', '.join(SPLITS)}")
        return self.train if name == "train" else self.val

    def check_window(self, block_size: int) -> None:
        """Raise a ValueError unless both splits hold at least one window of block_size + 1 tokens."""
        for name in SPLITS:
            self._checked_split(name, block_size)

    def _checked_split(self, name: str, block_size: int) -> np.ndarray:
        data = self.split(name)
        if len(data) < block_size + 1:
            raise SettingError(
                f"the {name} split of {self.data_dir} has {len(data)} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}: prepare more text or choose a smaller {{b}}", b="ModelConfig.block_size",
            )
        return data

    metric_names = ("val_perplexity", "val_bits_per_char")
    selects_best = True  # a validation split of many windows: enough to choose a best checkpoint

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to find this folder again."""
        return {"data_dir": str(self.data_dir)}

    def metrics(self, model: torch.nn.Module, losses: dict[str, float], seed: int,
                device: torch.device) -> dict[str, float | str]:
        """Perplexity, and bits per character for a char tokenizer (one token per character)."""
        bpc = losses["val"] / math.log(2) if self.tokenizer.kind == "char" else ""
        return {"val_perplexity": perplexity(losses["val"]), "val_bits_per_char": bpc}

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs x and targets y, int64 (batch_size, block_size), from random windows of one split.

        y[b, t] is the token after x[b, t]. The starts come from torch.randint with the given (CPU)
        generator, so restoring generator.get_state() replays the same sequence of batches.
        """
        data = self._checked_split(split, block_size)
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator).numpy()
        rows = data[starts[:, None] + np.arange(block_size + 1)]  # (B, T + 1)
        windows = torch.from_numpy(rows.astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # x (B, T), y (B, T)
