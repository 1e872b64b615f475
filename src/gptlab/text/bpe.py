"""Byte-level BPE training with Hugging Face `tokenizers`, in a child process that Ctrl-C stops at once,
and `text_pieces`, the cuts that let any tokenizer encode a long text piece by piece.

This file imports nothing from gptlab: the worker runs it by its path, with numpy and tokenizers only.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

from gptlab.config import SettingError

EOT = "<|endoftext|>"  # the end-of-text token: every trained vocabulary reserves it
PIECE_CHARS = 1 << 16  # texts are encoded in pieces of about this many characters

# GPT-2's split pattern (used by bpe and gpt2) ends every word, number or punctuation run before a
# line break, and a whitespace run that starts with a line break takes nothing from before it; so
# cutting a text just before a line break that follows a non-space leaves every encoding unchanged.
# (Cutting *after* a line break would not: "\n\nDIANA" splits as "\n", "\n", "DIANA", but a piece
# ending in "\n\n" keeps the run whole.) The same holds for a space after a non-space: every alternative
# of the pattern that takes a non-space character stops before a space, and none looks behind, so both
# sides of such a cut split as they do in the whole text. Lines longer than a piece (text8, minified
# code) are cut there, so that no single call into a tokenizer runs for long (Ctrl-C waits for it).
_SAFE_CUT = re.compile(r"(?<=\S)\n")
_LONG_LINE_CUT = re.compile(r"(?<=\S)[\n ]")


def _train_bpe_json(text: str, vocab_size: int) -> str:
    """Hugging Face's JSON of a byte-level BPE with merges learnt from `text` (run by the worker)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    # No prefix space and no post-processor, so decode(encode(s)) gives back s exactly.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a pair seen once is not worth a token
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,  # library code does not print
    )
    hf.train_from_iterator(text_pieces(text), trainer=trainer)
    return hf.to_str()


# The worker runs this file by its path rather than importing gptlab.text.tokenizer, whose package imports
# torch (a second or more per training); this file itself needs only numpy and tokenizers. It gets
# this process's import path, so it finds the same packages.
_WORKER = (
    "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "runpy.run_path(sys.argv[1])['_bpe_worker']()"
)


def train_bpe_in_worker(text: str, vocab_size: int) -> str:
    """_train_bpe_json(text, vocab_size), run in a child process that is killed if this call is interrupted.

    Hugging Face's trainer is one call into Rust that never returns to Python until it is done: in this
    process Ctrl-C would wait for the whole training (measured: up to its full length), and a worker
    thread could not be stopped, so it would train on in the background. A process can be killed, and
    a crash of the library (an abort on a failed allocation) ends only the worker. Costs ~0.15 s.
    """
    command = [sys.executable, "-c", _WORKER, __file__, json.dumps(sys.path), str(vocab_size)]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as worker:
        try:
            out, err = worker.communicate(text.encode("utf-8", "surrogatepass"))
        except BaseException:  # Ctrl-C (or SIGTERM, or any error here): stop the training now
            worker.kill()
            worker.wait()
            raise
    if worker.returncode == -signal.SIGINT:  # Ctrl-C reached the worker first; ours is on its way
        raise KeyboardInterrupt
    if worker.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        if worker.returncode < 0:  # the kernel's out-of-memory killer sends SIGKILL
            lines.append(f"killed by {signal.Signals(-worker.returncode).name}, perhaps out of memory")
        raise SettingError(f"BPE training failed in its worker process ({(lines or ['no message'])[-1]}): "
                           "try a smaller {v} or less text", v="vocab_size")
    return out.decode("utf-8")


def _bpe_worker() -> None:
    """The worker's main: the text on stdin, vocab_size as the last argument, the JSON on stdout."""
    # Ctrl-C at a terminal reaches this process too: end at once instead of after the training.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    text = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    sys.stdout.buffer.write(_train_bpe_json(text, int(sys.argv[-1])).encode("utf-8"))


def text_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """Consecutive pieces of about `size` characters, cut only before a line break that ends a line
    (or, in a line longer than `size`, before a space that ends a word).

    Encoding the pieces one by one gives the same ids as encoding the whole text for every kind
    (see _SAFE_CUT), and lets callers show progress, stop between pieces and train BPE in parallel.
    """
    start = 0
    while start < len(text):
        cut = None
        if start + size < len(text):
            cut = _SAFE_CUT.search(text, start + size, start + 2 * size)  # a line break, within reach
            cut = cut or _LONG_LINE_CUT.search(text, start + size)  # else the first break or space
        end = cut.start() if cut else len(text)
        yield text[start:end]
        start = end
