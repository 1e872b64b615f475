"""`prepare`: a text tokenized and written as a data folder, whole or not at all:

    train.bin, val.bin   token ids, raw little arrays of `meta["dtype"]` (uint16 or uint32)
    tokenizer.json       Tokenizer.to_dict(), so a checkpoint can carry its tokenizer
    meta.json            source, tokenizer, vocab_size, dtype, token counts, split scheme
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptlab.data.corpora import load_text
from gptlab.files import fsync, process_alive
from gptlab.text.bpe import text_pieces
from gptlab.text.tokenizer import (
    Tokenizer,
    check_tokenizer_args,
    train_tokenizer,
)

CHUNK_TOKENS = 2048  # the split's chunk length, shortened for small corpora...
MIN_CHUNKS = 100  # ...so that there are at least this many chunks to share out
SPLIT_RULE = "chunk i is validation when floor((i + 1) * val_fraction) > floor(i * val_fraction)"


# ---------------------------------------------------------------------------------------------
# Preparation: text -> tokens -> train/val split -> a data folder


def prepare(
    source: str,
    out_dir: str | Path,
    tokenizer: str | Tokenizer = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    progress: bool = True,
    split: str = "spread",
) -> dict[str, Any]:
    """Tokenize `source` (see load_text) into the data folder `out_dir`; return the meta dict written.

    char and bpe tokenizers are trained on the text itself; a Tokenizer instance (a checkpoint's, for
    fine-tuning) is used as it is. `split` is "spread" (`split_tokens`: validation spread over the
    whole corpus) or "tail" (`tail_split`: the last val_fraction validates, as nanoGPT splits). The
    folder appears complete or not at all: everything is written to a hidden sibling folder first,
    and an earlier preparation in `out_dir` is replaced only once the new one is done.
    """
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 0.5]: for example 0.1")
    if isinstance(tokenizer, str):
        check_tokenizer_args(tokenizer, vocab_size)
    if split not in SPLIT_SCHEMES:
        raise ValueError(f"split={split!r} is not one of: {', '.join(SPLIT_SCHEMES)}")
    out_dir = Path(out_dir)
    _recover(out_dir)
    _check_out_dir(out_dir)
    text = load_text(source)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else train_tokenizer(tokenizer, text, vocab_size)
    ids = encode_text(tok, text, progress)
    train, val, chunk = SPLIT_SCHEMES[split](ids, val_fraction)
    if len(train) == 0 or len(val) == 0:
        raise ValueError(
            f"{source} is too short to split: its {len(ids)} tokens give {len(train)} for training and "
            f"{len(val)} for validation: give more text"
        )
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    meta = {
        "source": source,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "tokens": {"train": len(train), "val": len(val)},
        "characters": len(text),
        "val_fraction": val_fraction,
        "split": {"scheme": "every-kth-chunk", "chunk_tokens": chunk, "rule": SPLIT_RULE}
        if split == "spread" else {"scheme": "tail", "rule": TAIL_RULE},
    }
    _write_data_folder(out_dir, meta, tok, {"train": train.astype(dtype), "val": val.astype(dtype)})
    return meta


def encode_text(tok: Tokenizer, text: str, progress: bool = False) -> np.ndarray:
    """Token ids of a whole corpus as one int64 array, encoded in pieces behind a progress bar."""
    parts = []
    with tqdm(
        total=len(text),
        unit="char",
        unit_scale=True,
        desc=f"encoding ({tok.kind})",
        disable=not progress,
        delay=0.5,
    ) as bar:
        for piece in text_pieces(text):
            parts.append(tok.encode_array(piece))
            bar.update(len(piece))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def split_tokens(ids: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Deterministic held-out split: (train ids, val ids, chunk length).

    The token stream is cut into consecutive chunks of CHUNK_TOKENS (shorter for small corpora, so
    there are at least MIN_CHUNKS of them); chunk i goes to validation when floor((i + 1) * f) >
    floor(i * f), f = val_fraction: every 10th chunk for f = 0.1. Validation is thus spread over
    the whole corpus (every play, every module) rather than being its last tenth. Each split is its
    chunks joined in order, so a window may span a chunk boundary.
    """
    chunk = max(1, min(CHUNK_TOKENS, len(ids) // MIN_CHUNKS))
    index = np.arange(len(ids)) // chunk  # the chunk of each token
    # The small epsilon keeps products such as 10 * 0.1 from landing just below an integer.
    is_val = np.floor((index + 1) * val_fraction + 1e-9) > np.floor(index * val_fraction + 1e-9)
    return ids[~is_val], ids[is_val], chunk


def tail_split(ids: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray, int]:
    """nanoGPT's split: the first 1 - val_fraction of the stream trains, the rest validates."""
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:], len(ids) - cut


SPLIT_SCHEMES = {"spread": split_tokens, "tail": tail_split}
TAIL_RULE = "the first 1 - val_fraction of the tokens train, the rest validate"


def _recover(out_dir: Path) -> None:
    """Undo what a killed preparation into `out_dir` left beside it: its staging folder goes, and the earlier
    preparation it had set aside goes back where nothing replaced it (else goes too)."""
    for path in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        kind, _, rest = path.name.removeprefix(f".{out_dir.name}.").partition("-")
        pid = rest.split("-")[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or process_alive(int(pid)):
            continue  # not ours, or its preparation is still running
        if kind == "old" and not out_dir.exists():
            os.replace(path, out_dir)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace anything but a missing folder, an empty one or an earlier preparation."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "meta.json").is_file()):
        raise ValueError(f"{out_dir} exists and is not a prepared data folder: choose another output folder")


def _write_data_folder(
    out_dir: Path, meta: dict[str, Any], tok: Tokenizer, splits: dict[str, np.ndarray]
) -> None:
    """Write everything into a hidden sibling folder, then move it to out_dir in one step."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-{os.getpid()}-"))
    files: dict[str, bytes | memoryview] = {f"{split}.bin": np.ascontiguousarray(ids).data
                                            for split, ids in splits.items()}
    files["tokenizer.json"] = json.dumps(tok.to_dict()).encode("utf-8")
    files["meta.json"] = (json.dumps(meta, indent=2) + "\n").encode("utf-8")
    try:
        for name, data in files.items():
            _write_file(staging / name, data, out_dir)
        for file in staging.iterdir():  # on the disk before the folder is published
            fsync(file)
        _check_out_dir(out_dir)  # again: it may have changed while we tokenized
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left to remove once it has been moved


def _write_file(path: Path, data: bytes | memoryview, out_dir: Path) -> None:
    """Write one file of the staging folder; a full disk is one line naming what could not be written."""
    try:
        with path.open("wb") as f:
            f.write(data)
    except OSError as err:
        reason = err.strerror or str(err)
        raise OSError(f"could not write {path.name} of {out_dir} ({reason}): nothing was changed; free some "
                      "space and prepare again") from err


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the finished staging folder to out_dir; an earlier preparation is set aside, then deleted."""
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    # A directory cannot be renamed onto a non-empty one, so the old folder moves away first.
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        os.replace(old, out_dir)  # put the earlier preparation back (even on Ctrl-C)
        raise
    try:
        shutil.rmtree(old)
    except BaseException:  # Ctrl-C half-way: finish removing it (a moment), leave no hidden folder behind
        shutil.rmtree(old, ignore_errors=True)
        raise
