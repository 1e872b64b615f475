"""`gptlab break`: the gallery of classic bugs, each written into a learner-style model.

gallery/reference.py is one correct implementation of handout #11 as a learner writes it (plain
PyTorch, no gptlab). Each entry of BUGS is a few text replacements of that one file, so a bug file
differs from the reference exactly where its bug says. Kind "bug" entries are mistakes that
`gptlab check` must fail at `section` with a cause that names `cause_words`; kind "choice" entries
(no positions, post-norm) are legitimate designs that check must not fail: `side_by_side` trains
them beside the reference to show what they cost instead.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from gptlab.files import atomic_write_text

LR = 2e-3  # AdamW's learning rate in --train, after WARMUP_STEPS of linear warm-up
WARMUP_STEPS = 100


@dataclass(frozen=True)
class Bug:
    """One gallery entry: what it is, where `gptlab check` catches it, and how to write it."""

    name: str  # the command-line name, e.g. "no-scale"
    title: str  # one line for --list
    kind: str  # "bug": check fails it at `section`; "choice": check must fail nothing
    section: str  # the handout section where check catches it (a bug) or notes it (a choice)
    cause_words: tuple[str, ...]  # words or phrases the failed check's cause must contain (any case)
    patches: tuple[tuple[str, str], ...]  # (text of the reference, its replacement): each occurs once
    shows: str  # what to look for in --train
    lr: float = LR  # --train's learning rate, warm-up and heads, for both models
    warmup_steps: int = WARMUP_STEPS
    n_head: int = 4


_MASKING = """\
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: a hidden key gets no weight
    weights = scores.softmax(dim=-1)  # each row sums to one over the keys
"""
_MASKING_AFTER = """\
    weights = scores.softmax(dim=-1)  # each row sums to one over the keys
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)  # a hidden key gets no weight
"""
_EVERY_BLOCK = """\
        for block in self.blocks:
            x = block(x, mask)  # every block is masked
"""
_LAST_BLOCK = """\
        for i, block in enumerate(self.blocks):
            x = block(x, mask if i == len(self.blocks) - 1 else None)  # the last block is masked
"""
_PRE_NORM = """\
        x = x + self.attn(self.ln1(x), mask)
        x = x + self.mlp(self.ln2(x))
"""
_POST_NORM = """\
        x = self.ln1(x + self.attn(x, mask))
        x = self.ln2(x + self.mlp(x))
"""
_LEAK = ("the bug's training loss falls far below the reference's, while its honest validation loss "
         "stays high and its sample is garbage: it learned to read the answer, which generation never has")

BUGS: dict[str, Bug] = {bug.name: bug for bug in (
    Bug("no-scale", "no scale: scores not divided by sqrt(d_k)", "bug", "§3.1", ("not divided by sqrt",),
        ((" / math.sqrt(q.size(-1))", ""),),
        "both have one head of width d_k = 64, where unscaled scores saturate the softmax (§3.1): the bug "
        "learns more slowly, though it trains, which is how it survives; the gap grows with d_k", n_head=1),
    Bug("softmax-queries", "softmax over the query axis (dim=-2) instead of the keys", "bug", "§3.2",
        ("query axis",), (("scores.softmax(dim=-1)", "scores.softmax(dim=-2)"),),
        "each column, not each row, sums to one, so a query's weights depend on the later queries "
        "sharing its column: " + _LEAK),
    Bug("mask-last-block", "causal mask only in the final block", "bug", "§7.3", ("every block",),
        ((_EVERY_BLOCK, _LAST_BLOCK),),
        "an earlier, unmasked block copies the next token into an allowed row: " + _LEAK),
    Bug("mask-after-softmax", "mask applied after the softmax", "bug", "§7.3", ("after the softmax",),
        ((_MASKING, _MASKING_AFTER),),
        "future keys still share each row's denominator, so later tokens leak through its scale: " + _LEAK),
    Bug("mask-zero", "mask filled with 0 instead of -inf", "bug", "§7.3", ("filled with 0",),
        (('masked_fill(~mask, float("-inf"))  # exp(-inf) = 0: a hidden key gets no weight',
          "masked_fill(~mask, 0.0)  # a hidden key gets no score"),),
        "a score of 0 is an ordinary score: every future key keeps exp(0) = 1 in the softmax: " + _LEAK),
    Bug("no-mask", "future leak: the causal mask is built but never passed", "bug", "§7.3",
        ("no causal mask",),
        ((_EVERY_BLOCK, _EVERY_BLOCK.replace("block(x, mask)", "block(x)")),),
        "every position sees the whole window: " + _LEAK),
    Bug("unshifted-targets", "future leak: the loss targets are the inputs, not shifted by one", "bug",
        "§7.3", ("shift",), (("targets.flatten()", "idx.flatten()"),),
        "predicting the token already in the input is copying: the training loss drops to almost 0 "
        "while the honest validation loss (the next token) stays high and the sample is garbage"),
    Bug("heads-averaged", "heads averaged instead of concatenated", "bug", "§4.1",
        ("averaged", "concatenate"),
        (("nn.Linear(n_embd, n_embd)  # W_O", "nn.Linear(n_embd // n_head, n_embd)  # W_O"),
         ("y.transpose(1, 2).reshape(B, T, D)  # concatenate the heads: (B, T, D)",
          "y.mean(dim=1)  # combine the heads: (B, T, D/H)")),
        "W_O sees one average of D/H features instead of H separate answers: the losses stay close at "
        "this size, since the bug costs capacity, not correctness; that is why it survives training"),
    Bug("dot-T", "`.T` on batched keys instead of transpose(-2, -1)", "bug", "§3.2", ("transpose(-2, -1)",),
        (("k.transpose(-2, -1)", "k.T"),),
        "`.T` reverses every axis of a batch: the model crashes on its first batch (or mixes batch items)"),
    Bug("no-positions", "positions missing: no position embedding", "choice", "§6.1", (),
        (("        self.pos = nn.Embedding(config.block_size, config.n_embd)  # learned p_i\n", ""),
         ("        x = x + self.pos(torch.arange(T, device=idx.device))\n", "")),
        "without positions only the causal mask tells rows apart (§6.1): the loss gap is what they buy"),
    Bug("post-norm", "post-norm without warm-up (at a high learning rate)", "choice", "§5",
        (), (('"""§5, pre-norm:', '"""§5, post-norm:'), (_PRE_NORM, _POST_NORM)),
        "both train at a high learning rate with no warm-up: post-norm, with a norm on the residual path "
        "(§5), stalls far above pre-norm, which learns; a warm-up lets post-norm train too",
        lr=3e-2, warmup_steps=0),
)}


def bug_named(name: str) -> Bug:
    """The gallery entry `name`, or a ValueError that lists the names."""
    if name not in BUGS:
        raise ValueError(f"there is no bug named {name!r}: choose one of {', '.join(BUGS)} "
                         "(gptlab break --list describes them)")
    return BUGS[name]


def reference_text() -> str:
    """The correct learner-style implementation, gallery/reference.py."""
    package = importlib.resources.files("gptlab.handout.learner")
    return package.joinpath("gallery/reference.py").read_text("utf-8")


def bug_text(name: str) -> str:
    """The reference with bug `name` written in: each patch replaces its one occurrence."""
    text = reference_text()
    for old, new in bug_named(name).patches:
        assert text.count(old) == 1, f"bug {name}: {old!r} occurs {text.count(old)} times in the reference"
        text = text.replace(old, new)
    return text


def write_bug(name: str, path: str | Path) -> Path:
    """Write the learner-style file with bug `name` to `path` (a course exercise: find the bug)."""
    return _write(Path(path), bug_text(name))


def write_reference(path: str | Path) -> Path:
    """Write the correct learner-style file to `path`."""
    return _write(Path(path), reference_text())


def _write(path: Path, text: str) -> Path:
    """Write `text` unless `path` holds something else: writing the same file twice just works."""
    if path.suffix != ".py":
        raise ValueError(f"{path} does not end in .py: name the file FILE.py so that Python can import it")
    if path.exists():
        if path.is_file() and path.read_bytes() == text.encode("utf-8"):
            return path
        raise ValueError(f"{path} already exists and holds something else: choose another name or delete it")
    atomic_write_text(path, text)
    return path
